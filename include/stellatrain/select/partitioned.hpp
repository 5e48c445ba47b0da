// SPDX-License-Identifier: Apache-2.0
// Partitioned selection: rank r of P selects k / P from a rotating 1 / P slice of the tensor,
// so the selections gathered from all ranks never overlap.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/selection.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

/// Which share of the work one rank does: rank `rank` of `parts` ranks (parts >= 1).
struct partition {
  std::uint32_t rank = 0;
  std::uint32_t parts = 1;
};

/// The slice of a tensor one rank selects from at one step, and how many it selects there.
struct partition_slice {
  std::uint64_t begin = 0;  ///< first element of the slice
  std::uint64_t end = 0;    ///< one past its last element
  std::uint64_t k = 0;      ///< elements this rank selects from it
  std::uint32_t slice = 0;  ///< which of the P slices: (rank + step) mod P
};

/// The slice that rank `p.rank` of `p.parts` selects from at `step`, for a tensor of `n`
/// elements of which k are selected in all: slice j = (rank + step) mod P covers
/// [bound(j), bound(j + 1)) with bound(j) = floor(j n / P) rounded down to a multiple of
/// `align` (16 fp32 = one cache line; bound(P) = n), and the rank selects k / P there, one more
/// for the slices j < k mod P. At every step the P ranks cover P different slices (disjoint,
/// together the whole tensor, together k elements when every slice holds its share), and
/// every rank cycles through all slices in P steps. Throws `errc::invalid_argument` unless
/// rank < parts and align >= 1.
[[nodiscard]] inline partition_slice slice_of(partition p, std::uint64_t n, std::uint64_t k,
                                              std::uint64_t step, std::uint64_t align = 16) {
  if (p.parts == 0 || p.rank >= p.parts || align == 0) {
    throw_error(errc::invalid_argument, "slice_of: rank " + std::to_string(p.rank) + " of " +
                                            std::to_string(p.parts) + " parts (align " +
                                            std::to_string(align) + ") is not a valid partition");
  }
  __extension__ using u128 = unsigned __int128;
  const std::uint64_t parts = p.parts;
  const auto j = static_cast<std::uint32_t>((p.rank + step % parts) % parts);
  auto bound = [&](std::uint64_t s) -> std::uint64_t {
    if (s >= parts) return n;
    const auto b = static_cast<std::uint64_t>(static_cast<u128>(s) * n / parts);
    return b / align * align;
  };
  return {
      .begin = bound(j), .end = bound(j + 1), .k = k / parts + (j < k % parts ? 1 : 0), .slice = j};
}

/// Runs a `selector` on this rank's slice of every tensor (see `slice_of`): rank r of P
/// selects k / P elements from the slice (r + step) mod P, with indices into the whole tensor.
/// Each call returns min(slice k, slice size) elements, indices ascending; gathered over the
/// P ranks of one step, the selections are disjoint. The reference used this so that an
/// all-gather of the selections needs no merge of duplicates.
///
/// As a `selector` (what `error_feedback_compressor` uses), a call still runs the source over
/// the whole tensor (the error-feedback update of every element), selects from the slice with
/// the inner selector (its state per slice: each slice keeps its own threshold bound), and
/// emits the slice's share (fewer than k: `selection_stats::count` says how many). The slice
/// rotates with `selection_context::step`, and the inner selector sees the slice number in
/// `selection_context::slice` (random-k keys by it).
///
/// \code
///   stellatrain::partitioned_selector<stellatrain::exact_topk_selector<>> sel({.rank = r, .parts =
///   world}); auto st = sel.select(pool, step, std::span<const float>(g), k, std::span(idx),
///   std::span(val));
/// \endcode
template <selector Inner = exact_topk_selector<>>
class partitioned_selector {
 public:
  using inner_type = Inner;
  using arch_type = selector_arch_t<Inner>;
  /// The inner selector's state of each slice (created on the first call).
  struct tensor_state {
    std::vector<typename Inner::tensor_state> slices;
  };
  using workspace = typename Inner::workspace;

