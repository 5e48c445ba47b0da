// SPDX-License-Identifier: Apache-2.0
// Error-feedback compression on the CPU: acc = g + residual, select from acc with any
// `selector`, send the selected values (fp32, fp16 or bf16), keep the rest and the rounding
// error as the residual; fused into one pass over memory; optional DGC momentum correction;
// state save and restore.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/compress/detail/tensor_states.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>
#include <stellatrain/select/threshold.hpp>

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
#include <utility>
#include <vector>

namespace stellatrain {

/// What `error_feedback_compressor` accumulates, fixed at compile time (each kind instantiates
/// the selector over its own source, so a compressor carries only the one it uses):
/// - `plain`: acc = g + r (reads an `error_feedback_source`);
/// - `momentum`: DGC momentum correction, u = mu * u + g, acc = v = v + u, sent positions clear
///   both u and v (momentum factor masking; reads a `momentum_source`).
enum class feedback : std::uint8_t { plain, momentum };

/// Options of `error_feedback_compressor`.
struct error_feedback_options {
  /// The momentum factor mu of `feedback::momentum`, in [0, 1); must be 0 for `feedback::plain`.
  float momentum = 0.0f;
};

namespace detail {

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

inline constexpr state_kind ef_state_kind = state_kind::of("STELLEFC", 2);

}  // namespace detail

/// Error-feedback compressor (models `compressor`), for the CPU side of the data path, over
/// any `selector` (`threshold_selector<>` unless given; `runtime_selector` chooses one at run
/// time; `partitioned_selector` selects a rank's share), with `feedback::plain` (the default)
/// or `feedback::momentum`.
///
/// Per registered tensor it keeps the residual r (n floats), the momentum u with
/// `feedback::momentum`, a step counter, the selector's `tensor_state` (the bound of threshold
/// selection, say) and its own scratch. One `compress(ex, id, g, k, out)` call:
/// 1. acc = g + r (with momentum: u = mu u + g, acc = v = v + u), stored back into r (and u)
///    in the same streaming pass that selects from acc: reading g and r and writing r is the
///    whole memory traffic of a call, plus O(k) (the selector reads an `error_feedback_source`
///    or a `momentum_source`, whose first read is the update);
/// 2. the selector chooses min(k, n) elements of acc (shared semantics in
///    select/selection.hpp; a partitioned selector: this rank's share of its slice);
/// 3. sends them as `Value` (fp32, or fp16 / bf16 rounded to nearest even, finite values
///    saturated to the type's range) and keeps acc - sent in r at those positions: zero for
///    fp32, the rounding error for fp16 / bf16, so nothing is ever lost. A non-finite acc is
///    sent as is and its residual cleared (so one NaN does not repeat forever; what to do
///    with it is the optimizer's policy). Momentum is cleared where a value was sent.
/// Over any number of steps, sum of everything sent + the final residual == sum of all
/// gradients, up to fp32 rounding of the running sums.
///
/// Cost of one call: one pass that reads 2 and writes 1 array of n floats (3 and 2 with
/// momentum) plus the selection's own small work (see the selectors). No allocation once a
/// tensor has seen its largest k (`add_tensor` with `max_k` preallocates).
///
/// Registration: `add_tensor(ex, id, n, max_k)` with a caller-chosen 32-bit id (a layer or
/// bucket number; random-k keys by it). Calls for different tensors may run concurrently
/// (each tensor owns its scratch); calls for one tensor must not; register all tensors first.
///
/// State: `save_state()` writes, per tensor, the id, size, step, the selector's state, the
/// residual and the momentum, in the checked format of core/saved_state.hpp (kind
/// "STELLEFC"); `load_state` verifies all of it before it changes anything (a damaged state
/// throws `errc::malformed_message` or `errc::checksum_mismatch`, one of another
/// configuration `errc::invalid_argument`) and then replaces the registered tensors, so a
/// checkpointed run resumes bit for bit.
///
/// \code
///   stellatrain::thread_pool pool{2};
///   stellatrain::error_feedback_compressor<stellatrain::threshold_selector<>, stellatrain::bf16>
///   ef; ef.add_tensor(pool, /*id=*/0, grad.size(), /*max_k=*/grad.size() / 100);
///   stellatrain::sparse_buffer<stellatrain::bf16> out(grad.size(), grad.size() / 100);
///   for (int step = 0; step < steps; ++step) {
///     auto stats = ef.compress(pool, 0, std::span<const float>(grad), grad.size() / 100, out);
///     // send out.indices(), out.values()
///   }
/// \endcode
template <selector Selector = threshold_selector<>, value_type Value = float,
          index_type Index = std::uint32_t, feedback Feedback = feedback::plain>
class error_feedback_compressor {
  static constexpr bool with_momentum = Feedback == feedback::momentum;

