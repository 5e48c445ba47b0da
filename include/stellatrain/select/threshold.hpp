// SPDX-License-Identifier: Apache-2.0
// Threshold selection with a persistent per-tensor bound: one SIMD pass per call, exactly k
// results every call, no refill pass on any call.
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

/// Tuning of `threshold_selector`.
struct threshold_options {
  /// The band aims at k (1 + margin) elements: the margin absorbs the drift of the magnitudes
  /// from one call to the next. Larger costs a little more work per call (O(k margin)).
  double margin = 0.25;
  /// The candidate store holds min(n, 3 k + min_capacity) entries of 8 bytes.
  std::uint64_t min_capacity = 65536;
  /// Tuning of the exact selection that bootstraps the bound (first call, new n or dtype, k
  /// beyond what the band was sized for) and of the fallback.
  exact_topk_options bootstrap{};
};

/// Per-tensor state of threshold selection. Plain data: copy it, save it with a checkpoint,
/// restore it, and the next call continues exactly as the uninterrupted run would.
struct threshold_state {
  std::uint32_t low_key =
      0;  ///< magnitude key the next call's band starts at (0: not bootstrapped)
  std::uint32_t kth_key = 0;          ///< magnitude key of the k-th element of the last call
  std::uint64_t tensor_size = 0;      ///< n the bound was derived for (another n re-bootstraps)
  std::uint64_t target = 0;           ///< band size the bound aims at: ceil(k (1 + margin))
  dtype element = dtype::f32;         ///< element type the keys belong to
  std::uint64_t calls = 0;            ///< calls so far
  std::uint64_t last_candidates = 0;  ///< elements in the band on the last call
  std::uint64_t deficits = 0;         ///< calls whose band held fewer than k (filled, approximate)
  std::uint64_t fallbacks = 0;   ///< calls whose band overflowed the store (exact, more passes)
  std::uint64_t bootstraps = 0;  ///< calls that derived the bound by exact selection
};

