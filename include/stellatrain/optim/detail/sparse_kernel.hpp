// SPDX-License-Identifier: Apache-2.0
// The sparse ("lazy") update of a run of (index, gradient) pairs: one element at a time, in
// index order, with software prefetch of the parameters and state some updates ahead.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>
#include <stellatrain/optim/optimizer_types.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace stellatrain::detail {

// How far ahead the sparse kernels prefetch, in updates. Each update touches 2-5 cache lines
// at random addresses (hundreds of ns from DRAM) and costs a few ns of arithmetic, so some
// tens of updates must be in flight. Measured on a 2-core AVX2 machine with bench_optim built
// with this macro at 12, 24, 32 and 48 (BM_optim_sparse_adam and _sgd, 250K updates into 25M,
// medians of 3): 24 was as fast as any other within run-to-run noise (about 20%), and 12 and
// 48 slower for Adam. Set the macro to tune it for another machine.
#ifndef STELLATRAIN_OPTIM_PREFETCH_DISTANCE
#define STELLATRAIN_OPTIM_PREFETCH_DISTANCE 24
#endif
inline constexpr std::size_t sparse_prefetch_distance = STELLATRAIN_OPTIM_PREFETCH_DISTANCE;

struct sparse_piece_result {
  std::uint64_t updated = 0;
  std::uint64_t skipped = 0;
};

// Index sources: a sparse gradient's index array, or the identity (a dense step run through
// the per-element path).
template <class Index>
struct index_array {
  const Index* indices;
  STELLATRAIN_FORCE_INLINE std::uint64_t operator()(std::size_t j) const noexcept {
    return indices[j];
  }
};
struct identity_index {
  STELLATRAIN_FORCE_INLINE std::uint64_t operator()(std::size_t j) const noexcept { return j; }
};

template <std::size_t Arrays, bool PerElement, class IndexFn>
STELLATRAIN_FORCE_INLINE void prefetch_element(const tensor_arrays& t, std::uint64_t i) noexcept {
  // A dense step run element by element streams: the hardware prefetcher does better.
  if constexpr (std::is_same_v<IndexFn, identity_index>) return;
  __builtin_prefetch(t.params + i, 1, 3);
  if constexpr (Arrays > 0) __builtin_prefetch(t.s0 + i, 1, 3);
  if constexpr (Arrays > 1) __builtin_prefetch(t.s1 + i, 1, 3);
  if constexpr (Arrays > 2) __builtin_prefetch(t.s2 + i, 1, 3);
  if constexpr (PerElement) __builtin_prefetch(t.element_steps + i, 1, 3);
}

// Applies the updates at positions [jb, je) (the caller never splits a run of equal indices
// between pieces). Equal consecutive indices form one update whose gradient is their sum, in
// order. `copy`, when not null, receives the new value of each touched parameter at the
// position of each of its gradient entries (compact) or at its index (dense).
//
// PerElement: the step number comes from the element's counter (incremented here,
// saturating); otherwise the rule's per-tensor coefficients apply. Elements whose summed
// gradient is not finite are left untouched and counted (see dense_chunk). The rule and the array
// pointers are taken by value: the kernel's float stores cannot alias local copies, so they
// stay in registers. `Arch` only keeps the instantiations of differently compiled
// translation units apart (see step_driver.hpp).
template <class Arch, bool PerElement, class Rule, class IndexFn, class Value, class Out>
sparse_piece_result sparse_piece(const Rule rule, const tensor_arrays t, IndexFn idx,
                                 const Value* values, std::size_t jb, std::size_t je, Out* copy,
                                 copy_layout layout) noexcept {
  constexpr std::size_t arrays = Rule::state_arrays;
  constexpr std::size_t ahead = sparse_prefetch_distance;
  const typename Rule::template coeffs_type<float> c(rule.scalars);
  sparse_piece_result result;

  // Warm-up: the first `ahead` updates' lines.
  for (std::size_t j = jb; j < je && j < jb + ahead; ++j) {
    prefetch_element<arrays, PerElement, IndexFn>(t, idx(j));
  }
  std::size_t j = jb;
  while (j < je) {
    const std::uint64_t i = idx(j);
    float g = to_float(values[j]);
    if (j + ahead < je) prefetch_element<arrays, PerElement, IndexFn>(t, idx(j + ahead));
    std::size_t run_end = j + 1;
    while (run_end < je && idx(run_end) == i) [[unlikely]] {
        g += to_float(values[run_end]);
        if (run_end + ahead < je)
          prefetch_element<arrays, PerElement, IndexFn>(t, idx(run_end + ahead));
        ++run_end;
      }

    float p = t.params[i];
    if (std::isfinite(g)) [[likely]] {
      float a0 = 0.0f;
      float a1 = 0.0f;
      float a2 = 0.0f;
      if constexpr (arrays > 0) a0 = t.s0[i];
      if constexpr (arrays > 1) a1 = t.s1[i];
      if constexpr (arrays > 2) a2 = t.s2[i];
      if constexpr (PerElement) {
        const std::uint32_t k = t.element_steps[i];
        rule.apply_element(p, g, a0, a1, a2, k, c);
        t.element_steps[i] = k == std::numeric_limits<std::uint32_t>::max() ? k : k + 1;
      } else {
        rule.apply(p, g, a0, a1, a2, c);
      }
      t.params[i] = p;
      if constexpr (arrays > 0) t.s0[i] = a0;
      if constexpr (arrays > 1) t.s1[i] = a1;
      if constexpr (arrays > 2) t.s2[i] = a2;
      ++result.updated;
    } else {
      ++result.skipped;
    }
    if (copy != nullptr) {
      const Out out = from_float<Out>(p);
      if (layout == copy_layout::compact) {
        for (std::size_t q = j; q < run_end; ++q) copy[q] = out;
      } else {
        copy[i] = out;
      }
    }
    j = run_end;
  }
  return result;
}

}  // namespace stellatrain::detail
