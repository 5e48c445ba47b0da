// SPDX-License-Identifier: Apache-2.0
// Exact top-k by magnitude on the CPU: radix select whose histogram pass skips, with SIMD
// compares, every element below a sampled lower bound; exact in every case.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/detail/exact_select.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

namespace stellatrain {

/// Tuning of `exact_topk_selector` (the result never depends on it, only the speed does).
struct exact_topk_options {
  /// Elements sampled (one per stratum of n / samples, at a hashed place inside it) to
  /// estimate a lower bound of the k-th magnitude.
  std::uint64_t samples = 16384;
  /// How far below the sample's estimate the bound goes, in standard deviations of the sample
  /// count: larger keeps more candidates and makes a fallback rarer.
  double margin_sigmas = 4.0;
  /// The candidate store holds min(n, 2 k + min_capacity) entries of 8 bytes.
  std::uint64_t min_capacity = 65536;
};

/// Exact top-k selection by magnitude key (see select/selection.hpp for the shared semantics:
/// NaN above +inf above finite values, ties to the lowest index, exactly min(k, n) results,
/// indices ascending).
///
/// Algorithm: radix select on the bits of |x|. A stratified sample of `samples` elements gives
/// a lower bound L of the k-th key (with a margin of `margin_sigmas`); the histogram pass then
/// compares every element with L in SIMD and keeps the few that reach it (about k (1 + a few
/// %) "candidates", with their index and value) in a caller-reusable store, so the data is read
/// once. Radix narrowing with 11-bit digits on the candidates finds the exact k-th key, and the
/// candidates are emitted in index order. If L was too high (fewer than k reached it) or too
/// low (the store overflowed, e.g. when huge numbers of elements tie), full radix passes over
/// the data (histogram per 11-bit digit, then filter the surviving bucket) finish the job:
/// the result is exact in every case, only the number of passes (reported) changes. When L is
/// the smallest non-zero key and fewer than k elements are non-zero, the lowest-index zeros are
/// the ties, so that case stays one pass.
///
/// Cost: one streaming read of x (SIMD compare and compress-store; memory bound), O(samples)
/// random reads, O(k) work on the candidates; worst case (adversarial or massively tied data)
/// five passes. Work is split across the executor in chunks of 32768 elements. Memory: a
/// store of min(n, 2k + min_capacity) x 8 bytes plus per-chunk segment records, grown on
/// demand and kept (pre-faulted); no allocation once it has seen its largest (n, k).
/// Not thread safe: one call at a time per selector object.
///
/// `Arch` is the xsimd architecture of the kernels (`scalar_arch` runs the scalar loops that
/// define the results; every architecture returns the same bits).
///
/// \code
///   stellatrain::thread_pool pool{2};
///   stellatrain::exact_topk_selector<> topk;
///   std::vector<float> g = ...;                       // 25M gradients
///   std::vector<std::uint32_t> idx(250'000);
///   std::vector<float> val(250'000);
///   auto stats = topk.select(pool, std::span<const float>(g), 250'000, std::span(idx),
///   std::span(val));
/// \endcode
template <class Arch = xsimd::default_arch>
class exact_topk_selector {
 public:
  using arch_type = Arch;
  /// Nothing is kept from call to call.
  struct tensor_state {};
  /// The candidate store and the histograms of the full passes.
  using workspace = detail::candidate_select_workspace;

  exact_topk_selector() = default;
  explicit exact_topk_selector(exact_topk_options options) : options_(options) {}

  [[nodiscard]] const exact_topk_options& options() const noexcept { return options_; }

  /// Allocates (and pre-faults across `ex`) what calls with up to `n` elements and `k`
  /// selected need, so that no later call allocates.
  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    ws.candidates.reserve(ex, detail::exact_capacity(n, k, options_.min_capacity), n,
                          options_.samples);
  }
  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t n, std::uint64_t k) {
    reserve(ex, ws_.get(), n, k);
  }

  /// One selection from `src` (see the `selector` concept).
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, tensor_state&, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context&,
                              Emit&& emit) const {
    if (auto done = detail::select_trivial<Arch>(ex, src, n, k, emit)) return *done;
    reserve(ex, ws, n, k);
    const detail::exact_tuning tuning{.samples = options_.samples, .z = options_.margin_sigmas};
    return detail::stats_of(
        detail::select_exact<Arch>(ex, src, n, k, k, tuning, ws.candidates, ws.radix, emit));
  }

  /// Writes the top min(k, n) of `x` (n = x.size()) to the front of `indices` and `values`,
  /// indices ascending and offset by `index_base`. Throws `errc::invalid_argument` if the
  /// outputs are shorter than min(k, n), `errc::out_of_range` if index_base + n - 1 does not
  /// fit `Index`.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                         std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    tensor_state none;
    return detail::select_into("exact_topk_selector::select", *this, ex, none, ws_.get(), x, k,
                               indices, values, index_base);
  }

  /// As above, into `out` (resized to min(k, n); its capacity grows if too small).
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                         sparse_buffer<T, Index>& out, std::uint64_t index_base = 0) {
    tensor_state none;
    return detail::select_into("exact_topk_selector::select", *this, ex, none, ws_.get(), x, k, out,
                               index_base);
  }

 private:
  exact_topk_options options_{};
  detail::copy_fresh<workspace> ws_;
};

static_assert(selector<exact_topk_selector<>>);

}  // namespace stellatrain
