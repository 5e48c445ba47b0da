// SPDX-License-Identifier: Apache-2.0
// The tables of `message_packer`: one entry per tensor section (the added views, type-erased,
// and what `prepare` decides for them), per chunk of indices and per control section; the
// dispatch from an entry back to typed pointers; and the writer of a piece of a bitmap.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace stellatrain::detail {

/// A tensor section: the added views, type-erased, and what `prepare` decides for them.
struct packer_section {
  std::uint32_t tensor = 0;
  std::uint64_t dense_size = 0;
  std::uint64_t count = 0;
  const void* indices = nullptr;  // null for random_k
  bool wide = false;              // 64-bit indices
  const void* values = nullptr;
  value_encoding source = value_encoding::fp32;  // C++ type of the values
  value_encoding wire_values = value_encoding::fp32;
  index_encoding requested = index_encoding::automatic;
  index_encoding chosen = index_encoding::automatic;
  random_key key{};
  chunked_section chunked{};  // of a chunked_topk section
  wire::chunked_shape shape{};
  std::uint64_t value_bytes = 0;  // of its value payload
  std::uint64_t first_chunk = 0;  // into the chunk table
  std::uint64_t chunks = 0;
  std::uint64_t scratch_offset = 0;  // of its delta_bitpacked chunks, if encoded
  std::uint64_t index_bytes = 0;
  std::uint64_t offset = 0;  // of the section header in the message
};

/// A chunk of a section's indices: what its checks and encodings found, and where it goes.
struct packer_chunk {
  std::uint64_t section = 0;
  std::uint64_t begin = 0;  // first element
  std::uint64_t count = 0;
  std::uint64_t bitpacked_bytes = 0;
  std::uint64_t varint_bytes = 0;
  std::uint64_t bad = no_position;  // first element (in the chunk) not above its predecessor
  bool out_of_range = false;        // the chunk's last index is not below the tensor size
  std::uint64_t data_offset = 0;    // of its bytes after the section's chunk directory
};

/// A control section: its type and payload.
struct packer_control {
  std::uint32_t type = 0;
  std::span<const std::byte> payload;
  std::uint64_t offset = 0;  // of the section header in the message
};

/// Calls `f` with the section's indices or values as typed pointers.
template <class F>
decltype(auto) with_indices(const packer_section& s, F&& f) {
  if (s.wide) return f(static_cast<const std::uint64_t*>(s.indices));
  return f(static_cast<const std::uint32_t*>(s.indices));
}

template <class F>
decltype(auto) with_values(const packer_section& s, F&& f) {
  switch (s.source) {
    case value_encoding::fp16:
      return f(static_cast<const fp16*>(s.values));
    case value_encoding::bf16:
      return f(static_cast<const bf16*>(s.values));
    case value_encoding::fp32:
    case value_encoding::chunk_sign:  // a chunked section has no typed values
    case value_encoding::chunk_2bit:
      break;
  }
  return f(static_cast<const float*>(s.values));
}

/// Writes piece `piece` (of `bitmap_piece_bytes`) of the bitmap of section `s` and returns its
/// bytes.
inline std::span<const std::byte> write_bitmap_piece(const packer_section& s, std::byte* bitmap,
                                                     std::uint64_t piece) {
  const std::uint64_t total = wire::bitmap_bytes(s.dense_size);
  const std::uint64_t first = piece * bitmap_piece_bytes;
  const std::uint64_t last = std::min(total, first + bitmap_piece_bytes);
  std::memset(bitmap + first, 0, static_cast<std::size_t>(last - first));
  with_indices(s, [&](const auto* idx) {
    const auto* end = idx + s.count;
    const auto* it = std::lower_bound(idx, end, first * 8);
    for (; it != end && static_cast<std::uint64_t>(*it) < last * 8; ++it) {
      const std::uint64_t x = *it;
      bitmap[x >> 3] |= static_cast<std::byte>(1u << (x & 7));
    }
  });
  return {bitmap + first, static_cast<std::size_t>(last - first)};
}

}  // namespace stellatrain::detail
