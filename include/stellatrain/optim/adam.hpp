// SPDX-License-Identifier: Apache-2.0
// Adam (coupled L2 weight decay), AdamW (decoupled weight decay) and AMSGrad (per-element
// maximum of the second moment), with PyTorch's semantics, for dense and sparse ("lazy")
// gradients on fp32 master parameters.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/detail/bias_correction.hpp>
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

namespace stellatrain {

namespace detail {

// -lr * sqrt(1 - beta2^k) / (1 - beta1^k): the step size of torch.optim.SparseAdam.
[[nodiscard]] inline float adam_sparse_step(float lr, const adam_bias_terms& b) noexcept {
  return static_cast<float>(-static_cast<double>(lr) * static_cast<double>(b.inv_bias_correction1) /
                            static_cast<double>(b.inv_sqrt_bias_correction2));
}

template <bool Amsgrad, bool Coupled, bool Decoupled>
struct adam_rule {
  static constexpr std::size_t state_arrays = Amsgrad ? 3 : 2;
  template <class T>
  using coeffs_type = adam_coeffs<T>;

  adam_scalars scalars;
  float lr = 0.0f;
  const adam_bias_table* table = nullptr;  // per-element steps only
  bool sparse_formula = false;             // adam_formula::sparse_adam

  template <class T>
  STELLATRAIN_FORCE_INLINE void apply(T& p, T g, T& m, T& v, T& vmax,
                                      const adam_coeffs<T>& c) const noexcept {
    adam_update<Amsgrad, Coupled, Decoupled>(p, g, m, v, vmax, c);
  }
  // `earlier_steps`: how many steps touched this element before this one.
  STELLATRAIN_FORCE_INLINE void apply_element(float& p, float g, float& m, float& v, float& vmax,
                                              std::uint32_t earlier_steps,
                                              const adam_coeffs<float>& c) const noexcept {
    const adam_bias_terms b = table->at(std::uint64_t{earlier_steps} + 1);
    adam_coeffs<float> e = c;
    if (sparse_formula) {
      e.neg_step_size = adam_sparse_step(lr, b);
      e.inv_sqrt_bias_correction2 = 1.0f;
    } else {
      e.neg_step_size = -lr * b.inv_bias_correction1;
      e.inv_sqrt_bias_correction2 = b.inv_sqrt_bias_correction2;
    }
    adam_update<Amsgrad, Coupled, Decoupled>(p, g, m, v, vmax, e);
  }
};

}  // namespace detail

/// How Adam applies weight decay.
enum class weight_decay_mode : std::uint8_t {
  l2 = 0,         ///< Adam: added to the gradient, `g += weight_decay * p` (torch.optim.Adam)
  decoupled = 1,  ///< AdamW: `p *= 1 - lr * weight_decay` before the update (torch.optim.AdamW)
};

/// Where Adam's eps enters, as the two PyTorch optimizers place it (step k, bias corrections
/// bc1 = 1 - beta1^k, bc2 = 1 - beta2^k):
/// - `adam`: `p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)` (torch.optim.Adam, AdamW);
/// - `sparse_adam`: `p -= lr * sqrt(bc2) / bc1 * m / (sqrt(v) + eps)` (torch.optim.SparseAdam).
/// The two agree when eps is small against sqrt(v) / sqrt(bc2); for gradients near eps they
/// do not (at |g| = 1e-8, step 1 and default betas: 0.5 * lr against 0.031 * lr).
enum class adam_formula : std::uint8_t { adam = 0, sparse_adam = 1 };

/// Options of `adam_optimizer`, with PyTorch's meaning and defaults (`torch.optim.Adam`).
/// For AdamW set `.decay = weight_decay_mode::decoupled` (PyTorch's AdamW default weight
/// decay is 1e-2: `adamw_defaults`).
struct adam_options {
  float lr = 1e-3f;           ///< learning rate, >= 0
  float beta1 = 0.9f;         ///< first-moment decay, in [0, 1)
  float beta2 = 0.999f;       ///< second-moment decay, in [0, 1)
  float eps = 1e-8f;          ///< added to the bias-corrected sqrt(v), >= 0
  float weight_decay = 0.0f;  ///< >= 0
  weight_decay_mode decay = weight_decay_mode::l2;
  bool amsgrad = false;   ///< keep the per-element maximum of v and divide by its root
  bool maximize = false;  ///< ascend instead of descend
  step_count step_mode = step_count::per_tensor;  ///< step used by sparse bias correction
  nonfinite_policy nonfinite = nonfinite_policy::skip_elements;
  /// torch.optim.Adam's placement of eps (the default), or torch.optim.SparseAdam's: with
  /// `step_mode = per_tensor` and sparse steps, `sparse_adam` is SparseAdam's update.
  adam_formula formula = adam_formula::adam;
};

/// PyTorch's AdamW defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
inline constexpr adam_options adamw_defaults{.weight_decay = 1e-2f,
                                             .decay = weight_decay_mode::decoupled};

/// Adam / AdamW / AMSGrad on fp32 master parameters that the optimizer owns.
///
/// Update of one element with gradient g at step k (PyTorch's equations and order):
/// \code
///   g = maximize ? -g : g
///   l2: if weight_decay != 0: g += weight_decay * p      decoupled: p *= 1 - lr * weight_decay
///   m = beta1 * m + (1 - beta1) * g
///   v = beta2 * v + (1 - beta2) * g * g
///   amsgrad: vmax = max(vmax, v), v' = vmax   (one maximum per element)
///   p -= lr / (1 - beta1^k) * m / (sqrt(v') / sqrt(1 - beta2^k) + eps)
///   (formula sparse_adam: p -= lr * sqrt(1 - beta2^k) / (1 - beta1^k) * m / (sqrt(v') + eps))
/// \endcode
/// All arithmetic is fp32; the bias-correction factors are computed per step in double and
/// rounded (within an ulp or two of PyTorch).
///
/// Dense steps run one fused SIMD pass (read p, g, m, v; write p, m, v: 28 bytes per
/// parameter, the memory bound) split across the executor. Sparse steps are lazy: only the
/// elements at the gradient's indices change, moments of untouched elements do not decay, and
/// k is the tensor's step count (`step_count::per_tensor`, as torch.optim.SparseAdam) or the
/// element's own (`step_count::per_element`, through a table of the bias-correction factors).
/// Indices must be sorted non-decreasing; equal indices are summed into one update; an index
/// out of range or out of order is an error and nothing is written.
///
/// Registration (`add_tensor`, or `add_tensor_in_place` for parameters the caller holds), the
/// dense and sparse `step`, `params`, step counts and checkpoints (`save_state`, `load_state`)
/// are common to the optimizers and documented in optim/detail/optimizer_base.hpp. `load_state`
/// requires the saved state's formula, l2 / decoupled, amsgrad, maximize and step mode to match,
/// and takes over its lr, betas, eps and weight decay.
///
/// Thread safety: steps on different tensors may run concurrently; `add_tensor`,
/// `set_lr` and `load_state` must not overlap any other call. Steps never allocate.
///
/// \code
///   stellatrain::thread_pool pool{2};
///   stellatrain::adam_optimizer opt(stellatrain::adamw_defaults);
///   stellatrain::aligned_buffer<float> w(1 << 20, {.prefault = true});
///   auto t = opt.add_tensor(w.span(), pool);
///   std::vector<float> g(w.size(), 0.01f);
///   std::vector<stellatrain::bf16> upload(w.size());
///   opt.step(t, std::span<const float>(g), pool,
///   stellatrain::param_copy<stellatrain::bf16>{upload});
/// \endcode
class adam_optimizer : public detail::optimizer_base<adam_optimizer> {
 public:
  static constexpr const char* name = "adam";

