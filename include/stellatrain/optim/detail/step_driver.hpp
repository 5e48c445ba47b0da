// SPDX-License-Identifier: Apache-2.0
// What every optimizer step does around its kernel: argument checks, the validation and
// non-finite pre-pass (before anything is written), and the split of the work across the
// executor, for dense and sparse steps.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/detail/dense_kernel.hpp>
#include <stellatrain/optim/detail/sparse_kernel.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>
#include <stellatrain/optim/optimizer_types.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>

namespace stellatrain::detail {

inline constexpr std::uint64_t no_element = std::numeric_limits<std::uint64_t>::max();

// Dense chunks: long enough that a chunk amortises its dispatch, short enough (1 MiB of each
// array) that the executor balances uneven progress. Multiples of 64 elements keep every
// chunk on cache-line boundaries of the (64-byte aligned) state arrays.
inline constexpr std::uint64_t dense_min_grain = std::uint64_t{1} << 15;
inline constexpr std::uint64_t dense_max_grain = std::uint64_t{1} << 18;
// Sparse pieces: a few thousand updates each (a piece restarts the prefetch pipeline).
inline constexpr std::uint64_t sparse_min_grain = 4096;

template <executor Executor>
std::uint64_t dense_grain(std::uint64_t n, Executor& ex) noexcept {
  return std::min(balanced_grain(n, ex.concurrency(), dense_min_grain, 64),
                  std::max(dense_max_grain, dense_min_grain));
}

inline void atomic_min(std::atomic<std::uint64_t>& a, std::uint64_t v) noexcept {
  std::uint64_t cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

inline std::string describe_value(float v) {
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+inf" : "-inf";
}

// ------------------------------------------------------------------------------- dense

template <class Grad, class Out>
void check_dense_arguments(const char* who, std::size_t tensor, const tensor_state& t,
                           std::size_t grad_size, const param_copy<Out>& copy) {
  if (grad_size != t.size) [[unlikely]] {
    throw_error(errc::size_mismatch, std::string(who) + ": tensor " + std::to_string(tensor) +
                                         ": gradient has " + std::to_string(grad_size) +
                                         " elements, the tensor " + std::to_string(t.size));
  }
  if (!copy.values.empty() && copy.values.size() != t.size) [[unlikely]] {
    throw_error(errc::size_mismatch, std::string(who) + ": tensor " + std::to_string(tensor) +
                                         ": parameter copy has " +
                                         std::to_string(copy.values.size()) +
                                         " elements, the tensor " + std::to_string(t.size));
  }
}

// True for NaN and infinities, from the bits alone (exponent all ones), so that the check loop
// vectorises without relying on compiler flags.
template <class T>
STELLATRAIN_FORCE_INLINE bool nonfinite_bits(T x) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) == 0x7f800000u;
  } else if constexpr (std::is_same_v<T, fp16>) {
    return (x.bits() & 0x7c00u) == 0x7c00u;
  } else {
    return (x.bits() & 0x7f80u) == 0x7f80u;
  }
}

// For skip_tensor / raise: counts the non-finite gradient values and finds the first, before
// anything is written. Returns the count.
template <class Arch, class Grad, executor Executor>
std::uint64_t dense_nonfinite_check(std::span<const Grad> g, Executor& ex,
                                    std::uint64_t& first_position) {
  std::atomic<std::uint64_t> count{0};
  std::atomic<std::uint64_t> first{no_element};
  const std::uint64_t n = g.size();
  const Grad* data = g.data();
  for_each_chunk(ex, n, balanced_grain(n, ex.concurrency(), std::uint64_t{1} << 16, 64),
                 [&](std::uint64_t b, std::uint64_t e) {
                   std::uint32_t local = 0;
                   for (std::uint64_t i = b; i < e; ++i) local += nonfinite_bits(data[i]) ? 1u : 0u;
                   if (local != 0) [[unlikely]] {
                     std::uint64_t i = b;
                     while (!nonfinite_bits(data[i])) ++i;
                     count.fetch_add(local, std::memory_order_relaxed);
                     atomic_min(first, i);
                   }
                 });
  first_position = first.load();
  return count.load();
}

