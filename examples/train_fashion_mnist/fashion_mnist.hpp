// SPDX-License-Identifier: Apache-2.0
// Fashion-MNIST from the gzip-compressed IDX files that Debian's dataset-fashion-mnist package
// installs (read with zlib), as normalised float images and byte labels.
#pragma once

#include "dataset.hpp"

#include <stellatrain/core/error.hpp>

#include <zlib.h>

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace fashion_mnist {

namespace detail {

inline std::vector<std::uint8_t> read_gzip(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) {
    stellatrain::throw_error(stellatrain::errc::io_error,
                             path.string() +
                                 " not found: install Debian's dataset-fashion-mnist package "
                                 "(apt-get install dataset-fashion-mnist) or pass --data DIR");
  }
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    stellatrain::throw_error(stellatrain::errc::io_error, "cannot open " + path.string());
  std::vector<std::uint8_t> out;
  std::array<std::uint8_t, 1 << 16> chunk{};
  for (;;) {
    const int got = gzread(f, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (got < 0) {
      gzclose(f);
      stellatrain::throw_error(stellatrain::errc::io_error, "cannot decompress " + path.string());
    }
    if (got == 0) break;
    out.insert(out.end(), chunk.begin(), chunk.begin() + got);
  }
  gzclose(f);
  return out;
}

inline std::uint32_t big_endian_u32(const std::vector<std::uint8_t>& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) |
         (std::uint32_t{b[at + 2]} << 8) | std::uint32_t{b[at + 3]};
}

inline void require(bool ok, const std::filesystem::path& path, const std::string& what) {
  if (!ok)
    stellatrain::throw_error(stellatrain::errc::malformed_message, path.string() + ": " + what);
}

}  // namespace detail

/// Loads one split ("train" or "t10k") from `directory`. Pixels are scaled to [0, 1] and then
/// normalised with the training set's mean and standard deviation (0.2860, 0.3530).
inline dataset load(const std::filesystem::path& directory, const std::string& split) {
  const auto image_path = directory / (split + "-images-idx3-ubyte.gz");
  const auto label_path = directory / (split + "-labels-idx1-ubyte.gz");
  const auto images = detail::read_gzip(image_path);
  const auto labels = detail::read_gzip(label_path);
  detail::require(images.size() >= 16 && detail::big_endian_u32(images, 0) == 0x803, image_path,
                  "not an IDX image file");
  detail::require(labels.size() >= 8 && detail::big_endian_u32(labels, 0) == 0x801, label_path,
                  "not an IDX label file");
  const std::size_t n = detail::big_endian_u32(images, 4);
  detail::require(
      detail::big_endian_u32(images, 8) == 28 && detail::big_endian_u32(images, 12) == 28,
      image_path, "images are not 28x28");
  detail::require(images.size() == 16 + n * dataset::pixels, image_path, "truncated");
  detail::require(detail::big_endian_u32(labels, 4) == n && labels.size() == 8 + n, label_path,
                  "label count does not match the images");
  dataset d;
  d.count = n;
  d.images.resize(n * dataset::pixels);
  constexpr float mean = 0.2860f, stddev = 0.3530f;
  for (std::size_t i = 0; i < d.images.size(); ++i) {
    d.images[i] = (static_cast<float>(images[16 + i]) / 255.0f - mean) / stddev;
  }
  d.labels.assign(labels.begin() + 8, labels.end());
  for (auto l : d.labels) detail::require(l < dataset::classes, label_path, "label out of range");
  return d;
}

}  // namespace fashion_mnist