  /// Throws `errc::invalid_argument` for options PyTorch refuses (negative lr, eps or weight
  /// decay; betas outside [0, 1)), non-finite ones, and, with per-element steps, betas so close
  /// to 1 that the bias-correction table would pass 2^22 entries.
  explicit adam_optimizer(const adam_options& options = {}) { set_options(options); }

  [[nodiscard]] const adam_options& options() const noexcept { return options_; }

  /// Changes the learning rate for later steps (a scheduler's hook).
  void set_lr(float lr) {
    adam_options o = options_;
    o.lr = lr;
    options_ = validated(o);
  }

  /// First moment m of tensor `t`.
  [[nodiscard]] std::span<const float> exp_avg(std::size_t t) const { return state_array(t, 0); }
  /// Second moment v of tensor `t`.
  [[nodiscard]] std::span<const float> exp_avg_sq(std::size_t t) const { return state_array(t, 1); }
  /// Per-element maximum of v (empty unless amsgrad).
  [[nodiscard]] std::span<const float> max_exp_avg_sq(std::size_t t) const {
    return state_array(t, 2);
  }

  // Used by the step driver.
  template <class F>
  void with_rule(std::uint64_t step, F&& f) const {
    const auto& o = options_;
    detail::adam_scalars s;
    s.sign = o.maximize ? -1.0f : 1.0f;
    s.weight_decay = o.weight_decay;
    s.decay =
        static_cast<float>(1.0 - static_cast<double>(o.lr) * static_cast<double>(o.weight_decay));
    s.beta1 = o.beta1;
    s.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(o.beta1));
    s.beta2 = o.beta2;
    s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(o.beta2));
    s.eps = o.eps;
    const detail::adam_bias_terms b = detail::adam_bias_terms_at(o.beta1, o.beta2, step);
    const bool sparse_formula = o.formula == adam_formula::sparse_adam;
    if (sparse_formula) {
      s.neg_step_size = detail::adam_sparse_step(o.lr, b);
      s.inv_sqrt_bias_correction2 = 1.0f;
    } else {
      s.neg_step_size = -o.lr * b.inv_bias_correction1;
      s.inv_sqrt_bias_correction2 = b.inv_sqrt_bias_correction2;
    }
    const bool wd = o.weight_decay != 0.0f;
    const bool coupled = wd && o.decay == weight_decay_mode::l2;
    const bool decoupled = wd && o.decay == weight_decay_mode::decoupled;
    auto run = [&]<bool A, bool C, bool D>() {
      f(detail::adam_rule<A, C, D>{s, o.lr, &table_, sparse_formula});
    };
    if (o.amsgrad) {
      coupled     ? run.template operator()<true, true, false>()
      : decoupled ? run.template operator()<true, false, true>()
                  : run.template operator()<true, false, false>();
    } else {
      coupled     ? run.template operator()<false, true, false>()
      : decoupled ? run.template operator()<false, false, true>()
                  : run.template operator()<false, false, false>();
    }
  }

 private:
  friend class detail::optimizer_base<adam_optimizer>;

  void restore(std::span<const std::byte> bytes) {
    adam_options restored = options_;
    detail::adam_bias_table table;
    detail::load_state(bytes, identity(), registry_, arrays_mask(),
                       [&](const std::array<float, 8>& h) {
                         restored.lr = h[0];
                         restored.beta1 = h[1];
                         restored.beta2 = h[2];
                         restored.eps = h[3];
                         restored.weight_decay = h[4];
                         restored = validated(restored);
                         if (restored.step_mode == step_count::per_element)
                           table = detail::adam_bias_table(restored.beta1, restored.beta2);
                       });
    options_ = restored;
    table_ = std::move(table);
  }

  void set_options(const adam_options& options) {
    options_ = validated(options);
    if (options_.step_mode == step_count::per_element) {
      table_ = detail::adam_bias_table(options_.beta1, options_.beta2);
    }
  }

  static adam_options validated(const adam_options& o) {
    auto bad = [](const std::string& what) {
      throw_error(errc::invalid_argument, "adam: " + what);
    };
    if (!(std::isfinite(o.lr) && o.lr >= 0.0f))
      bad("lr must be finite and >= 0, got " + std::to_string(o.lr));
    if (!(o.beta1 >= 0.0f && o.beta1 < 1.0f))
      bad("beta1 must be in [0, 1), got " + std::to_string(o.beta1));
    if (!(o.beta2 >= 0.0f && o.beta2 < 1.0f))
      bad("beta2 must be in [0, 1), got " + std::to_string(o.beta2));
    if (!(std::isfinite(o.eps) && o.eps >= 0.0f))
      bad("eps must be finite and >= 0, got " + std::to_string(o.eps));
    if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f)) {
      bad("weight_decay must be finite and >= 0, got " + std::to_string(o.weight_decay));
    }
    return o;
  }

  [[nodiscard]] std::uint32_t flags() const noexcept {
    namespace fl = optimizer_state_flags;
    std::uint32_t f = 0;
    if (options_.maximize) f |= fl::maximize;
    if (options_.step_mode == step_count::per_element) f |= fl::per_element_steps;
    if (options_.amsgrad) f |= fl::adam_amsgrad;
    if (options_.decay == weight_decay_mode::decoupled) f |= fl::adam_decoupled;
    if (options_.formula == adam_formula::sparse_adam) f |= fl::adam_sparse_formula;
    return f;
  }
  [[nodiscard]] std::uint32_t arrays_mask() const noexcept {
    std::uint32_t m = 1u | (1u << 1) | (1u << 2);
    if (options_.amsgrad) m |= 1u << 3;
    if (options_.step_mode == step_count::per_element) m |= 1u << 4;
    return m;
  }
  [[nodiscard]] detail::state_identity identity() const noexcept {
    const auto& o = options_;
    return {
        optimizer_kind::adam, flags(), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, 0, 0, 0}};
  }

  adam_options options_;
  detail::adam_bias_table table_;
};

static_assert(dense_optimizer<adam_optimizer>);
static_assert(sparse_optimizer<adam_optimizer>);

}  // namespace stellatrain
