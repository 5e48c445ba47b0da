// SPDX-License-Identifier: Apache-2.0
// The index payload of one tensor section of a received message, and how its work splits
// into tasks: delta payloads by the chunks of their directory, bitmaps in pieces. Shared by
// the payload checks of `parse` and by `decode`.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace stellatrain::detail {

/// The index payload of a section whose header was checked: `count` indices of a tensor of
/// `dense_size` elements in `bytes` bytes from `data`.
struct index_payload {
  index_encoding encoding = index_encoding::automatic;
  std::uint64_t count = 0;
  std::uint64_t dense_size = 0;
  std::uint64_t bytes = 0;
  const std::byte* data = nullptr;
};

/// Chunk c of a delta payload: its bytes [first, last) after the directory, its first index's
/// base and the next chunk's (the tensor size after the last chunk).
struct delta_chunk_span {
  std::uint64_t first, last, base, next_base;
};

/// Where chunk c of a delta payload lies, from the directory (checked by
/// `check_chunk_directory`).
[[nodiscard]] inline delta_chunk_span delta_chunk(const index_payload& p,
                                                  std::uint64_t c) noexcept {
  const std::uint64_t chunks = wire::chunk_count(p.count);
  const std::uint64_t data = p.bytes - wire::directory_bytes(p.count);
  auto entry_base = [&](std::uint64_t j) { return load_le<std::uint64_t>(p.data + (j - 1) * 16); };
  auto entry_offset = [&](std::uint64_t j) {
    return load_le<std::uint64_t>(p.data + (j - 1) * 16 + 8);
  };
  delta_chunk_span r;
  r.first = c == 0 ? 0 : entry_offset(c);
  r.last = c + 1 < chunks ? entry_offset(c + 1) : data;
  r.base = c == 0 ? 0 : entry_base(c);
  r.next_base = c + 1 < chunks ? entry_base(c + 1) : p.dense_size;
  return r;
}

/// Pieces of `bitmap_piece_bytes` of a bitmap payload, and the bytes of piece `piece`.
[[nodiscard]] inline std::uint64_t bitmap_pieces(const index_payload& p) noexcept {
  return (p.bytes + bitmap_piece_bytes - 1) / bitmap_piece_bytes;
}
[[nodiscard]] inline std::size_t bitmap_piece_size(const index_payload& p,
                                                   std::uint64_t piece) noexcept {
  return static_cast<std::size_t>(
      std::min(bitmap_piece_bytes, p.bytes - piece * bitmap_piece_bytes));
}

}  // namespace stellatrain::detail
