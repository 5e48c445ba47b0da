// SPDX-License-Identifier: Apache-2.0
// Vocabulary shared by the CPU selectors: the ranking rule, what a call reports, argument
// checks, and the `selector` concept.
//
// Semantics shared by every selector (CPU and GPU):
//  - Elements rank by the bit pattern of |x| read as an unsigned integer (the "magnitude
//    key"): +0 == -0, +inf ranks above every finite value, a NaN ranks above +inf (a NaN with a
//    larger payload above a smaller one). NaNs are therefore selected first; stages after the
//    selection (the optimizer) apply their own policy for non-finite values.
//  - Exactly min(k, n) elements are returned, indices strictly ascending, values copied from
//    the input at those indices (bit for bit, sign included).
//  - Exact selectors return the k largest keys; ties at the k-th key go to the lowest indices,
//    so every rank and every run agrees. Approximate selectors (threshold when it must fill,
//    sampled threshold when its estimate is off, block, random) still return exactly min(k, n)
//    distinct elements and say whether the set is exact.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/detail/simd_lanes.hpp>

#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

namespace stellatrain {

/// What one selection call did.
struct selection_stats {
  std::uint64_t count = 0;  ///< elements written: min(k, n)
  bool exact = true;        ///< the set is exactly the top min(k, n) by magnitude key
  int passes = 0;           ///< full passes over the input (1: it was read once)
  bool fallback = false;    ///< the sampled or persistent bound failed and full radix passes ran
  bool deficit = false;     ///< the band held fewer than k elements: lowest-index ones filled in
};

namespace detail {

// Checks the arguments every selector takes; throws `error` naming `who`.
template <class Index>
void check_selection_args(const char* who, std::uint64_t n, std::uint64_t k, std::size_t indices,
                          std::size_t values, std::uint64_t index_base) {
  const std::uint64_t m = k < n ? k : n;
  if (indices < m || values < m) {
    throw_error(errc::invalid_argument, std::string(who) + ": output holds " + std::to_string(indices) +
                                            " indices and " + std::to_string(values) + " values, " +
                                            std::to_string(m) + " needed");
  }
  if (n == 0) return;
  constexpr std::uint64_t max_index = std::numeric_limits<Index>::max();
  if (n - 1 > max_index || index_base > max_index - (n - 1)) {
    throw_error(errc::out_of_range, std::string(who) + ": indices up to " + std::to_string(index_base) +
                                        " + " + std::to_string(n - 1) + " do not fit a " +
                                        std::to_string(8 * sizeof(Index)) + "-bit index");
  }
}

// Writes every element (k >= n): indices base..base+n-1, values copied.
template <executor Ex, class T, class Index>
void select_all(Ex& ex, std::span<const T> x, std::span<Index> indices, std::span<T> values,
                std::uint64_t index_base) {
  for_each_chunk(ex, x.size(), std::uint64_t{1} << 16, [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t i = b; i < e; ++i) {
      indices[i] = static_cast<Index>(index_base + i);
      values[i] = x[i];
    }
  });
}

}  // namespace detail

/// A selector without per-tensor state: `select(ex, x, k, indices, values, index_base)`
/// writes min(k, n) (index, value) pairs of `x` (n = x.size()) to the front of `indices` and
/// `values`, with index_base added to every index (so a slice of a larger tensor reports
/// indices into the whole tensor), and returns `selection_stats`. Models:
/// `exact_topk_selector`, `sampled_threshold_selector`, `block_topk_selector`.
template <class S>
concept selector = requires(S& s, inline_executor& ex, std::span<const float> x, std::uint64_t k,
                            std::span<std::uint32_t> indices, std::span<float> values,
                            std::uint64_t index_base) {
  { s.select(ex, x, k, indices, values, index_base) } -> std::convertible_to<selection_stats>;
};

}  // namespace stellatrain
