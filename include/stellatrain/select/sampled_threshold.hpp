// SPDX-License-Identifier: Apache-2.0
// DGC-style sampled threshold selection: estimate the threshold from a strided sample, make
// one pass, correct to exactly k.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/detail/candidate_collect.hpp>
#include <stellatrain/select/detail/candidate_emit.hpp>
#include <stellatrain/select/detail/candidate_kth.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>
#include <stellatrain/select/detail/exact_select.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>

namespace stellatrain {

/// Tuning of `sampled_threshold_selector`.
struct sampled_threshold_options {
  /// Fraction of the elements sampled (DGC samples 0.1% to 1%), at least `min_samples`.
  double sample_fraction = 0.001;
  std::uint64_t min_samples = 1024;
  /// How far below the sample's estimate of the k-th magnitude the threshold goes, in standard
  /// deviations of the sample count (0: the plain estimate, which misses half the time).
  double margin_sigmas = 2.0;
  /// The candidate store holds min(n, 3 k + min_capacity) entries of 8 bytes.
  std::uint64_t min_capacity = 65536;
};

namespace detail {

[[nodiscard]] inline std::uint64_t sampled_count(std::uint64_t n,
                                                 const sampled_threshold_options& o) noexcept {
  const double s = std::ceil(static_cast<double>(n) * std::clamp(o.sample_fraction, 0.0, 1.0));
  return std::clamp<std::uint64_t>(
      std::max<std::uint64_t>(static_cast<std::uint64_t>(s), o.min_samples), 1, n);
}

/// One sampled-threshold selection of `src` (0 < k < n).
template <class Arch, class Source, executor Ex, class Emit>
select_outcome sampled_threshold_select(Ex& ex, const Source& src, std::uint64_t n, std::uint64_t k,
                                        const sampled_threshold_options& options,
                                        candidate_workspace& ws, radix_workspace& rw, Emit&& emit) {
  constexpr std::uint32_t key_mask = Source::key_mask;
  [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
  const std::uint64_t samples = sampled_count(n, options);
  ws.reserve(ex, threshold_capacity(n, k, options.min_capacity), n, samples);
  std::uint32_t low = 0;
  if (n > ws.capacity()) {
    low = sample_low_key(ex, src, n, k, samples, options.margin_sigmas, /*jitter=*/false,
                         ws.keys.data());
  }
  const collect_result r = collect_candidates<Arch>(ex, src, n, low, {0, 0}, ws);
  select_outcome outcome;
  outcome.passes = 1;
  if (r.overflow) {
    outcome = radix_select_full<Arch>(ex, src.reread(), n, k, ws, rw, emit);
    outcome.passes += 1;
  } else if (r.count >= k) {
    const kth_key kth = find_kth_candidate<Arch>(ex, ws, k, key_mask);
    emit_candidates<Arch>(ex, ws, key_mask, kth, k, emit);
    outcome.kth_key = kth.key;
    outcome.count = k;
  } else {
    emit_all_with_fill(ws, k - r.count, n, src.reread(), emit);
    outcome.count = k;
    outcome.deficit = true;
    outcome.exact = low <= 1;
  }
  return outcome;
}

}  // namespace detail

/// Sampled threshold selection in the manner of Deep Gradient Compression: the k-th magnitude
/// is estimated from a strided sample (`sample_fraction` of the elements, one at the start of
/// each stratum), lowered by `margin_sigmas` standard deviations of the sample count, and one
/// SIMD pass keeps the elements reaching it. Then the result is corrected to exactly
/// min(k, n): if at least k reached the threshold, the exact top k of them (which is the
/// exact top k of the tensor); if fewer did (the estimate was too high), all of them plus the
/// lowest-index elements below it, approximate, without another pass. Only when far more than
/// k reach it (the store of 3k + min_capacity overflows: massive ties, or a sample that
/// missed the structure of the data) does it run full radix passes, which are exact.
///
/// Unlike `exact_topk_selector` it never spends a second pass to stay exact when the estimate
/// is too high; unlike `threshold_selector` it keeps no state. Shared semantics in
/// select/selection.hpp; `selection_stats::exact` tells whether the set is the exact top k.
/// Cost: O(samples) strided reads, one streaming read, O(k) on the candidates.
template <class Arch = xsimd::default_arch>
class sampled_threshold_selector {
 public:
  using arch_type = Arch;
  /// Nothing is kept from call to call.
  struct tensor_state {};
  /// The candidate store and the histograms of the fallback's full passes.
  using workspace = detail::candidate_select_workspace;

  sampled_threshold_selector() = default;
  explicit sampled_threshold_selector(sampled_threshold_options options) : options_(options) {}

  [[nodiscard]] const sampled_threshold_options& options() const noexcept { return options_; }

  /// Allocates (pre-faulting across `ex`) what calls with up to `n` elements and `k` need.
  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    ws.candidates.reserve(ex, detail::threshold_capacity(n, k, options_.min_capacity), n,
                          detail::sampled_count(n, options_));
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
    return detail::stats_of(detail::sampled_threshold_select<Arch>(ex, src, n, k, options_,
                                                                   ws.candidates, ws.radix, emit));
  }

  /// Writes min(k, n) elements of `x` to the front of `indices` and `values` (indices
  /// ascending, offset by `index_base`). Errors as `exact_topk_selector::select`.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                         std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    tensor_state none;
    return detail::select_into("sampled_threshold_selector::select", *this, ex, none, ws_.get(), x,
                               k, indices, values, index_base);
  }

  /// As above, into `out` (resized to min(k, n); its capacity grows if too small).
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                         sparse_buffer<T, Index>& out, std::uint64_t index_base = 0) {
    tensor_state none;
    return detail::select_into("sampled_threshold_selector::select", *this, ex, none, ws_.get(), x,
                               k, out, index_base);
  }

 private:
  sampled_threshold_options options_{};
  detail::copy_fresh<workspace> ws_;
};

static_assert(selector<sampled_threshold_selector<>>);

}  // namespace stellatrain
