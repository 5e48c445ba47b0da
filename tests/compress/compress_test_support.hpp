// SPDX-License-Identifier: Apache-2.0
// Inputs shared by the compress tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace stellatrain::test {

/// n values from N(0, scale^2).
inline std::vector<float> gaussian(std::uint64_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = dist(rng);
  return x;
}

}  // namespace stellatrain::test
