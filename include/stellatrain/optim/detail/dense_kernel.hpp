// SPDX-License-Identifier: Apache-2.0
// The dense update of one chunk: one fused pass that reads p, g and the state arrays, applies
// the rule to a SIMD batch at a time and writes p, the state and the optional 16-bit copy.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/value_convert.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>

#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace stellatrain::detail {

// Updates elements [b, e) of `t` with gradient `g` (indexed like the tensor) and writes the new
// parameters to `copy` (same indexing) when it is not null. Elements whose gradient is not
// finite are left untouched; returns how many. (Steps whose policy rejects non-finite
// gradients check before this pass: masking finds nothing then, at the cost of a compare per
// batch, which keeps one instantiation per rule instead of two.)
//
// The last partial batch runs through the same batch code on a padded copy, so every element
// sees identical arithmetic whatever the chunking: results do not depend on the thread count.
// Rule coefficients are built here, inside the chunk: batch constants captured from outside a
// parallel region are reloaded on every iteration.
template <class Arch, class Rule, class Grad, class Out>
std::uint64_t dense_chunk(const Rule& rule, const tensor_arrays& t, const Grad* g, Out* copy,
                          std::size_t b, std::size_t e) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr std::size_t width = batch::size;
  constexpr std::size_t arrays = Rule::state_arrays;
  const typename Rule::template coeffs_type<batch> c(rule.scalars);
  std::uint64_t skipped = 0;

  auto body = [&](float* p, const Grad* gp, float* a0, float* a1, float* a2, Out* out)
      __attribute__((always_inline)) {
    batch vp = batch::load_unaligned(p);
    const batch vg = load_as_float<Arch>(gp);
    batch v0(0.0f), v1(0.0f), v2(0.0f);
    if constexpr (arrays > 0) v0 = batch::load_unaligned(a0);
    if constexpr (arrays > 1) v1 = batch::load_unaligned(a1);
    if constexpr (arrays > 2) v2 = batch::load_unaligned(a2);
    batch np = vp, n0 = v0, n1 = v1, n2 = v2;
    rule.apply(np, vg, n0, n1, n2, c);
    const auto finite = xsimd::isfinite(vg);
    if (!xsimd::all(finite)) [[unlikely]] {
      alignas(64) float lanes[width];
      vg.store_aligned(lanes);
      for (std::size_t k = 0; k < width; ++k) skipped += std::isfinite(lanes[k]) ? 0 : 1;
      np = xsimd::select(finite, np, vp);
      n0 = xsimd::select(finite, n0, v0);
      n1 = xsimd::select(finite, n1, v1);
      n2 = xsimd::select(finite, n2, v2);
    }
    vp = np;
    v0 = n0;
    v1 = n1;
    v2 = n2;
    vp.store_unaligned(p);
    if constexpr (arrays > 0) v0.store_unaligned(a0);
    if constexpr (arrays > 1) v1.store_unaligned(a1);
    if constexpr (arrays > 2) v2.store_unaligned(a2);
    if (out != nullptr) store_from_float<Arch>(out, vp);
  };

  // Local copies: stores through float* could alias `t`, which would reload it every batch.
  float* const params = t.params;
  float* const s0 = t.s0;
  float* const s1 = t.s1;
  float* const s2 = t.s2;
  std::size_t i = b;
  for (; i + width <= e; i += width) {
    body(params + i, g + i, arrays > 0 ? s0 + i : nullptr, arrays > 1 ? s1 + i : nullptr,
         arrays > 2 ? s2 + i : nullptr, copy != nullptr ? copy + i : nullptr);
  }
  if (i < e) {
    const std::size_t r = e - i;
    alignas(64) float tp[width] = {};
    alignas(64) float t0[width] = {};
    alignas(64) float t1[width] = {};
    alignas(64) float t2[width] = {};
    alignas(64) Grad tg[width] = {};
    alignas(64) Out tc[width] = {};
    for (std::size_t k = 0; k < r; ++k) {
      tp[k] = t.params[i + k];
      tg[k] = g[i + k];
      if constexpr (arrays > 0) t0[k] = t.s0[i + k];
      if constexpr (arrays > 1) t1[k] = t.s1[i + k];
      if constexpr (arrays > 2) t2[k] = t.s2[i + k];
    }
    // Padding lanes hold zeros: a finite gradient, so they never count as skipped.
    body(tp, tg, t0, t1, t2, copy != nullptr ? tc : nullptr);
    for (std::size_t k = 0; k < r; ++k) {
      t.params[i + k] = tp[k];
      if constexpr (arrays > 0) t.s0[i + k] = t0[k];
      if constexpr (arrays > 1) t.s1[i + k] = t1[k];
      if constexpr (arrays > 2) t.s2[i + k] = t2[k];
      if (copy != nullptr) copy[i + k] = tc[k];
    }
  }
  return skipped;
}

}  // namespace stellatrain::detail
