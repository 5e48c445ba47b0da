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

/// The CRC-32C of A followed by B, from crc(A), crc(B) and `crc32c_zeros_operator(|B|)`: one
/// GF(2) multiplication, so that a thread that checksums B can also compute the operator.
[[nodiscard]] constexpr std::uint32_t crc32c_append(std::uint32_t crc_a, std::uint32_t crc_b,
                                                    std::uint32_t append_operator) noexcept {
  return crc32c_multiply(append_operator, crc_a) ^ crc_b;
}

/// The CRC-32C of A followed by B, from crc(A), crc(B) and the length of B in bytes.
[[nodiscard]] constexpr std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b,
                                                     std::uint64_t length_b) noexcept {
  return crc32c_append(crc_a, crc_b, crc32c_zeros_operator(length_b));
}

/// The checksum of one byte range computed on a worker, ready to be appended in order.
struct crc32c_piece {
  std::uint32_t crc = 0;                        ///< crc32c of the range (0 for an empty one)
  std::uint32_t append_operator = 0x80000000u;  ///< crc32c_zeros_operator of its length

  static crc32c_piece of(std::span<const std::byte> bytes) noexcept {
    return {crc32c(bytes), crc32c_zeros_operator(bytes.size())};
  }
  /// `running` followed by this range.
  [[nodiscard]] std::uint32_t after(std::uint32_t running) const noexcept {
    return crc32c_append(running, crc, append_operator);
  }
};

// Pieces below this size are checksummed on one thread: the hand-off would cost more.
inline constexpr std::size_t crc32c_parallel_grain = std::size_t{256} << 10;

/// How a byte range is cut for checksumming on `concurrency` threads: up to that many (at most
/// 16) equal pieces of at least `crc32c_parallel_grain` bytes, one piece when it is smaller.
struct crc32c_split {
  std::size_t pieces = 1;
  std::size_t piece_bytes = 0;

  crc32c_split(std::size_t bytes, std::size_t concurrency) noexcept
      : pieces(
            std::clamp<std::size_t>(std::min(concurrency, bytes / crc32c_parallel_grain), 1, 16)),
        piece_bytes((bytes + pieces - 1) / pieces) {}

  /// Piece i of `data` (the range that was split).
  [[nodiscard]] std::span<const std::byte> piece(std::span<const std::byte> data,
                                                 std::size_t i) const noexcept {
    const std::size_t begin = std::min(data.size(), i * piece_bytes);
    return data.subspan(begin, std::min(piece_bytes, data.size() - begin));
  }
};

/// The CRC-32C of consecutive pieces, from their checksums in order.
[[nodiscard]] inline std::uint32_t crc32c_join(std::span<const crc32c_piece> pieces) noexcept {
  std::uint32_t crc = 0;  // the CRC of no bytes
  for (const auto& p : pieces) crc = p.after(crc);
  return crc;
}

/// crc32c(data) computed in the pieces of `crc32c_split(data.size(), ex.concurrency())` in
/// parallel.
template <executor Executor>
[[nodiscard]] std::uint32_t crc32c_parallel(std::span<const std::byte> data, Executor& ex) {
  const crc32c_split split(data.size(), ex.concurrency());
  if (split.pieces == 1) return crc32c(data);
  std::array<crc32c_piece, 16> part{};
  ex.bulk(split.pieces, [&](std::size_t i) { part[i] = crc32c_piece::of(split.piece(data, i)); });
  return crc32c_join(std::span<const crc32c_piece>(part.data(), split.pieces));
}

}  // namespace stellatrain::detail
