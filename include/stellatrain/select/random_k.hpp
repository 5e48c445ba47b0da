// SPDX-License-Identifier: Apache-2.0
// Random-k selection: k distinct indices drawn uniformly from a counter-based generator keyed
// by (seed, step, tensor), so that a receiver regenerates them instead of receiving them.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

namespace stellatrain {

/// Random-k selection without replacement.
///
/// The index set is exactly `sample_sorted_indices(key, n, k)` (core/random_indices.hpp):
/// uniform over all subsets of min(k, n) indices, strictly ascending, a pure function of
/// (key, n, k). It differs from step to step (`key.step`) and from tensor to tensor
/// (`key.tensor`) and is identical on every rank with the same seed, so a receiver that knows
/// the key and n regenerates the indices with that same function and the wire needs to carry
/// only the values. Values are copied from `x` (magnitudes play no part, so the set is not the
/// top k: `selection_stats::exact` is false unless k >= n).
///
/// Cost: O(k) generator draws plus a scan of an n-bit bitmap (or a sort when k is far below
/// n / 1024), and a gather of k values. Memory: the bitmap, n / 8 bytes, kept all-zero
/// between calls (pre-faulted once). Not thread safe per object.
///
/// \code
///   stellatrain::random_k_selector<> rk;
///   auto key = stellatrain::random_key{.seed = 42, .step = step, .tensor = layer};
///   rk.select(pool, key, std::span<const float>(grad), k, std::span(idx), std::span(val));
///   // receiver: stellatrain::sample_sorted_indices<std::uint32_t>(key, n, k, idx, workspace)
/// \endcode
template <class Arch = xsimd::default_arch>
class random_k_selector {
 public:
  using arch_type = Arch;
  /// Nothing is kept from call to call: the indices are a function of the key.
  struct tensor_state {};
  /// The bitmap of the draw and the drawn indices.
  struct workspace {
    aligned_buffer<std::uint64_t> bitmap;
    aligned_buffer<std::uint64_t> drawn;
  };

  /// `select_from` keys tensor `ctx.tensor` at step `ctx.step` of slice `ctx.slice` by
  /// random_key{seed + slice, step, tensor}.
  explicit random_k_selector(std::uint64_t seed = 0) noexcept : seed_(seed) {}

  [[nodiscard]] std::uint64_t seed() const noexcept { return seed_; }

  /// Allocates (pre-faulting across `ex`) the bitmap for tensors of up to `n` elements and
  /// room for `k` drawn indices.
  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    const std::uint64_t words = sample_indices_workspace_words(n);
    if (words > ws.bitmap.size())
      ws.bitmap = aligned_buffer<std::uint64_t>(words, {.prefault = true}, ex);
    if (k > ws.drawn.size()) ws.drawn = aligned_buffer<std::uint64_t>(k, {.prefault = true}, ex);
  }
  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t n) {
    reserve(ex, ws_.get(), n, 0);
  }

  /// One selection from `src` (see the `selector` concept): the first pass runs the source
  /// over every element (its error-feedback update), then the drawn elements are read again.
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, tensor_state&, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context& ctx,
                              Emit&& emit) const {
    if (auto done = detail::select_trivial<Arch>(ex, src, n, k, emit)) return *done;
    detail::consume_source<Arch>(ex, src, n);
    reserve(ex, ws, n, k);
    const random_key key{.seed = seed_ + ctx.slice,
                         .step = static_cast<std::uint32_t>(ctx.step),
                         .tensor = ctx.tensor};
    std::span<std::uint64_t> drawn(ws.drawn.data(), static_cast<std::size_t>(k));
    sample_sorted_indices<std::uint64_t>(key, n, k, drawn, ws.bitmap.span());
    const auto rd = src.reread();
    for_each_chunk(ex, k, std::uint64_t{1} << 14, [&](std::uint64_t b, std::uint64_t e) {
      for (std::uint64_t j = b; j < e; ++j) emit(j, drawn[j], rd.load_scalar(drawn[j]));
    });
    return {.count = k, .exact = false, .passes = 1};
  }

  /// Writes the min(k, n) elements of `x` at the indices drawn for `key` to the front of
  /// `indices` and `values` (indices ascending, offset by `index_base`). Errors as
  /// `exact_topk_selector::select`.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, random_key key, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    const std::uint64_t n = x.size();
    detail::check_selection_args<Index>("random_k_selector::select", n, k, indices.size(),
                                        values.size(), index_base);
    const std::uint64_t m = std::min(k, n);
    if (m == 0) return {};
    reserve(ex, n);
    sample_sorted_indices<Index>(key, n, m, indices, ws_.get().bitmap.span());
    for_each_chunk(ex, m, std::uint64_t{1} << 14, [&](std::uint64_t b, std::uint64_t e) {
      for (std::uint64_t j = b; j < e; ++j) {
        values[j] = x[indices[j]];
        indices[j] = static_cast<Index>(indices[j] + index_base);
      }
    });
    return {.count = m, .exact = m == n, .passes = 0};
  }

  /// As above, into `out` (resized to min(k, n); its capacity grows if too small).
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, random_key key, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, sparse_buffer<T, Index>& out,
                         std::uint64_t index_base = 0) {
    detail::resize_for_selection(out, x.size(), k);
    return select(ex, key, x, k, out.indices(), out.values(), index_base);
  }

 private:
  std::uint64_t seed_ = 0;
  detail::copy_fresh<workspace> ws_;
};

static_assert(selector<random_k_selector<>>);

}  // namespace stellatrain
