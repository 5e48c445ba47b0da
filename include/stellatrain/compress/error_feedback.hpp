// SPDX-License-Identifier: Apache-2.0
// Error-feedback compression on the CPU: acc = g + residual, select from acc, send the
// selected values (fp32, fp16 or bf16), keep the rest and the rounding error as the residual;
// fused into one pass over memory; optional DGC momentum correction; state save and restore.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/detail/select_candidates.hpp>
#include <stellatrain/detail/select_radix.hpp>
#include <stellatrain/detail/select_sources.hpp>
#include <stellatrain/detail/simd_lanes.hpp>
#include <stellatrain/detail/state_bytes.hpp>
#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/threshold.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace stellatrain {

/// How an `error_feedback_compressor` chooses what to send from acc = g + residual.
enum class selection_method : std::uint8_t {
  exact_topk = 1,         ///< `exact_topk_selector`: the k largest |acc|
  threshold = 2,          ///< `threshold_selector`: persistent per-tensor bound, exact in steady state
  sampled_threshold = 3,  ///< `sampled_threshold_selector`: DGC-style estimate, one pass
  block_topk = 4,         ///< `block_topk_selector`: whole 64-byte blocks
  random_k = 5,           ///< `random_k_selector`: indices from (seed, step, tensor id)
};

/// Options of `error_feedback_compressor`.
struct error_feedback_options {
  selection_method method = selection_method::threshold;
  /// DGC momentum correction when > 0 (in [0, 1)): u = momentum * u + g, v = v + u, select
  /// from v; sent positions clear both u and v (momentum factor masking).
  float momentum = 0.0f;
  /// Rank r of P selects k / P from the rotating slice (r + step) mod P of every tensor (see
  /// `slice_of`); error feedback still covers the whole tensor. {0, 1}: the whole tensor.
  partition part{};
  /// Seed of random-k: tensor `id` at step s uses random_key{seed + slice, s, id}.
  std::uint64_t seed = 0;
  exact_topk_options exact{};
  threshold_options threshold{};
  sampled_threshold_options sampled{};
  block_topk_options block{};
};

namespace detail {

/// Runs the source's transformation (the error-feedback update) over [0, n) without
/// selecting anything.
template <class Arch, class Source, executor Ex>
void transform_range(Ex& ex, const Source& src, std::uint64_t n) {
  for_each_chunk(ex, n, select_grain, [&](std::uint64_t b, std::uint64_t e) {
    std::uint64_t i = b;
    if constexpr (!is_scalar_arch<Arch>) {
      constexpr std::uint64_t w = lane_ops<Arch>::width;
      for (; i + w <= e; i += w) (void)src.template load<Arch>(i);
    }
    for (; i < e; ++i) (void)src.load_scalar(i);
  });
}

/// The value sent for acc: rounded to nearest even; finite values beyond the range of
/// fp16 / bf16 saturate to the largest finite value (the excess stays in the residual).
template <class V>
[[nodiscard]] STELLATRAIN_FORCE_INLINE V quantize_value(float acc) noexcept {
  if constexpr (std::is_same_v<V, float>) {
    return acc;
  } else {
    constexpr float max_finite = std::is_same_v<V, fp16> ? 65504.0f : 3.3895313892515355e38f;
    if (std::isfinite(acc)) acc = std::clamp(acc, -max_finite, max_finite);
    return V(acc);
  }
}

inline constexpr std::uint32_t ef_state_magic = 0x46455453u;  // "STEF"
inline constexpr std::uint32_t ef_state_version = 1;

}  // namespace detail