 public:
  using selector_type = Selector;
  using value_type = Value;
  using index_type = Index;
  using arch_type = selector_arch_t<Selector>;
  static constexpr feedback feedback_kind = Feedback;

  error_feedback_compressor() : error_feedback_compressor(Selector{}) {}
  /// Throws `errc::invalid_argument` for a momentum outside [0, 1), or other than 0 with
  /// `feedback::plain`.
  explicit error_feedback_compressor(Selector selector, error_feedback_options options = {})
      : selector_(std::move(selector)), options_(options) {
    if (!(options_.momentum >= 0.0f && options_.momentum < 1.0f)) {
      throw_error(errc::invalid_argument, "error_feedback_compressor: momentum " +
                                              std::to_string(options_.momentum) +
                                              " is not in [0, 1)");
    }
    if (!with_momentum && options_.momentum != 0.0f) {
      throw_error(errc::invalid_argument, "error_feedback_compressor: momentum " +
                                              std::to_string(options_.momentum) +
                                              " needs the compressor's feedback::momentum");
    }
  }
  explicit error_feedback_compressor(error_feedback_options options)
      : error_feedback_compressor(Selector{}, options) {}

  [[nodiscard]] const error_feedback_options& options() const noexcept { return options_; }
  [[nodiscard]] const Selector& selector() const noexcept { return selector_; }

