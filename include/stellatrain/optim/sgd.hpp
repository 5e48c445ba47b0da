// SPDX-License-Identifier: Apache-2.0
// SGD with momentum, dampening, Nesterov momentum, weight decay and maximize, with PyTorch's
// semantics, for dense and sparse ("lazy") gradients on fp32 master parameters.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/detail/optim_math.hpp>
#include <stellatrain/optim/detail/optimizer_base.hpp>
#include <stellatrain/optim/optimizer_concepts.hpp>
#include <stellatrain/optim/optimizer_types.hpp>
#include <stellatrain/optim/state_format.hpp>

#include <xsimd/xsimd.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace stellatrain {

namespace detail {

template <bool Momentum, bool Nesterov, bool WeightDecay>
struct sgd_rule {
  static constexpr std::size_t state_arrays = Momentum ? 1 : 0;
  template <class T>
  using coeffs_type = sgd_coeffs<T>;

  sgd_scalars scalars;
  bool first_step = false;  // the tensor's first step (per-tensor counting)

  template <class T>
  STELLATRAIN_FORCE_INLINE void apply(T& p, T g, T& buf, T&, T&,
                                      const sgd_coeffs<T>& c) const noexcept {
    sgd_update<Momentum, Nesterov, WeightDecay>(p, g, buf, first_step, c);
  }
  // `earlier_steps`: how many steps touched this element before this one.
  STELLATRAIN_FORCE_INLINE void apply_element(float& p, float g, float& buf, float&, float&,
                                              std::uint32_t earlier_steps,
                                              const sgd_coeffs<float>& c) const noexcept {
    sgd_update<Momentum, Nesterov, WeightDecay>(p, g, buf, earlier_steps == 0, c);
  }
};

}  // namespace detail

/// Options of `sgd_optimizer`, with PyTorch's meaning (`torch.optim.SGD`).
struct sgd_options {
  float lr = 1e-2f;           ///< learning rate, >= 0
  float momentum = 0.0f;      ///< >= 0; 0 keeps no momentum buffer
  float dampening = 0.0f;     ///< in [0, 1]; must be 0 with nesterov
  float weight_decay = 0.0f;  ///< L2 penalty added to the gradient, >= 0
  bool nesterov = false;      ///< Nesterov momentum (needs momentum > 0, dampening 0)
  bool maximize = false;      ///< ascend instead of descend
  step_count step_mode = step_count::per_tensor;  ///< sparse first-step rule
  nonfinite_policy nonfinite = nonfinite_policy::skip_elements;
};

/// Stochastic gradient descent on fp32 master parameters that the optimizer owns.
///
/// Update of one element with gradient g, exactly as `torch.optim.SGD`:
/// \code
///   d = maximize ? -g : g;   if weight_decay != 0: d += weight_decay * p
///   if momentum != 0:  buf = (first step) ? d : momentum * buf + (1 - dampening) * d
///                      d = nesterov ? d + momentum * buf : buf
///   p -= lr * d
/// \endcode
/// "First step" is the tensor's first step (`step_count::per_tensor`) or the element's first
/// touch (`step_count::per_element`); see `step_count`.
///
/// Dense steps update every element in one fused SIMD pass (the architecture is the template
/// parameter `Arch`, default `xsimd::default_arch`), split across the executor in chunks of
/// up to 1 MiB per array. Sparse steps are lazy: only the elements at the gradient's indices
/// change (weight decay and momentum included); indices must be sorted non-decreasing,
/// equal indices are summed into one update, an index out of range or out of order is an
/// error and nothing is written. Every step is all-or-nothing with respect to errors.
///
/// Registration (`add_tensor`, or `add_tensor_in_place` for parameters the caller holds), the
/// dense and sparse `step`, `params`, step counts and checkpoints (`save_state`, `load_state`)
/// are common to the optimizers and documented in optim/detail/optimizer_base.hpp. `load_state`
/// requires the saved state's momentum on/off, nesterov, maximize and step mode to match, and takes
/// over its lr, momentum, dampening and weight decay.
///
/// Thread safety: steps on different tensors may run concurrently (each tensor has its own
/// arrays); `add_tensor`, `set_lr`, `load_state` must not overlap any other call.
/// Steps never allocate.
///
/// \code
///   stellatrain::sgd_optimizer opt({.lr = 0.1f, .momentum = 0.9f, .nesterov = true});
///   std::vector<float> w(1000, 0.5f), g(1000, 0.01f);
///   auto t = opt.add_tensor(w);
///   opt.step(t, std::span<const float>(g));          // dense, on the calling thread
///   std::vector<std::uint32_t> idx{3, 70};  std::vector<float> val{1.0f, -2.0f};
///   stellatrain::thread_pool pool{2};
///   opt.step(t, stellatrain::sparse_view<const float, const std::uint32_t>{idx, val, 1000}, pool);
///   float w3 = opt.params(t)[3];
/// \endcode
class sgd_optimizer : public detail::optimizer_base<sgd_optimizer> {
 public:
  static constexpr const char* name = "sgd";

