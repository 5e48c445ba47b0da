// SPDX-License-Identifier: Apache-2.0
// The per-element update rules of SGD and Adam, written once for `float` (the sparse, scalar
// path) and for `xsimd::batch<float, Arch>` (the dense path), so both paths do the same
// arithmetic in the same order. Operation order follows PyTorch's implementation.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>

#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstdint>

namespace stellatrain::detail {

STELLATRAIN_FORCE_INLINE float vsqrt(float x) noexcept { return std::sqrt(x); }
// On AVX-512 the zero-masked forms with every lane set: GCC 12 warns (wrongly, bug 105593)
// inside the unmasked intrinsics that xsimd calls.
template <class Arch>
STELLATRAIN_FORCE_INLINE xsimd::batch<float, Arch> vsqrt(
    const xsimd::batch<float, Arch>& x) noexcept {
  // vsqrtps: no errno, no -fno-math-errno needed
  if constexpr (lane_isa_of<Arch>() == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
    return _mm512_maskz_sqrt_ps(static_cast<__mmask16>(0xffff), x);
#endif
  } else {
    return xsimd::sqrt(x);
  }
}

// a * b + c rounded once, where torch's CPU kernels fuse (`add` with alpha, `addcmul`), on
// targets with FMA; a target without it (the x86-64 baseline) rounds twice, in the scalar and
// the SIMD path alike. The intrinsics, not xsimd::fma: xsimd 8 has no AVX-512 fma and falls
// back to a multiply and an add.
STELLATRAIN_FORCE_INLINE float madd(float a, float b, float c) noexcept {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
template <class Arch>
STELLATRAIN_FORCE_INLINE xsimd::batch<float, Arch> madd(
    const xsimd::batch<float, Arch>& a, const xsimd::batch<float, Arch>& b,
    const xsimd::batch<float, Arch>& c) noexcept {
#if STELLATRAIN_X86_INTRINSICS && defined(__FMA__)
  constexpr lane_isa isa = lane_isa_of<Arch>();
  if constexpr (isa == lane_isa::avx512) {
    return _mm512_fmadd_ps(a, b, c);
  } else if constexpr (isa == lane_isa::avx2 || isa == lane_isa::avx) {
    return _mm256_fmadd_ps(a, b, c);
  } else if constexpr (isa == lane_isa::sse2) {
    return _mm_fmadd_ps(a, b, c);
  } else {
    return xsimd::fma(a, b, c);
  }
#elif defined(__ARM_FEATURE_FMA)
  return xsimd::fma(a, b, c);
#else
  return a * b + c;
#endif
}

STELLATRAIN_FORCE_INLINE float elementwise_max(float a, float b) noexcept {
  // torch.maximum propagates NaN; v is never NaN here (non-finite gradients never reach it).
  return a < b ? b : a;
}
template <class Arch>
STELLATRAIN_FORCE_INLINE xsimd::batch<float, Arch> elementwise_max(
    const xsimd::batch<float, Arch>& a, const xsimd::batch<float, Arch>& b) noexcept {
  if constexpr (lane_isa_of<Arch>() == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
    return _mm512_maskz_max_ps(static_cast<__mmask16>(0xffff), a, b);
#endif
  } else {
    return xsimd::max(a, b);
  }
}

// ------------------------------------------------------------------------------- SGD

// Scalars of one SGD step, computed once per call (in double, rounded to float as PyTorch
// rounds its Python-double hyper-parameters when it applies them to a float tensor).
struct sgd_scalars {
  float sign = 1.0f;  // -1 when maximizing
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  float one_minus_dampening = 1.0f;
  float neg_lr = 0.0f;
};

template <class T>
struct sgd_coeffs {
  T sign, weight_decay, momentum, one_minus_dampening, neg_lr;
  STELLATRAIN_FORCE_INLINE explicit sgd_coeffs(const sgd_scalars& s) noexcept
      : sign(s.sign),
        weight_decay(s.weight_decay),
        momentum(s.momentum),
        one_minus_dampening(s.one_minus_dampening),
        neg_lr(s.neg_lr) {}
};

// torch.optim.SGD, one element (or one batch of elements), fused where torch's `add` with
// alpha is (see madd):
//   d = maximize ? -g : g;  if wd: d = fma(p, wd, d)
//   if momentum: buf = first ? d : fma(d, 1 - dampening, buf * momentum)
//                d = nesterov ? fma(buf, momentum, d) : buf
//   p = fma(d, -lr, p)
template <bool Momentum, bool Nesterov, bool WeightDecay, class T>
STELLATRAIN_FORCE_INLINE void sgd_update(T& p, T g, T& buf, bool first,
                                         const sgd_coeffs<T>& c) noexcept {
  T d = g * c.sign;
  if constexpr (WeightDecay) d = madd(p, c.weight_decay, d);
  if constexpr (Momentum) {
    buf = first ? d : madd(d, c.one_minus_dampening, buf * c.momentum);
    if constexpr (Nesterov) {
      d = madd(buf, c.momentum, d);
    } else {
      d = buf;
    }
  }
  p = madd(d, c.neg_lr, p);
}

// ------------------------------------------------------------------------------- Adam

// Scalars of one Adam step. `neg_step_size = -lr / (1 - beta1^k)` is formed as
// `-lr * float(1 / (1 - beta1^k))` and the denominator as `sqrt(v) * float(1 / sqrt(1 -
// beta2^k)) + eps`: the same per-tensor and per-element (from a table), one multiply instead
// of a divide each, and within an ulp or two of PyTorch's double-precision scalars.
struct adam_scalars {
  float sign = 1.0f;
  float weight_decay = 0.0f;  // coupled (L2) decay only
  float decay = 1.0f;         // decoupled (AdamW): 1 - lr * weight_decay
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float eps = 1e-8f;
  float neg_step_size = 0.0f;
  float inv_sqrt_bias_correction2 = 1.0f;
};

template <class T>
struct adam_coeffs {
  T sign, weight_decay, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size,
      inv_sqrt_bias_correction2;
  STELLATRAIN_FORCE_INLINE explicit adam_coeffs(const adam_scalars& s) noexcept
      : sign(s.sign),
        weight_decay(s.weight_decay),
        decay(s.decay),
        beta1(s.beta1),
        one_minus_beta1(s.one_minus_beta1),
        beta2(s.beta2),
        one_minus_beta2(s.one_minus_beta2),
        eps(s.eps),
        neg_step_size(s.neg_step_size),
        inv_sqrt_bias_correction2(s.inv_sqrt_bias_correction2) {}
};

// torch.optim.Adam / AdamW, one element (or batch), with torch's roundings where it fuses
// (fma: `add(alpha)` and `addcmul`; torch 2's `lerp_` for m rounds within an ulp of this):
//   g = maximize ? -g : g
//   Adam:  if wd: g = fma(p, wd, g)        AdamW: p = p * (1 - lr * wd)
//   m = fma(g, 1 - beta1, m * beta1)
//   v = fma((1 - beta2) * g, g, v * beta2)
//   AMSGrad: vmax = max(vmax, v), v' = vmax
//   p = p + (-step_size * m) / (sqrt(v') / sqrt(bc2) + eps)
template <bool Amsgrad, bool CoupledDecay, bool DecoupledDecay, class T>
STELLATRAIN_FORCE_INLINE void adam_update(T& p, T g, T& m, T& v, T& vmax,
                                          const adam_coeffs<T>& c) noexcept {
  g = g * c.sign;
  if constexpr (CoupledDecay) g = madd(p, c.weight_decay, g);
  if constexpr (DecoupledDecay) p = p * c.decay;
  m = madd(g, c.one_minus_beta1, m * c.beta1);
  v = madd(c.one_minus_beta2 * g, g, v * c.beta2);
  T second = v;
  if constexpr (Amsgrad) {
    vmax = elementwise_max(vmax, v);
    second = vmax;
  }
  const T denom = vsqrt(second) * c.inv_sqrt_bias_correction2 + c.eps;
  p = p + (c.neg_step_size * m) / denom;
}

}  // namespace stellatrain::detail