  partitioned_selector() = default;
  /// Throws `errc::invalid_argument` for an invalid partition (see `slice_of`).
  explicit partitioned_selector(partition part, Inner inner = {})
      : part_(part), inner_(std::move(inner)) {
    (void)slice_of(part_, 0, 0, 0);
  }

  [[nodiscard]] const partition& part() const noexcept { return part_; }
  [[nodiscard]] const Inner& inner() const noexcept { return inner_; }

  /// Allocates what calls on tensors of up to `n` elements with `k` selected in all need.
  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    const std::uint64_t parts = part_.parts;
    inner_.reserve(ex, ws, std::min(n, n / parts + 2 * slice_align), std::min(k, k / parts + 1));
  }

  /// The same for the span interface's own workspace.
  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t n, std::uint64_t k) {
    reserve(ex, ws_.get(), n, k);
  }

  /// One call (see the class comment): emits this rank's share of the k elements.
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, tensor_state& state, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context& ctx,
                              Emit&& emit) const {
    const partition_slice s = slice_of(part_, n, k, ctx.step);
    detail::consume_source<arch_type>(ex, src, s.begin);
    detail::consume_source<arch_type>(ex, src.offset_by(s.end), n - s.end);
    const std::uint64_t sn = s.end - s.begin;
    const std::uint64_t m = std::min(s.k, sn);
    const auto slice_src = src.offset_by(s.begin);
    if (m == 0 || m == sn) {
      detail::consume_source<arch_type>(ex, slice_src, sn);
      const auto rd = slice_src.reread();
      for_each_chunk(ex, m, std::uint64_t{1} << 16, [&](std::uint64_t b, std::uint64_t e) {
        for (std::uint64_t i = b; i < e; ++i) emit(i, s.begin + i, rd.load_scalar(i));
      });
      return {.count = m, .passes = 1};
    }
    if (state.slices.size() != part_.parts) state.slices.resize(part_.parts);
    auto shifted = [&](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
      emit(pos, s.begin + i, bits);
    };
    const selection_context inner_ctx{.tensor = ctx.tensor, .step = ctx.step, .slice = s.slice};
    return inner_.select_from(ex, state.slices[s.slice], ws, slice_src, sn, m, inner_ctx, shifted);
  }

  /// Writes / reads `state`: the slice count, then each slice's inner state.
  void save(const tensor_state& state, state_record_writer& w) const {
    w.put(static_cast<std::uint32_t>(state.slices.size()));
    if constexpr (!std::is_empty_v<typename Inner::tensor_state>) {
      for (const auto& s : state.slices) inner_.save(s, w);
    }
  }
  void load(tensor_state& state, state_record_reader& r) const {
    const auto count = r.get<std::uint32_t>();
    if (count != 0 && count != part_.parts) {
      r.fail("the state holds " + std::to_string(count) + " slices, this selector has " +
             std::to_string(part_.parts));
    }
    tensor_state t;
    t.slices.resize(count);
    if constexpr (!std::is_empty_v<typename Inner::tensor_state>) {
      for (auto& s : t.slices) inner_.load(s, r);
    }
    state = std::move(t);
  }

  /// Selects this rank's share of `x` at `step` into the front of `indices` and `values`
  /// (indices into `x`, plus `index_base`), keeping the inner selector's state per slice in
  /// this object. Errors as the inner selector's span interface.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, std::uint64_t step, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    const partition_slice s = slice_of(part_, x.size(), k, step);
    const auto slice = x.subspan(s.begin, s.end - s.begin);
    if (state_.slices.size() != part_.parts) state_.slices.resize(part_.parts);
    return detail::select_into("partitioned_selector::select", inner_, ex, state_.slices[s.slice],
                               ws_.get(), slice, s.k, indices, values, index_base + s.begin,
                               {.step = step, .slice = s.slice});
  }

 private:
  static constexpr std::uint64_t slice_align = 16;

  partition part_{};
  Inner inner_{};
  tensor_state state_;
  detail::copy_fresh<workspace> ws_;
};

static_assert(selector<partitioned_selector<>>);

}  // namespace stellatrain