  /// Throws `errc::invalid_argument` for options PyTorch refuses (negative lr, momentum or
  /// weight decay; nesterov without momentum or with dampening) or that are not finite.
  explicit sgd_optimizer(const sgd_options& options = {}) : options_(validated(options)) {}

  [[nodiscard]] const sgd_options& options() const noexcept { return options_; }

  /// Changes the learning rate for later steps (a scheduler's hook).
  void set_lr(float lr) {
    sgd_options o = options_;
    o.lr = lr;
    options_ = validated(o);
  }

  /// The momentum buffer of tensor `t` (empty when momentum is 0).
  [[nodiscard]] std::span<const float> momentum_buffer(std::size_t t) const {
    return state_array(t, 0);
  }

  // Used by the step driver.
  template <class F>
  void with_rule(std::uint64_t step, F&& f) const {
    detail::sgd_scalars s;
    s.sign = options_.maximize ? -1.0f : 1.0f;
    s.weight_decay = options_.weight_decay;
    s.momentum = options_.momentum;
    s.one_minus_dampening = static_cast<float>(1.0 - static_cast<double>(options_.dampening));
    s.neg_lr = -options_.lr;
    const bool first = step == 1;
    const bool wd = options_.weight_decay != 0.0f;
    auto run = [&]<bool M, bool N, bool W>() { f(detail::sgd_rule<M, N, W>{s, first}); };
    if (options_.momentum == 0.0f) {
      wd ? run.template operator()<false, false, true>()
         : run.template operator()<false, false, false>();
    } else if (options_.nesterov) {
      wd ? run.template operator()<true, true, true>()
         : run.template operator()<true, true, false>();
    } else {
      wd ? run.template operator()<true, false, true>()
         : run.template operator()<true, false, false>();
    }
  }

 private:
  friend class detail::optimizer_base<sgd_optimizer>;

  void restore(std::span<const std::byte> bytes) {
    sgd_options restored = options_;
    detail::load_state(bytes, identity(), registry_, arrays_mask(),
                       [&](const std::array<float, 8>& h) {
                         restored.lr = h[0];
                         restored.momentum = h[1];
                         restored.dampening = h[2];
                         restored.weight_decay = h[3];
                         restored = validated(restored);
                       });
    options_ = restored;
  }

  static sgd_options validated(const sgd_options& o) {
    auto bad = [](const std::string& what) { throw_error(errc::invalid_argument, "sgd: " + what); };
    if (!(std::isfinite(o.lr) && o.lr >= 0.0f))
      bad("lr must be finite and >= 0, got " + std::to_string(o.lr));
    if (!(std::isfinite(o.momentum) && o.momentum >= 0.0f)) {
      bad("momentum must be finite and >= 0, got " + std::to_string(o.momentum));
    }
    if (!(o.dampening >= 0.0f && o.dampening <= 1.0f)) {
      bad("dampening must be in [0, 1], got " + std::to_string(o.dampening));
    }
    if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f)) {
      bad("weight_decay must be finite and >= 0, got " + std::to_string(o.weight_decay));
    }
    if (o.nesterov && (o.momentum <= 0.0f || o.dampening != 0.0f)) {
      bad("nesterov momentum requires momentum > 0 and dampening 0");
    }
    return o;
  }

  [[nodiscard]] std::uint32_t flags() const noexcept {
    namespace fl = optimizer_state_flags;
    std::uint32_t f = 0;
    if (options_.maximize) f |= fl::maximize;
    if (options_.step_mode == step_count::per_element) f |= fl::per_element_steps;
    if (options_.momentum != 0.0f) f |= fl::sgd_momentum;
    if (options_.nesterov) f |= fl::sgd_nesterov;
    return f;
  }
  [[nodiscard]] std::uint32_t arrays_mask() const noexcept {
    std::uint32_t m = 1;
    if (options_.momentum != 0.0f) m |= 1u << 1;
    if (options_.step_mode == step_count::per_element) m |= 1u << 4;
    return m;
  }
  [[nodiscard]] detail::state_identity identity() const noexcept {
    return {
        optimizer_kind::sgd,
        flags(),
        {options_.lr, options_.momentum, options_.dampening, options_.weight_decay, 0, 0, 0, 0}};
  }

  sgd_options options_;
};

static_assert(dense_optimizer<sgd_optimizer>);
static_assert(sparse_optimizer<sgd_optimizer>);

}  // namespace stellatrain