/// Error-feedback compressor (models `compressor`), for the CPU side of the data path.
///
/// Per registered tensor it keeps the residual r (n floats), the momentum u when momentum
/// correction is on, a step counter, the bounds of threshold selection (one per partition
/// slice) and its own scratch. One `compress(ex, id, g, k, out)` call:
/// 1. acc = g + r (with momentum: u = mu u + g, acc = v = v + u), stored back into r (and u)
///    in the same streaming pass that selects from acc: reading g and r and writing r is the
///    whole memory traffic of a call, plus O(k) (error feedback fused with selection);
/// 2. selects min(k, n) elements of acc with the chosen `selection_method` (shared semantics
///    in select/selection.hpp; with a partition, k / P of them from this rank's slice);
/// 3. sends them as `Value` (fp32, or fp16 / bf16 rounded to nearest even, finite values
///    saturated to the type's range) and keeps acc - sent in r at those positions: zero for
///    fp32, the rounding error for fp16 / bf16, so nothing is ever lost. A non-finite acc is
///    sent as is and its residual cleared (so one NaN does not repeat forever; what to do
///    with it is the optimizer's policy). Momentum is cleared where a value was sent.
/// Over any number of steps, sum of everything sent + the final residual == sum of all
/// gradients, up to fp32 rounding of the running sums.
///
/// Cost of one call: one pass that reads 2 and writes 1 array of n floats (3 and 2 with
/// momentum) plus the selection's own small work (O(k) on the candidates, see the selectors);
/// random-k: the same pass plus a gather; block: the pass scores blocks instead. No
/// allocation once a tensor has seen its largest k (`add_tensor` with `max_k` preallocates).
///
/// Registration: `add_tensor(ex, id, n, max_k)` with a caller-chosen 32-bit id (a layer or
/// bucket number; random-k keys by it). Calls for different tensors may run concurrently
/// (each tensor owns its scratch); calls for one tensor must not; register all tensors first.
///
/// State: `save_state()` writes, per tensor, the id, size, step, threshold bounds, residual
/// and momentum (host byte order, a magic word and version up front); `load_state` checks
/// all of it (malformed input throws `errc::malformed_message`, another configuration
/// `errc::invalid_argument`) and replaces the registered tensors, so a checkpointed run
/// resumes bit for bit.
///
/// \code
///   stellatrain::thread_pool pool{2};
///   stellatrain::error_feedback_compressor<stellatrain::bf16> ef({.method = stellatrain::selection_method::threshold});
///   ef.add_tensor(pool, /*id=*/0, grad.size(), /*max_k=*/grad.size() / 100);
///   stellatrain::sparse_buffer<stellatrain::bf16> out(grad.size(), grad.size() / 100);
///   for (int step = 0; step < steps; ++step) {
///     auto stats = ef.compress(pool, 0, std::span<const float>(grad), grad.size() / 100, out);
///     // send out.indices(), out.values()
///   }
/// \endcode
template <value_type Value = float, index_type Index = std::uint32_t, class Arch = xsimd::default_arch>
class error_feedback_compressor {
 public:
  using value_type = Value;
  using index_type = Index;
  using arch_type = Arch;

  /// Throws `errc::invalid_argument` for a momentum outside [0, 1), an unknown method or an
  /// invalid partition.
  explicit error_feedback_compressor(error_feedback_options options = {}) : options_(options) {
    if (!(options_.momentum >= 0.0f && options_.momentum < 1.0f)) {
      throw_error(errc::invalid_argument, "error_feedback_compressor: momentum " +
                                              std::to_string(options_.momentum) + " is not in [0, 1)");
    }
    if (static_cast<std::uint8_t>(options_.method) < 1 || static_cast<std::uint8_t>(options_.method) > 5) {
      throw_error(errc::invalid_argument, "error_feedback_compressor: unknown selection method");
    }
    (void)slice_of(options_.part, 0, 0, 0);  // validates the partition
  }

  [[nodiscard]] const error_feedback_options& options() const noexcept { return options_; }

  /// Registers tensor `id` of `n` elements with a zero residual (and momentum), pre-faulted
  /// across `ex`; with `max_k` > 0 also preallocates the scratch of calls with k <= max_k.
  /// Throws `errc::invalid_argument` if `id` is already registered, `errc::out_of_range` if
  /// n - 1 does not fit `Index`.
  template <executor Ex>
  void add_tensor(Ex& ex, std::uint32_t id, std::uint64_t n, std::uint64_t max_k = 0) {
    if (n > 0 && n - 1 > std::numeric_limits<Index>::max()) {
      throw_error(errc::out_of_range, "error_feedback_compressor::add_tensor: tensor " + std::to_string(id) +
                                          " of " + std::to_string(n) + " elements does not fit the index type");
    }
    const auto at = lower_bound(id);
    if (at != tensors_.end() && (*at)->id == id) {
      throw_error(errc::invalid_argument,
                  "error_feedback_compressor::add_tensor: tensor " + std::to_string(id) + " is already registered");
    }
    auto t = std::make_unique<tensor>();
    t->id = id;
    t->size = n;
    t->residual = aligned_buffer<float>(n, {.prefault = true}, ex);
    if (options_.momentum > 0.0f) t->momentum = aligned_buffer<float>(n, {.prefault = true}, ex);
    t->thresholds.assign(options_.part.parts, threshold_state{});
    if (max_k > 0) reserve(ex, *t, max_k);
    tensors_.insert(at, std::move(t));
  }