namespace detail {

// The magnitude between (hi, c_hi) and (lo, c_lo) (hi > lo, c_hi < target <= c_lo) where the
// count reaches `target`, interpolating log(count) linearly in log(magnitude): a power-law
// tail, which fits the tails of Gaussian-like gradients well enough over a short range.
[[nodiscard]] inline float interpolate_magnitude(float hi, double c_hi, float lo, double c_lo,
                                                 double target) noexcept {
  if (!(hi > 0.0f) || !(lo > 0.0f) || !std::isfinite(hi)) return lo;
  const double a = std::log(std::max(c_hi, 1.0));
  const double b = std::log(std::max(c_lo, 1.0));
  if (!(b > a)) return lo;
  const double t = std::clamp((std::log(target) - a) / (b - a), 0.0, 1.0);
  const double lh = std::log(static_cast<double>(hi));
  const double ll = std::log(static_cast<double>(lo));
  return static_cast<float>(std::exp(lh + t * (ll - lh)));
}

// Edges below the band at which a call also counts elements: the next bound is interpolated
// from them when the band held fewer than its target.
inline constexpr float threshold_edge_ratio[2] = {0.85f, 0.6f};

/// One call of threshold selection of `src` (0 < k < n). See `threshold_selector`.
template <class Arch, class T, class Source, executor Ex, class Emit>
select_outcome threshold_select(Ex& ex, const Source& src, std::uint64_t n, std::uint64_t k,
                                const threshold_options& options, threshold_state& state,
                                candidate_workspace& ws, radix_workspace& rw, Emit&& emit) {
  constexpr std::uint32_t key_mask = Source::key_mask;
  [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
  const double target_d = std::ceil(static_cast<double>(k) * (1.0 + std::max(0.0, options.margin)));
  const std::uint64_t target =
      std::clamp<std::uint64_t>(static_cast<std::uint64_t>(target_d), k, n);
  ws.reserve(ex, threshold_capacity(n, k, options.min_capacity), n, options.bootstrap.samples);

  const bool bootstrap = state.low_key == 0 || state.tensor_size != n ||
                         state.element != dtype_of<T> || k > state.target;
  select_outcome outcome;
  collect_result band;
  kth_search first_level;
  bool have_first_level = false;
  std::uint32_t edges[2] = {0, 0};
  if (bootstrap) {
    const exact_tuning tuning{.samples = options.bootstrap.samples,
                              .z = options.bootstrap.margin_sigmas};
    outcome = select_exact<Arch>(ex, src, n, k, target, tuning, ws, rw, emit);
    ++state.bootstraps;
  } else {
    const float low_mag = key_value<T>(state.low_key);
    for (int j = 0; j < 2; ++j)
      edges[j] = std::max<std::uint32_t>(1, key_at_most<T>(low_mag * threshold_edge_ratio[j]));
    band = collect_candidates<Arch, 2>(ex, src, n, state.low_key, {edges[0], edges[1]}, ws);
    outcome.passes = 1;
    if (band.overflow) {
      // The magnitudes jumped far above the bound: an exact selection by full radix passes.
      outcome = radix_select_full<Arch>(ex, src.reread(), n, k, ws, rw, emit);
      outcome.passes += 1;
      ++state.fallbacks;
    } else if (band.count >= k) {
      kth_first_level(ex, ws, key_mask, first_level);
      have_first_level = true;
      const kth_key kth = kth_resolve<Arch>(ex, ws, key_mask, first_level, k);
      emit_candidates<Arch>(ex, ws, key_mask, kth, k, emit);
      outcome.kth_key = kth.key;
      outcome.count = k;
      outcome.candidates_valid = true;
    } else {
      // Fewer than k in the band: all of it, plus the lowest-index elements below it. No
      // extra pass; exact only when the band started at the smallest non-zero key.
      emit_all_with_fill(ws, k - band.count, n, src.reread(), emit);
      outcome.kth_key = 0;
      outcome.count = k;
      outcome.candidates_valid = true;
      outcome.deficit = true;
      outcome.exact = state.low_key == 1;
      ++state.deficits;
    }
  }

  // The bound of the next call: the key of rank `target` of this call when the band holds it,
  // else interpolated from the counts below the band.
  std::uint32_t next = 0;
  if (outcome.candidates_valid && ws.count >= target) {
    // The floor of the bin that holds rank `target`: within 1/2048 of the band's range below
    // the exact key, which only widens the next band by a hair.
    if (!have_first_level) kth_first_level(ex, ws, key_mask, first_level);
    next = std::max<std::uint32_t>(kth_floor(first_level, target), 1);
  } else if (!bootstrap && !band.overflow) {
    const float l0 = key_value<T>(state.low_key);
    const float l1 = key_value<T>(edges[0]);
    const float l2 = key_value<T>(edges[1]);
    const auto c0 = static_cast<double>(band.count);
    const auto c1 = static_cast<double>(band.at_or_above[0]);
    const auto c2 = static_cast<double>(band.at_or_above[1]);
    const auto t = static_cast<double>(target);
    float m;
    if (c1 >= t) {
      m = interpolate_magnitude(l0, c0, l1, c1, t);
    } else if (c2 >= t) {
      m = interpolate_magnitude(l1, c1, l2, c2, t);
    } else {
      m = 0.0f;  // Nothing to place the bound by: bootstrap (sample + exact) on the next call.
    }
    next = m > 0.0f ? std::max<std::uint32_t>(key_at_most<T>(m), 1) : 0;
  } else {
    // Only the k-th key is known: step below it.
    next = std::max<std::uint32_t>(
        key_at_most<T>(key_value<T>(outcome.kth_key) * threshold_edge_ratio[0]), 1);
  }
  state.low_key = next;
  state.kth_key = outcome.kth_key;
  state.tensor_size = n;
  state.target = target;
  state.element = dtype_of<T>;
  state.last_candidates = bootstrap || band.overflow ? ws.count : band.count;
  ++state.calls;
  return outcome;
}

}  // namespace detail

/// Threshold selection with a persistent per-tensor bound, returning exactly min(k, n)
/// elements on every call (shared semantics in select/selection.hpp).
///
/// Each tensor keeps a `threshold_state` (owned by the caller; one per tensor). Its bound L is
/// bootstrapped by an exact selection and then adapted on every call so that about k (1 +
/// margin) elements reach it. A call makes one SIMD pass that keeps the elements reaching L
/// (the "band"), then:
/// - band >= k (the normal case): the exact top k of the band, which is the exact top k of
///   the tensor (ties to the lowest index);
/// - band < k (the magnitudes fell by more than the margin since the last call): the whole
///   band plus the lowest-index elements below it, still exactly k and still one pass, but
///   approximate; the counts at two edges below L (0.85 L and 0.6 L, counted in the same
///   pass) put the next bound right, or, when even 0.6 L holds too few, the next call
///   bootstraps again;
/// - the band overflowed its store (magnitudes rose several-fold): an exact selection by
///   full radix passes (more passes, reported in `selection_stats::fallback`).
/// No call pays for a refill that other calls do not: the band margin makes refills
/// unnecessary, and the rare deficit is filled by index at no extra cost.
/// The next bound is (within 1/2048 of the band's range below) the key of rank k (1 + margin)
/// of this call, known from the band's histogram.
///
/// Cost per call: one streaming read (memory bound), O(k) work on the band; bootstrap calls
/// add a stratified sample. A change of n or element type, or a k above the band's target,
/// bootstraps again. Not thread safe per selector object; different selector objects may run
/// concurrently. Memory as `exact_topk_selector` with a store of min(n, 3k + min_capacity).
///
/// \code
///   stellatrain::threshold_selector<> sel;
///   stellatrain::threshold_state state;                // one per tensor, kept across steps
///   for (int step = 0; step < steps; ++step) {
///     auto stats = sel.select(pool, state, std::span<const float>(grad), k, std::span(idx),
///     std::span(val));
///   }
/// \endcode
template <class Arch = xsimd::default_arch>
class threshold_selector {
 public:
  using arch_type = Arch;
  /// The bound each tensor keeps.
  using tensor_state = threshold_state;
  /// The candidate store and the histograms of the fallback's full passes.
  using workspace = detail::candidate_select_workspace;