  /// Registers tensor `id` of `n` elements with a zero residual (and momentum), pre-faulted
  /// across `ex`; with `max_k` > 0 also preallocates the scratch of calls with k <= max_k.
  /// Throws `errc::invalid_argument` if `id` is already registered, `errc::out_of_range` if
  /// n - 1 does not fit `Index`.
  template <executor Ex>
  void add_tensor(Ex& ex, std::uint32_t id, std::uint64_t n, std::uint64_t max_k = 0) {
    check_size("error_feedback_compressor::add_tensor", id, n);
    const auto at = lower_bound(id);
    if (at != tensors_.end() && (*at)->id == id) {
      throw_error(errc::invalid_argument, "error_feedback_compressor::add_tensor: tensor " +
                                              std::to_string(id) + " is already registered");
    }
    auto t = std::make_unique<tensor>();
    t->id = id;
    t->size = n;
    t->residual = aligned_buffer<float>(n, {.prefault = true}, ex);
    if constexpr (with_momentum) t->momentum = aligned_buffer<float>(n, {.prefault = true}, ex);
    if (max_k > 0 && max_k < n) selector_.reserve(ex, t->ws, n, max_k);
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
      throw_error(errc::size_mismatch, "error_feedback_compressor::compress: tensor " +
                                           std::to_string(id) + " has " + std::to_string(t.size) +
                                           " elements, the gradient " + std::to_string(g.size()));
    }
    [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
    const std::uint64_t n = t.size;
    const std::uint64_t most = std::min(k, n);
    out.reserve(most, {.prefault = true});
    out.resize(most);
    out.set_dense_size(n);

    float* const r = t.residual.data();
    float* const u = t.momentum.data();
    Index* const out_idx = out.indices().data();
    Value* const out_val = out.values().data();
    auto emit = [r, u, out_idx, out_val](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
      const float acc = std::bit_cast<float>(bits);
      const Value q = detail::quantize_value<Value>(acc);
      out_idx[pos] = static_cast<Index>(i);
      out_val[pos] = q;
      r[i] = std::isfinite(acc) ? acc - to_float(q) : 0.0f;
      if constexpr (with_momentum) {
        u[i] = 0.0f;
      } else {
        (void)u;
      }
    };
    const selection_context ctx{.tensor = id, .step = t.step};
    selection_stats stats;
    if constexpr (with_momentum) {
      const momentum_source src{g.data(), u, r, options_.momentum};
      stats = selector_.select_from(ex, t.selection, t.ws, src, n, k, ctx, emit);
    } else {
      stats = selector_.select_from(ex, t.selection, t.ws, error_feedback_source{g.data(), r}, n, k,
                                    ctx, emit);
    }
    out.resize(stats.count);
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
  [[nodiscard]] std::span<const float> residual(std::uint32_t id) const {
    return find(id).residual.span();
  }
  /// The momentum of tensor `id` (empty with `feedback::plain`).
  [[nodiscard]] std::span<const float> momentum(std::uint32_t id) const {
    return find(id).momentum.span();
  }
  /// The selector's state of tensor `id`.
  [[nodiscard]] const typename Selector::tensor_state& selection_state(std::uint32_t id) const {
    return find(id).selection;
  }

  /// Every tensor's state as bytes (see the class comment).
  [[nodiscard]] std::vector<std::byte> save_state() const {
    return save_state_bytes(detail::ef_state_kind, [&](state_writer& w) {
      w.record("CONF", [&](state_record_writer& r) {
        r.put(dtype_of<Value>);
        r.put(static_cast<std::uint8_t>(sizeof(Index)));
        r.put(static_cast<std::uint8_t>(with_momentum ? 1 : 0));
        r.put(static_cast<std::uint64_t>(tensors_.size()));
      });
      for (const auto& t : tensors_) {
        w.record("TNSR", [&](state_record_writer& r) {
          r.put(t->id);
          r.put(t->size);
          r.put(t->step);
          if constexpr (!std::is_empty_v<typename Selector::tensor_state>)
            selector_.save(t->selection, r);
        });
        w.record("RESD", [&](state_record_writer& r) { r.put_array(t->residual.span()); });
        if constexpr (with_momentum) {
          w.record("MOMT", [&](state_record_writer& r) { r.put_array(t->momentum.span()); });
        }
      }
    });
  }

  /// Replaces every tensor with the state in `saved` (from `save_state` of a compressor with
  /// the same value type, index type, feedback and a selector of the same kind).
  /// Nothing changes when it throws.
  template <executor Ex>
  void load_state(Ex& ex, std::span<const std::byte> saved) {
    constexpr const char* what = "error_feedback_compressor::load_state";
    state_reader rd(saved, detail::ef_state_kind, what);
    auto conf = rd.next("CONF");
    const auto value = conf.get<dtype>();
    const auto index_bytes = conf.get<std::uint8_t>();
    const auto has_momentum = conf.get<std::uint8_t>();
    const auto count = conf.get<std::uint64_t>();
    conf.finish();
    if (value != dtype_of<Value> || index_bytes != sizeof(Index) ||
        has_momentum != (with_momentum ? 1 : 0)) {
      throw_error(errc::invalid_argument,
                  std::string(what) +
                      ": the state was saved by a compressor with other options "
                      "(value type, index type or feedback)");
    }
    if (count > rd.remaining()) {
      rd.malformed("claims " + std::to_string(count) + " tensors, " +
                   std::to_string(rd.remaining()) + " records follow");
    }
    std::vector<std::unique_ptr<tensor>> loaded;
    for (std::uint64_t j = 0; j < count; ++j) {
      auto t = std::make_unique<tensor>();
      auto head = rd.next("TNSR");
      t->id = head.get<std::uint32_t>();
      t->size = head.get<std::uint64_t>();
      t->step = head.get<std::uint64_t>();
      if (!loaded.empty() && loaded.back()->id >= t->id) {
        head.fail("tensor ids not ascending at tensor " + std::to_string(j) + " (id " +
                  std::to_string(t->id) + ")");
      }
      check_size(what, t->id, t->size);
      if constexpr (!std::is_empty_v<typename Selector::tensor_state>)
        selector_.load(t->selection, head);
      head.finish();
      auto residual = rd.next("RESD");
      if (residual.remaining() != t->size * sizeof(float)) {
        residual.fail("tensor " + std::to_string(t->id) + " of " + std::to_string(t->size) +
                      " elements has " + std::to_string(residual.remaining()) +
                      " bytes of residual");
      }
      t->residual = aligned_buffer<float>(t->size, {.prefault = true}, ex);
      residual.get_array(t->residual.span());
      if constexpr (with_momentum) {
        auto momentum = rd.next("MOMT");
        if (momentum.remaining() != t->size * sizeof(float)) {
          momentum.fail("tensor " + std::to_string(t->id) + " of " + std::to_string(t->size) +
                        " elements has " + std::to_string(momentum.remaining()) +
                        " bytes of momentum");
        }
        t->momentum = aligned_buffer<float>(t->size, {.prefault = true}, ex);
        momentum.get_array(t->momentum.span());
      }
      loaded.push_back(std::move(t));
    }
    rd.finish();
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
    typename Selector::tensor_state selection{};
    typename Selector::workspace ws;  // scratch, not saved
  };

  static void check_size(const char* who, std::uint32_t id, std::uint64_t n) {
    if (n > 0 && n - 1 > std::numeric_limits<Index>::max()) {
      throw_error(errc::out_of_range, std::string(who) + ": tensor " + std::to_string(id) + " of " +
                                          std::to_string(n) +
                                          " elements does not fit the index type");
    }
  }

  auto lower_bound(std::uint32_t id) const { return detail::lower_bound_id(tensors_, id); }
  auto lower_bound(std::uint32_t id) { return detail::lower_bound_id(tensors_, id); }
  tensor& find(std::uint32_t id) {
    return detail::state_of(tensors_, id, "error_feedback_compressor");
  }
  const tensor& find(std::uint32_t id) const {
    return detail::state_of(tensors_, id, "error_feedback_compressor");
  }

  Selector selector_;
  error_feedback_options options_;
  std::vector<std::unique_ptr<tensor>> tensors_;
};

static_assert(compressor<error_feedback_compressor<>>);
static_assert(compressor<error_feedback_compressor<threshold_selector<>, float, std::uint32_t,
                                                   feedback::momentum>>);

}  // namespace stellatrain