// The update pass of a dense step with per-tensor coefficients.
template <class Arch, class Rule, class Grad, class Out, executor Executor>
std::uint64_t dense_update(const Rule& rule, tensor_state& t, const Grad* g, Out* copy,
                           Executor& ex) {
  const tensor_arrays a = arrays_of(t);
  const std::uint64_t n = t.size;
  std::atomic<std::uint64_t> skipped{0};
  for_each_chunk(ex, n, dense_grain(n, ex), [&](std::uint64_t b, std::uint64_t e) {
    const std::uint64_t s = dense_chunk<Arch>(rule, a, g, copy, static_cast<std::size_t>(b),
                                              static_cast<std::size_t>(e));
    if (s != 0) skipped.fetch_add(s, std::memory_order_relaxed);
  });
  return skipped.load();
}

// The update pass of a dense step with per-element step counts: the scalar element loop.
template <class Arch, class Rule, class Grad, class Out, executor Executor>
std::uint64_t dense_update_per_element(const Rule& rule, tensor_state& t, const Grad* g, Out* copy,
                                       Executor& ex) {
  const tensor_arrays a = arrays_of(t);
  const std::uint64_t n = t.size;
  std::atomic<std::uint64_t> skipped{0};
  for_each_chunk(ex, n, dense_grain(n, ex), [&](std::uint64_t b, std::uint64_t e) {
    const auto r =
        sparse_piece<Arch, true>(rule, a, identity_index{}, g, static_cast<std::size_t>(b),
                                 static_cast<std::size_t>(e), copy, copy_layout::dense);
    if (r.skipped != 0) skipped.fetch_add(r.skipped, std::memory_order_relaxed);
  });
  return skipped.load();
}

// ------------------------------------------------------------------------------- sparse

template <class Out>
void check_sparse_arguments(const char* who, std::size_t tensor, const tensor_state& t,
                            std::uint64_t count, std::uint64_t dense_size,
                            const param_copy<Out>& copy) {
  const std::string where = std::string(who) + ": tensor " + std::to_string(tensor);
  if (dense_size != t.size) [[unlikely]] {
    throw_error(errc::size_mismatch, where + ": sparse gradient is over " +
                                         std::to_string(dense_size) + " elements, the tensor has " +
                                         std::to_string(t.size));
  }
  if (!copy.values.empty()) {
    const std::uint64_t want = copy.layout == copy_layout::compact ? count : t.size;
    if (copy.values.size() != want) [[unlikely]] {
      throw_error(errc::size_mismatch,
                  where + ": " + (copy.layout == copy_layout::compact ? "compact" : "dense") +
                      " parameter copy has " + std::to_string(copy.values.size()) +
                      " elements, expected " + std::to_string(want));
    }
  }
}

// Moves a piece boundary forward past a run of equal indices, so no run is split.
template <class Index>
STELLATRAIN_FORCE_INLINE std::size_t run_boundary(const Index* idx, std::size_t count,
                                                  std::size_t b) noexcept {
  while (b > 0 && b < count && idx[b] == idx[b - 1]) ++b;
  return b;
}

struct sparse_check_result {
  std::uint64_t bad_order = no_element;     // first position j with idx[j-1] > idx[j]
  std::uint64_t out_of_range = no_element;  // first position with idx[j] >= size
  std::uint64_t nonfinite = 0;              // runs whose summed gradient is not finite
  std::uint64_t first_nonfinite = no_element;
};