  /// Registers without pre-faulting in parallel (see above).
  void add_tensor(std::uint32_t id, std::uint64_t n, std::uint64_t max_k = 0) {
    inline_executor ex;
    add_tensor(ex, id, n, max_k);
  }

  /// One step of tensor `id` (see the class comment). `out` is resized to the number of
  /// elements sent and its dense size set to n. Throws `errc::invalid_argument` for an
  /// unknown id, `errc::size_mismatch` if g.size() is not the registered size.
  template <executor Ex>
  selection_stats compress(Ex& ex, std::uint32_t id, std::span<const float> g, std::uint64_t k,
                           sparse_buffer<Value, Index>& out) {
    tensor& t = find(id);
    if (g.size() != t.size) {
      throw_error(errc::size_mismatch, "error_feedback_compressor::compress: tensor " + std::to_string(id) +
                                           " has " + std::to_string(t.size) + " elements, the gradient " +
                                           std::to_string(g.size()));
    }
    [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
    const std::uint64_t n = t.size;
    const partition_slice slice = slice_of(options_.part, n, k, t.step);
    const std::uint64_t sn = slice.end - slice.begin;
    const std::uint64_t m = std::min(slice.k, sn);
    out.reserve(m, {.prefault = true});
    out.resize(m);
    out.set_dense_size(n);
    if (m > 0) reserve(ex, t, slice.k);

    // The parts of the tensor outside this rank's slice get their feedback update only.
    const float mu = options_.momentum;
    float* const r = t.residual.data();
    float* const u = t.momentum.data();
    auto update = [&](std::uint64_t b, std::uint64_t e) {
      if (e <= b) return;
      if (mu > 0.0f) {
        detail::transform_range<Arch>(ex, detail::momentum_source{g.data() + b, u + b, r + b, mu}, e - b);
      } else {
        detail::transform_range<Arch>(ex, detail::error_feedback_source{g.data() + b, r + b}, e - b);
      }
    };
    update(0, slice.begin);
    update(slice.end, n);

    const std::uint64_t base = slice.begin;
    Index* const out_idx = out.indices().data();
    Value* const out_val = out.values().data();
    auto emit = [&, r, u](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
      const float acc = std::bit_cast<float>(bits);
      const Value q = detail::quantize_value<Value>(acc);
      const std::uint64_t at = base + i;
      out_idx[pos] = static_cast<Index>(at);
      out_val[pos] = q;
      r[at] = std::isfinite(acc) ? acc - to_float(q) : 0.0f;
      if (u != nullptr) u[at] = 0.0f;
    };
    selection_stats stats;
    if (mu > 0.0f) {
      stats = run(ex, t, detail::momentum_source{g.data() + base, u + base, r + base, mu}, sn, m, slice, emit);
    } else {
      stats = run(ex, t, detail::error_feedback_source{g.data() + base, r + base}, sn, m, slice, emit);
    }
    ++t.step;
    return stats;
  }

  /// Serial-executor form of `compress`.
  selection_stats compress(std::uint32_t id, std::span<const float> g, std::uint64_t k,
                           sparse_buffer<Value, Index>& out) {
    inline_executor ex;
    return compress(ex, id, g, k, out);
  }

  [[nodiscard]] bool has_tensor(std::uint32_t id) const noexcept {
    const auto at = lower_bound(id);
    return at != tensors_.end() && (*at)->id == id;
  }
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  /// Registered size of tensor `id` (throws for an unknown id).
  [[nodiscard]] std::uint64_t tensor_size(std::uint32_t id) const { return find(id).size; }
  /// Steps done on tensor `id`.
  [[nodiscard]] std::uint64_t step(std::uint32_t id) const { return find(id).step; }
  /// The residual of tensor `id`: what was accumulated and not sent yet.
  [[nodiscard]] std::span<const float> residual(std::uint32_t id) const { return find(id).residual.span(); }
  /// The momentum of tensor `id` (empty without momentum correction).
  [[nodiscard]] std::span<const float> momentum(std::uint32_t id) const { return find(id).momentum.span(); }
  /// Threshold-selection state of tensor `id`, one per partition slice.
  [[nodiscard]] std::span<const threshold_state> thresholds(std::uint32_t id) const {
    return find(id).thresholds;
  }

  /// Every tensor's state as bytes (see the class comment).
  [[nodiscard]] std::vector<std::byte> save_state() const {
    std::vector<std::byte> bytes;
    detail::byte_writer w(bytes);
    w.put(detail::ef_state_magic);
    w.put(detail::ef_state_version);
    w.put(static_cast<std::uint8_t>(dtype_of<Value>));
    w.put(static_cast<std::uint8_t>(options_.method));
    w.put(static_cast<std::uint8_t>(options_.momentum > 0.0f ? 1 : 0));
    w.put(static_cast<std::uint8_t>(sizeof(Index)));
    w.put(options_.part.parts);
    w.put(static_cast<std::uint64_t>(tensors_.size()));
    for (const auto& t : tensors_) {
      w.put(t->id);
      w.put(t->size);
      w.put(t->step);
      w.put(static_cast<std::uint32_t>(t->thresholds.size()));
      for (const threshold_state& s : t->thresholds) put_threshold(w, s);
      w.put_array(std::span<const float>(t->residual.span()));
      if (options_.momentum > 0.0f) w.put_array(std::span<const float>(t->momentum.span()));
    }
    return bytes;
  }

  /// Replaces every tensor with the state in `saved` (from `save_state` of a compressor with
  /// the same value type, index type, method, momentum on/off and partition count).
  template <executor Ex>
  void load_state(Ex& ex, std::span<const std::byte> saved) {
    constexpr const char* what = "error_feedback_compressor::load_state";
    detail::byte_reader rd(saved, what);
    if (rd.get<std::uint32_t>() != detail::ef_state_magic) {
      throw_error(errc::malformed_message, std::string(what) + ": not a saved error-feedback state");
    }
    const auto version = rd.get<std::uint32_t>();
    if (version != detail::ef_state_version) {
      throw_error(errc::version_mismatch, std::string(what) + ": state version " + std::to_string(version) +
                                              ", this build reads " + std::to_string(detail::ef_state_version));
    }
    const auto value = rd.get<std::uint8_t>();
    const auto method = rd.get<std::uint8_t>();
    const auto has_momentum = rd.get<std::uint8_t>();
    const auto index_bytes = rd.get<std::uint8_t>();
    const auto parts = rd.get<std::uint32_t>();
    if (value != static_cast<std::uint8_t>(dtype_of<Value>) || method != static_cast<std::uint8_t>(options_.method) ||
        has_momentum != (options_.momentum > 0.0f ? 1 : 0) || index_bytes != sizeof(Index) ||
        parts != options_.part.parts) {
      throw_error(errc::invalid_argument, std::string(what) +
                                              ": the state was saved by a compressor with other options "
                                              "(value type, method, momentum, index type or partition count)");
    }
    const auto count = rd.get<std::uint64_t>();
    std::vector<std::unique_ptr<tensor>> loaded;
    for (std::uint64_t j = 0; j < count; ++j) {
      auto t = std::make_unique<tensor>();
      t->id = rd.get<std::uint32_t>();
      t->size = rd.get<std::uint64_t>();
      t->step = rd.get<std::uint64_t>();
      if (!loaded.empty() && loaded.back()->id >= t->id) {
        throw_error(errc::malformed_message, std::string(what) + ": tensor ids not ascending at tensor " +
                                                 std::to_string(j) + " (id " + std::to_string(t->id) + ")");
      }
      const std::uint64_t floats = t->size * (options_.momentum > 0.0f ? 2 : 1);
      if (t->size > rd.remaining() / sizeof(float) || floats > rd.remaining() / sizeof(float)) {
        throw_error(errc::malformed_message, std::string(what) + ": tensor " + std::to_string(t->id) + " claims " +
                                                 std::to_string(t->size) + " elements, more than the input holds");
      }
      if (t->size > 0 && t->size - 1 > std::numeric_limits<Index>::max()) {
        throw_error(errc::out_of_range, std::string(what) + ": tensor " + std::to_string(t->id) +
                                            " does not fit the index type");
      }
      const auto nthr = rd.get<std::uint32_t>();
      if (nthr != parts) {
        throw_error(errc::malformed_message, std::string(what) + ": tensor " + std::to_string(t->id) + " has " +
                                                 std::to_string(nthr) + " threshold states, " +
                                                 std::to_string(parts) + " expected");
      }
      t->thresholds.resize(nthr);
      for (threshold_state& s : t->thresholds) s = get_threshold(rd);
      t->residual = aligned_buffer<float>(t->size, {.prefault = true}, ex);
      rd.get_array(t->residual.span());
      if (options_.momentum > 0.0f) {
        t->momentum = aligned_buffer<float>(t->size, {.prefault = true}, ex);
        rd.get_array(t->momentum.span());
      }
      loaded.push_back(std::move(t));
    }
    if (rd.remaining() != 0) {
      throw_error(errc::malformed_message, std::string(what) + ": " + std::to_string(rd.remaining()) +
                                               " bytes left over after the last tensor");
    }
    tensors_ = std::move(loaded);
  }

  /// Serial-executor form of `load_state`.
  void load_state(std::span<const std::byte> saved) {
    inline_executor ex;
    load_state(ex, saved);
  }

 private:
  struct tensor {
    std::uint32_t id = 0;
    std::uint64_t size = 0;
    std::uint64_t step = 0;
    aligned_buffer<float> residual;
    aligned_buffer<float> momentum;
    std::vector<threshold_state> thresholds;
    // Scratch, not saved.
    detail::candidate_workspace ws;
    detail::radix_workspace rw;
    detail::block_workspace bw;
    aligned_buffer<std::uint64_t> bitmap;
    aligned_buffer<std::uint64_t> drawn;
  };

  static void put_threshold(detail::byte_writer& w, const threshold_state& s) {
    w.put(s.low_key);
    w.put(s.kth_key);
    w.put(s.tensor_size);
    w.put(s.target);
    w.put(static_cast<std::uint8_t>(s.element));
    w.put(s.calls);
    w.put(s.last_candidates);
    w.put(s.deficits);
    w.put(s.fallbacks);
    w.put(s.bootstraps);
  }

  static threshold_state get_threshold(detail::byte_reader& rd) {
    threshold_state s;
    s.low_key = rd.get<std::uint32_t>();
    s.kth_key = rd.get<std::uint32_t>();
    s.tensor_size = rd.get<std::uint64_t>();
    s.target = rd.get<std::uint64_t>();
    s.element = static_cast<dtype>(rd.get<std::uint8_t>());
    s.calls = rd.get<std::uint64_t>();
    s.last_candidates = rd.get<std::uint64_t>();
    s.deficits = rd.get<std::uint64_t>();
    s.fallbacks = rd.get<std::uint64_t>();
    s.bootstraps = rd.get<std::uint64_t>();
    return s;
  }

  auto lower_bound(std::uint32_t id) const {
    return std::lower_bound(tensors_.begin(), tensors_.end(), id,
                            [](const std::unique_ptr<tensor>& t, std::uint32_t v) { return t->id < v; });
  }
  auto lower_bound(std::uint32_t id) {
    return std::lower_bound(tensors_.begin(), tensors_.end(), id,
                            [](const std::unique_ptr<tensor>& t, std::uint32_t v) { return t->id < v; });
  }

  tensor& find(std::uint32_t id) {
    const auto at = lower_bound(id);
    if (at == tensors_.end() || (*at)->id != id) {
      throw_error(errc::invalid_argument, "error_feedback_compressor: tensor " + std::to_string(id) + " is not registered");
    }
    return **at;
  }
  const tensor& find(std::uint32_t id) const { return const_cast<error_feedback_compressor*>(this)->find(id); }

  // Scratch for calls with up to k selected from a slice of t.
  template <executor Ex>
  void reserve(Ex& ex, tensor& t, std::uint64_t k) {
    const std::uint64_t n = t.size;
    switch (options_.method) {
      case selection_method::exact_topk:
        t.ws.reserve(ex, detail::exact_capacity(n, k, options_.exact.min_capacity), n, options_.exact.samples);
        break;
      case selection_method::threshold:
        t.ws.reserve(ex, detail::threshold_capacity(n, k, options_.threshold.min_capacity), n,
                     options_.threshold.bootstrap.samples);
        break;
      case selection_method::sampled_threshold:
        t.ws.reserve(ex, detail::threshold_capacity(n, k, options_.sampled.min_capacity), n,
                     detail::sampled_count(n, options_.sampled));
        break;
      case selection_method::block_topk:
        t.bw.reserve(ex, n, k, detail::block_elements<float>, options_.block.blocks);
        break;
      case selection_method::random_k: {
        const std::uint64_t words = sample_indices_workspace_words(n);
        if (words > t.bitmap.size()) t.bitmap = aligned_buffer<std::uint64_t>(words, {.prefault = true}, ex);
        if (k > t.drawn.size()) t.drawn = aligned_buffer<std::uint64_t>(k, {.prefault = true}, ex);
        break;
      }
    }
  }

  // Selection of m of the sn elements of the slice through `src` (which applies the feedback
  // update on its first pass).
  template <executor Ex, class Source, class Emit>
  selection_stats run(Ex& ex, tensor& t, const Source& src, std::uint64_t sn, std::uint64_t m,
                      const partition_slice& slice, Emit& emit) {
    if (m == 0 || m >= sn) {
      detail::transform_range<Arch>(ex, src, sn);
      if (m == 0) return {.passes = 1};
      const auto rd = src.reread();
      for_each_chunk(ex, sn, detail::select_grain, [&](std::uint64_t b, std::uint64_t e) {
        for (std::uint64_t i = b; i < e; ++i) emit(i, i, rd.load_scalar(i));
      });
      return {.count = sn, .passes = 1};
    }
    switch (options_.method) {
      case selection_method::exact_topk: {
        const detail::exact_tuning tuning{.samples = options_.exact.samples, .z = options_.exact.margin_sigmas};
        return detail::stats_of(detail::select_exact<Arch>(ex, src, sn, m, m, tuning, t.ws, t.rw, emit));
      }
      case selection_method::threshold:
        return detail::stats_of(detail::threshold_select<Arch, float>(ex, src, sn, m, options_.threshold,
                                                                      t.thresholds[slice.slice], t.ws, t.rw, emit));
      case selection_method::sampled_threshold:
        return detail::stats_of(
            detail::sampled_threshold_select<Arch>(ex, src, sn, m, options_.sampled, t.ws, t.rw, emit));
      case selection_method::block_topk:
        return detail::block_select<Arch>(ex, src, sn, m, options_.block, t.bw, emit);
      case selection_method::random_k: {
        detail::transform_range<Arch>(ex, src, sn);
        const random_key key{.seed = options_.seed + slice.slice, .step = static_cast<std::uint32_t>(t.step),
                             .tensor = t.id};
        std::span<std::uint64_t> drawn(t.drawn.data(), static_cast<std::size_t>(m));
        sample_sorted_indices<std::uint64_t>(key, sn, m, drawn, t.bitmap.span());
        const auto rd = src.reread();
        for_each_chunk(ex, m, std::uint64_t{1} << 14, [&](std::uint64_t b, std::uint64_t e) {
          for (std::uint64_t j = b; j < e; ++j) emit(j, drawn[j], rd.load_scalar(drawn[j]));
        });
        return {.count = m, .exact = false, .passes = 1};
      }
    }
    return {};
  }

  error_feedback_options options_;
  std::vector<std::unique_ptr<tensor>> tensors_;
};

static_assert(compressor<error_feedback_compressor<>>);
static_assert(compressor<error_feedback_compressor<bf16, std::uint64_t>>);

}  // namespace stellatrain
