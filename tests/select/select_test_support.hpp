// SPDX-License-Identifier: Apache-2.0
// Inputs and checks shared by the selection tests.
#pragma once

#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/selection.hpp>

#include "catch.hpp"
#include "selection_oracle.hpp"

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <tuple>
#include <vector>

namespace stellatrain::test {

/// The architectures every selector is checked on: the scalar oracle path, the portable SSE2
/// path (x86-64 baseline) and the build's default (AVX2 under -march=native).
#if XSIMD_WITH_SSE2
using test_archs = std::tuple<scalar_arch, xsimd::sse2, xsimd::default_arch>;
#else
using test_archs = std::tuple<scalar_arch, xsimd::default_arch>;
#endif

/// The bits of a value (so that values are compared bit for bit, NaN and sign included).
inline std::uint32_t raw_bits(float x) { return std::bit_cast<std::uint32_t>(x); }
inline std::uint32_t raw_bits(fp16 x) { return x.bits(); }
inline std::uint32_t raw_bits(bf16 x) { return x.bits(); }

/// n values from N(0, 1) converted to T.
template <class T = float>
std::vector<T> gaussian(std::uint64_t n, std::uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<T> x(n);
  for (auto& v : x) v = from_float<T>(dist(rng));
  return x;
}

/// Rows of 256 elements whose scale varies by row (a few rows carry most of the magnitude),
/// like the gradient of a weight matrix.
template <class T = float>
std::vector<T> row_correlated(std::uint64_t n, std::uint64_t seed = 2) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::lognormal_distribution<float> scale(0.0f, 1.5f);
  std::vector<T> x(n);
  float s = 1.0f;
  for (std::uint64_t i = 0; i < n; ++i) {
    if (i % 256 == 0) s = scale(rng);
    x[i] = from_float<T>(s * dist(rng));
  }
  return x;
}

/// Checks the shared properties: exactly min(k, n) entries, strictly ascending, in range,
/// values bit-equal to the input (after subtracting `base` from the indices).
template <class T, class Index>
void require_valid_selection(std::span<const T> x, std::uint64_t k, std::span<const Index> idx,
                             std::span<const T> val, std::uint64_t count, std::uint64_t base = 0) {
  REQUIRE(count == std::min<std::uint64_t>(k, x.size()));
  // One REQUIRE for the whole selection (a REQUIRE per element is slow); the first bad
  // position is reported.
  std::uint64_t bad = count;
  for (std::uint64_t j = 0; j < count && bad == count; ++j) {
    const bool in_range = idx[j] >= base && idx[j] - base < x.size();
    const bool ascending = j == 0 || idx[j - 1] < idx[j];
    if (!in_range || !ascending || raw_bits(val[j]) != raw_bits(x[idx[j] - base])) bad = j;
  }
  const std::uint64_t bad_index = bad < count ? static_cast<std::uint64_t>(idx[bad]) : 0;
  const std::uint64_t previous_index =
      bad < count && bad > 0 ? static_cast<std::uint64_t>(idx[bad - 1]) : 0;
  CAPTURE(bad, bad_index, previous_index);
  REQUIRE(bad == count);
}

/// Indices (minus `base`) as 64-bit values, for comparison with the oracle.
template <class Index>
std::vector<std::uint64_t> as_u64(std::span<const Index> idx, std::uint64_t count,
                                  std::uint64_t base = 0) {
  std::vector<std::uint64_t> v(count);
  for (std::uint64_t j = 0; j < count; ++j) v[j] = idx[j] - base;
  return v;
}

}  // namespace stellatrain::test