  threshold_selector() = default;
  explicit threshold_selector(threshold_options options) : options_(options) {}

  [[nodiscard]] const threshold_options& options() const noexcept { return options_; }

  /// Allocates (pre-faulting across `ex`) what calls with up to `n` elements and `k` need.
  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    ws.candidates.reserve(ex, detail::threshold_capacity(n, k, options_.min_capacity), n,
                          options_.bootstrap.samples);
  }
  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t n, std::uint64_t k) {
    reserve(ex, ws_.get(), n, k);
  }

  /// One selection from `src` with the bound in `state`, which it updates (see
  /// the `selector` concept).
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, threshold_state& state, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context&,
                              Emit&& emit) const {
    if (auto done = detail::select_trivial<Arch>(ex, src, n, k, emit)) return *done;
    return detail::stats_of(detail::threshold_select<Arch, typename Source::value_type>(
        ex, src, n, k, options_, state, ws.candidates, ws.radix, emit));
  }

  /// Writes / reads `state` as fields of a saved-state record (core/saved_state.hpp).
  void save(const threshold_state& s, state_record_writer& w) const {
    w.put(s.low_key);
    w.put(s.kth_key);
    w.put(s.tensor_size);
    w.put(s.target);
    w.put(s.element);
    w.put(s.calls);
    w.put(s.last_candidates);
    w.put(s.deficits);
    w.put(s.fallbacks);
    w.put(s.bootstraps);
  }
  void load(threshold_state& s, state_record_reader& r) const {
    threshold_state t;
    t.low_key = r.get<std::uint32_t>();
    t.kth_key = r.get<std::uint32_t>();
    t.tensor_size = r.get<std::uint64_t>();
    t.target = r.get<std::uint64_t>();
    t.element = r.get<dtype>();
    t.calls = r.get<std::uint64_t>();
    t.last_candidates = r.get<std::uint64_t>();
    t.deficits = r.get<std::uint64_t>();
    t.fallbacks = r.get<std::uint64_t>();
    t.bootstraps = r.get<std::uint64_t>();
    if (size_of(t.element) == 0) r.fail("threshold state of an unknown element type");
    s = t;
  }

  /// Writes min(k, n) elements of `x` chosen with `state` to the front of `indices` and
  /// `values` (indices ascending, offset by `index_base`) and updates `state`. Errors as
  /// `exact_topk_selector::select`.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, threshold_state& state, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    return detail::select_into("threshold_selector::select", *this, ex, state, ws_.get(), x, k,
                               indices, values, index_base);
  }

  /// As above, into `out` (resized to min(k, n); its capacity grows if too small).
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, threshold_state& state, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, sparse_buffer<T, Index>& out,
                         std::uint64_t index_base = 0) {
    return detail::select_into("threshold_selector::select", *this, ex, state, ws_.get(), x, k, out,
                               index_base);
  }

 private:
  threshold_options options_{};
  detail::copy_fresh<workspace> ws_;
};

static_assert(selector<threshold_selector<>>);

}  // namespace stellatrain