// The pre-pass of a sparse step, before anything is written: indices in range and
// non-decreasing; with `check_finite`, the summed gradient of every run finite.
template <class Arch, class Value, class Index, executor Executor>
sparse_check_result sparse_check(const Index* idx, const Value* val, std::uint64_t count,
                                 std::uint64_t size, bool check_finite, Executor& ex) {
  std::atomic<std::uint64_t> bad_order{no_element};
  std::atomic<std::uint64_t> out_of_range{no_element};
  std::atomic<std::uint64_t> nonfinite{0};
  std::atomic<std::uint64_t> first_nonfinite{no_element};
  for_each_chunk(ex, count, balanced_grain(count, ex.concurrency(), std::uint64_t{1} << 15),
                 [&](std::uint64_t b, std::uint64_t e) {
                   bool order_ok = true;
                   std::uint64_t max_index = 0;
                   for (std::uint64_t j = b; j < e; ++j) {
                     const std::uint64_t i = idx[j];
                     max_index = std::max(max_index, i);
                     if (j > 0) order_ok &= idx[j - 1] <= idx[j];
                   }
                   if (!order_ok) [[unlikely]] {
                     for (std::uint64_t j = std::max<std::uint64_t>(b, 1); j < e; ++j) {
                       if (idx[j - 1] > idx[j]) {
                         atomic_min(bad_order, j);
                         break;
                       }
                     }
                   }
                   if (max_index >= size) [[unlikely]] {
                     for (std::uint64_t j = b; j < e; ++j) {
                       if (idx[j] >= size) {
                         atomic_min(out_of_range, j);
                         break;
                       }
                     }
                   }
                   if (check_finite) {
                     std::uint64_t local = 0;
                     std::uint64_t local_first = no_element;
                     // Runs that start in [b, e), summed exactly as the update sums them;
                     // a run that started before b belongs to the previous chunk.
                     std::uint64_t j = b;
                     if (b > 0) {
                       while (j < e && idx[j] == idx[b - 1]) ++j;
                     }
                     while (j < e) {
                       float s = to_float(val[j]);
                       std::uint64_t r = j + 1;
                       while (r < count && idx[r] == idx[j]) s += to_float(val[r++]);
                       if (!std::isfinite(s)) [[unlikely]] {
                         ++local;
                         if (local_first == no_element) local_first = j;
                       }
                       j = r;
                     }
                     if (local != 0) {
                       nonfinite.fetch_add(local, std::memory_order_relaxed);
                       atomic_min(first_nonfinite, local_first);
                     }
                   }
                 });
  return {bad_order.load(), out_of_range.load(), nonfinite.load(), first_nonfinite.load()};
}

template <class Value, class Index>
[[noreturn]] void throw_sparse_index_error(const char* who, std::size_t tensor,
                                           const sparse_check_result& r, const Index* idx,
                                           std::uint64_t size) {
  const std::string where = std::string(who) + ": tensor " + std::to_string(tensor) + ": ";
  // Report whichever problem comes first in the input.
  if (r.out_of_range <= r.bad_order) {
    const std::uint64_t j = r.out_of_range;
    throw_error(errc::out_of_range, where + "index " + std::to_string(idx[j]) + " at position " +
                                        std::to_string(j) + " is not below the tensor size " +
                                        std::to_string(size) + "; nothing was updated");
  }
  const std::uint64_t j = r.bad_order;
  throw_error(errc::invalid_argument, where + "indices must be sorted (non-decreasing): position " +
                                          std::to_string(j) + " holds " + std::to_string(idx[j]) +
                                          " after " + std::to_string(idx[j - 1]) +
                                          "; nothing was updated");
}

// The update pass of a sparse step: pieces of about equal update counts, never splitting a
// run of equal indices.
template <class Arch, bool PerElement, class Rule, class Value, class Index, class Out,
          executor Executor>
sparse_piece_result sparse_update(const Rule& rule, tensor_state& t, const Index* idx,
                                  const Value* val, std::uint64_t count, Out* copy,
                                  copy_layout layout, Executor& ex) {
  const tensor_arrays a = arrays_of(t);
  std::atomic<std::uint64_t> updated{0};
  std::atomic<std::uint64_t> skipped{0};
  const auto n = static_cast<std::size_t>(count);
  for_each_chunk(ex, count, balanced_grain(count, ex.concurrency(), sparse_min_grain),
                 [&](std::uint64_t b, std::uint64_t e) {
                   const std::size_t jb = run_boundary(idx, n, static_cast<std::size_t>(b));
                   const std::size_t je = run_boundary(idx, n, static_cast<std::size_t>(e));
                   if (jb >= je) return;
                   const auto r = sparse_piece<Arch, PerElement>(rule, a, index_array<Index>{idx},
                                                                 val, jb, je, copy, layout);
                   updated.fetch_add(r.updated, std::memory_order_relaxed);
                   if (r.skipped != 0) skipped.fetch_add(r.skipped, std::memory_order_relaxed);
                 });
  return {updated.load(), skipped.load()};
}

}  // namespace stellatrain::detail

