// SPDX-License-Identifier: Apache-2.0
// Joins the CRC-32C values of consecutive byte ranges, so that a message can be checksummed on
// several threads: crc(A || B) = crc(A) * x^(8 |B|) mod P  xor  crc(B).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/executor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace stellatrain::detail {

// GF(2) arithmetic modulo the Castagnoli polynomial, bit-reflected (bit 31 = coefficient of
// x^0), the representation CRC-32C registers use.
constexpr std::uint32_t crc32c_gf2_multiply(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return product;
}

// x^(8 * 2^i) mod P for i = 0..63: the operators "append 2^i zero bytes".
struct crc32c_zero_powers {
  std::uint32_t power[64];
};

constexpr crc32c_zero_powers make_crc32c_zero_powers() noexcept {
  crc32c_zero_powers t{};
  t.power[0] = 0x00800000u;  // x^8
  for (int i = 1; i < 64; ++i) t.power[i] = crc32c_gf2_multiply(t.power[i - 1], t.power[i - 1]);
  return t;
}

inline constexpr crc32c_zero_powers crc32c_zero_power_table = make_crc32c_zero_powers();

/// The CRC-32C of A followed by B, from crc(A), crc(B) and the length of B in bytes.
/// O(log length) GF(2) multiplications (about a microsecond for megabytes).
[[nodiscard]] constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                                                     std::uint64_t length_b) noexcept {
  std::uint32_t r = crc_a;
  for (int i = 0; length_b != 0; ++i, length_b >>= 1) {
    if (length_b & 1u) r = crc32c_gf2_multiply(crc32c_zero_power_table.power[i], r);
  }
  return r ^ crc_b;
}

// Pieces below this size are checksummed on one thread: the hand-off would cost more.
inline constexpr std::size_t crc32c_parallel_grain = std::size_t{256} << 10;

/// crc32c(data) computed in up to ex.concurrency() (at most 16) pieces in parallel.
template <executor Executor>
[[nodiscard]] std::uint32_t crc32c_parallel(std::span<const std::byte> data, Executor& ex) {
  const std::size_t pieces =
      std::clamp<std::size_t>(std::min<std::size_t>(ex.concurrency(), data.size() / crc32c_parallel_grain), 1, 16);
  if (pieces == 1) return crc32c(data);
  std::array<std::uint32_t, 16> part{};
  const std::size_t piece = (data.size() + pieces - 1) / pieces;
  ex.bulk(pieces, [&](std::size_t i) {
    const std::size_t begin = std::min(data.size(), i * piece);
    part[i] = crc32c(data.subspan(begin, std::min(piece, data.size() - begin)));
  });
  std::uint32_t crc = part[0];
  for (std::size_t i = 1; i < pieces; ++i) {
    const std::size_t begin = std::min(data.size(), i * piece);
    crc = crc32c_combine(crc, part[i], std::min(piece, data.size() - begin));
  }
  return crc;
}

}  // namespace stellatrain::detail
