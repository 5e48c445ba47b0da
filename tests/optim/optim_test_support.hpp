// SPDX-License-Identifier: Apache-2.0
// Inputs and small helpers shared by the optimizer tests.
#pragma once

#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>

#include "catch.hpp"

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace optim_test {

inline constexpr std::size_t simd_width = xsimd::batch<float>::size;

// Sizes every dense test runs: empty, one, around the SIMD width, odd tails.
inline std::vector<std::size_t> dense_sizes() {
  return {0, 1, simd_width - 1, simd_width, simd_width + 1, 2 * simd_width + 3, 37, 1003};
}

inline std::vector<float> normal(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// `count` distinct sorted indices below `n`.
template <class Index = std::uint32_t>
std::vector<Index> sorted_indices(std::size_t n, std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Index> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<Index>(i);
  count = std::min(count, n);
  for (std::size_t i = 0; i < count; ++i) {
    std::uniform_int_distribution<std::size_t> pick(i, n - 1);
    std::swap(all[i], all[pick(rng)]);
  }
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}
inline bool same_bits(const std::vector<float>& a, std::span<const float> b) {
  return same_bits(std::span<const float>(a), b);
}

template <class F>
std::string error_message(F&& f, stellatrain::errc expected) {
  try {
    f();
  } catch (const stellatrain::error& e) {
    CHECK(e.code() == expected);
    return e.what();
  }
  FAIL("no stellatrain::error thrown");
  return {};
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace optim_test