namespace stellatrain::detail {

// ------------------------------------------------------------------------------- whole steps
//
// Every function here takes the SIMD architecture as a template parameter, also where the
// code does not use it (the scalar sparse path): so that translation units compiled for
// different instruction sets (runtime dispatch) instantiate distinct functions and the linker
// never merges an AVX-512 copy into code that runs on an AVX2 machine.
//
// `Optimizer` provides: static `name`; `nonfinite()` and `step_mode()`; and
// `with_rule(step, f)`, which calls `f(rule)` with the update rule of step number `step`
// (a type chosen from the options, so the kernels compile without runtime option branches).

template <class Value>
[[noreturn]] void throw_nonfinite(const char* who, std::size_t tensor, std::uint64_t position,
                                  std::uint64_t index, float value, std::uint64_t count) {
  throw_error(errc::not_finite, std::string(who) + ": tensor " + std::to_string(tensor) +
                                    ": gradient at position " + std::to_string(position) +
                                    " (index " + std::to_string(index) + ") is " +
                                    describe_value(value) + " (" + std::to_string(count) +
                                    " non-finite values); nothing was updated");
}

template <class Arch, class Optimizer, class Grad, class Out, executor Executor>
step_report dense_step(Optimizer& opt, tensor_registry& registry, std::size_t tensor,
                       std::span<const Grad> g, Executor& ex, const param_copy<Out>& copy) {
  static_assert(value_type<Grad>, "gradients are float, fp16 or bf16");
  tensor_state& t = registry.at(tensor, Optimizer::name);
  check_dense_arguments<Grad>(Optimizer::name, tensor, t, g.size(), copy);
  const nonfinite_policy policy = opt.nonfinite();
  if (policy != nonfinite_policy::skip_elements) {
    std::uint64_t first = no_element;
    const std::uint64_t bad = dense_nonfinite_check<Arch>(g, ex, first);
    if (bad != 0) {
      if (policy == nonfinite_policy::raise) {
        throw_nonfinite<Grad>(Optimizer::name, tensor, first, first, to_float(g[first]), bad);
      }
      return {.applied = false, .updated = 0, .nonfinite = bad};
    }
  }
  const std::uint64_t step = ++t.step;
  Out* out = copy.values.empty() ? nullptr : copy.values.data();
  const bool per_element = opt.step_mode() == step_count::per_element;
  std::uint64_t skipped = 0;
  opt.with_rule(step, [&](const auto& rule) {
    if (per_element) {
      skipped = dense_update_per_element<Arch>(rule, t, g.data(), out, ex);
    } else {
      skipped = dense_update<Arch>(rule, t, g.data(), out, ex);
    }
  });
  return {.applied = true, .updated = t.size - skipped, .nonfinite = skipped};
}

template <class Arch, class Optimizer, class Value, class Index, class Out, executor Executor>
step_report sparse_step(Optimizer& opt, tensor_registry& registry, std::size_t tensor,
                        const sparse_view<const Value, const Index>& g, Executor& ex,
                        const param_copy<Out>& copy) {
  tensor_state& t = registry.at(tensor, Optimizer::name);
  check_sparse_arguments(Optimizer::name, tensor, t, g.size(), g.dense_size(), copy);
  const nonfinite_policy policy = opt.nonfinite();
  const Index* idx = g.indices().data();
  const Value* val = g.values().data();
  const bool precheck_finite = policy != nonfinite_policy::skip_elements;
  const sparse_check_result check =
      sparse_check<Arch>(idx, val, g.size(), t.size, precheck_finite, ex);
  if (check.bad_order != no_element || check.out_of_range != no_element) [[unlikely]] {
    throw_sparse_index_error<Value>(Optimizer::name, tensor, check, idx, t.size);
  }
  if (check.nonfinite != 0) {
    if (policy == nonfinite_policy::raise) {
      const std::uint64_t j = check.first_nonfinite;
      float s = 0.0f;
      for (std::uint64_t r = j; r < g.size() && idx[r] == idx[j]; ++r) s += to_float(val[r]);
      throw_nonfinite<Value>(Optimizer::name, tensor, j, idx[j], s, check.nonfinite);
    }
    return {.applied = false, .updated = 0, .nonfinite = check.nonfinite};
  }
  const std::uint64_t step = ++t.step;
  Out* out = copy.values.empty() ? nullptr : copy.values.data();
  const bool per_element = opt.step_mode() == step_count::per_element;
  sparse_piece_result r;
  opt.with_rule(step, [&](const auto& rule) {
    if (per_element) {
      r = sparse_update<Arch, true>(rule, t, idx, val, g.size(), out, copy.layout, ex);
    } else {
      r = sparse_update<Arch, false>(rule, t, idx, val, g.size(), out, copy.layout, ex);
    }
  });
  return {.applied = true, .updated = r.updated, .nonfinite = r.skipped};
}

}  // namespace stellatrain::detail
