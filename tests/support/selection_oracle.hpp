// SPDX-License-Identifier: Apache-2.0
// The scalar reference of magnitude selection that every CPU and GPU selector is tested
// against. Semantics (shared by all selectors):
//  - elements rank by the bit pattern of |x| read as an unsigned integer: +0 == -0, +inf
//    above every finite value, NaN above +inf (a NaN with a larger payload above a smaller);
//  - exactly min(k, n) elements are selected; ties at the threshold go to the lowest indices;
//  - the output lists the selected indices strictly ascending with the input values there.
#pragma once

#include <stellatrain/core/float16.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <numeric>
#include <span>
#include <type_traits>
#include <vector>

namespace stellatrain::test {

/// The ranking key of a value: its magnitude's bit pattern (sign bit cleared).
inline std::uint32_t magnitude_key(float x) {
  return std::bit_cast<std::uint32_t>(x) & 0x7fffffffu;
}
inline std::uint32_t magnitude_key(fp16 x) { return x.bits() & 0x7fffu; }
inline std::uint32_t magnitude_key(bf16 x) { return x.bits() & 0x7fffu; }

/// Indices (ascending) of the top min(k, n) elements of `x` by magnitude key, ties to the
/// lowest index. O(n log n); for tests only.
template <class T>
std::vector<std::uint64_t> reference_topk_indices(std::span<const T> x, std::uint64_t k) {
  std::vector<std::uint64_t> order(x.size());
  std::iota(order.begin(), order.end(), std::uint64_t{0});
  const auto kk = static_cast<std::size_t>(std::min<std::uint64_t>(k, x.size()));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kk), order.end(),
                    [&](std::uint64_t a, std::uint64_t b) {
                      const auto ka = magnitude_key(x[a]);
                      const auto kb = magnitude_key(x[b]);
                      return ka != kb ? ka > kb : a < b;
                    });
  order.resize(kk);
  std::sort(order.begin(), order.end());
  return order;
}

/// Sum of squares of the selected elements over the sum of squares of all (1 for an all-zero
/// input): the "energy" a selection keeps.
template <class T, class Index>
double energy_fraction(std::span<const T> x, std::span<const Index> selected) {
  auto sq = [](T v) {
    const double d = static_cast<double>(to_float(v));
    return d * d;
  };
  double total = 0;
  for (const T& v : x) total += sq(v);
  double kept = 0;
  for (Index i : selected) kept += sq(x[static_cast<std::size_t>(i)]);
  return total == 0 ? 1.0 : kept / total;
}

}  // namespace stellatrain::test
