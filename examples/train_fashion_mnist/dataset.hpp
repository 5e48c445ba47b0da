// SPDX-License-Identifier: Apache-2.0
// One split of Fashion-MNIST in memory (fashion_mnist.hpp reads it from the IDX files).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fashion_mnist {

/// Where Debian's dataset-fashion-mnist package puts the files.
inline const char* default_directory = "/usr/share/datasets/fashion-mnist";

struct dataset {
  std::vector<float> images;  // count x 784, row-major, normalised (zero mean, unit variance)
  std::vector<std::uint8_t> labels;  // count, 0..9
  std::size_t count = 0;
  static constexpr std::size_t pixels = 28 * 28;
  static constexpr int classes = 10;
};

}  // namespace fashion_mnist
