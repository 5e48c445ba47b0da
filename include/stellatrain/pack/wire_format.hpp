// SPDX-License-Identifier: Apache-2.0
// The vocabulary of the gradient wire format: index and value encodings, section kinds, the
// fixed layout constants of version 2, and the little-endian field access every reader and
// writer uses.
// docs/wire-format.md describes the format byte by byte.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/float16.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

namespace stellatrain {

namespace detail {

// Little-endian fields at any (unaligned) address, on any host.
template <class T>
STELLATRAIN_FORCE_INLINE T load_le(const std::byte* p) noexcept {
  static_assert(std::is_unsigned_v<T>);
  T v;
  std::memcpy(&v, p, sizeof(T));
  if constexpr (std::endian::native == std::endian::big) {
    T r = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i)
      r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xffu));
    v = r;
  }
  return v;
}

template <class T>
STELLATRAIN_FORCE_INLINE void store_le(std::byte* p, T v) noexcept {
  static_assert(std::is_unsigned_v<T>);
  if constexpr (std::endian::native == std::endian::big) {
    T r = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i)
      r = static_cast<T>((r << 8) | ((v >> (8 * i)) & 0xffu));
    v = r;
  }
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace detail

/// How a section stores its indices on the wire (the byte value is the wire encoding id).
///
/// Every encoding carries indices that ascend strictly; `pack` checks this on the sender and
/// `parse` on the receiver. See docs/wire-format.md for the exact bytes.
enum class index_encoding : std::uint8_t {
  /// Sender only: pick the smallest encoding for this section (never on the wire).
  automatic = 0,
  raw_u16 = 1,          ///< 2 bytes per index; tensors of at most 65536 elements
  raw_u32 = 2,          ///< 4 bytes per index; tensors of at most 2^32 elements
  raw_u64 = 3,          ///< 8 bytes per index
  delta_varint = 4,     ///< gaps between indices as LEB128 varints, in chunks
  delta_bitpacked = 5,  ///< gaps bit-packed 256 at a time with patched exceptions, in chunks
  bitmap = 6,           ///< one bit per tensor element (dense selections)
  random_k = 7,         ///< no indices: the receiver regenerates them from a `random_key`
  /// The top k of every chunk of 2^b elements: b-bit chunk-local indices (format version 3,
  /// with the values `chunk_sign` or `chunk_2bit` only; see `chunked_section`).
  chunked_topk = 8,
};

/// How a section stores its values (the byte value is the wire id; fp32, fp16 and bf16 equal
/// the `dtype` tag).
enum class value_encoding : std::uint8_t {
  fp32 = 1,  ///< IEEE binary32, 4 bytes
  fp16 = 2,  ///< IEEE binary16, 2 bytes (rounded to nearest even when packing floats)
  bf16 = 3,  ///< bfloat16, 2 bytes (rounded to nearest even when packing floats)
  /// With `chunked_topk` indices only (version 3): one bf16 scale per chunk, then one sign
  /// bit per value; a value is +-scale.
  chunk_sign = 4,
  /// With `chunked_topk` indices only (version 3): a low and a high bf16 magnitude per chunk,
  /// then two bits per value (bit 0 the sign, bit 1 the high magnitude).
  chunk_2bit = 5,
};

/// Bytes per value of `e` on the wire; 0 for an id that is not a value encoding of a fixed
/// width (the chunked ones: `wire::chunked_shape_of`).
[[nodiscard]] constexpr std::size_t value_bytes(value_encoding e) noexcept {
  switch (e) {
    case value_encoding::fp32:
      return 4;
    case value_encoding::fp16:
    case value_encoding::bf16:
      return 2;
    case value_encoding::chunk_sign:
    case value_encoding::chunk_2bit:
      return 0;
  }
  return 0;
}

/// Bits per value code of a chunked value encoding: 2 for `chunk_2bit`, else 1 (`chunk_sign`).
[[nodiscard]] constexpr unsigned code_bits_of(value_encoding e) noexcept {
  return e == value_encoding::chunk_2bit ? 2 : 1;
}

/// The value encoding that stores `T` (float, fp16 or bf16) without conversion.
template <class T>
inline constexpr value_encoding value_encoding_of = static_cast<value_encoding>(dtype_of<T>);

/// Lower-case name of an index encoding ("delta_bitpacked", ...); "unknown" otherwise.
[[nodiscard]] constexpr std::string_view name_of(index_encoding e) noexcept {
  switch (e) {
    case index_encoding::automatic:
      return "automatic";
    case index_encoding::raw_u16:
      return "raw_u16";
    case index_encoding::raw_u32:
      return "raw_u32";
    case index_encoding::raw_u64:
      return "raw_u64";
    case index_encoding::delta_varint:
      return "delta_varint";
    case index_encoding::delta_bitpacked:
      return "delta_bitpacked";
    case index_encoding::bitmap:
      return "bitmap";
    case index_encoding::random_k:
      return "random_k";
    case index_encoding::chunked_topk:
      return "chunked_topk";
  }
  return "unknown";
}

/// Lower-case name of a value encoding ("fp32", "fp16", "bf16"); "unknown" otherwise.
[[nodiscard]] constexpr std::string_view name_of(value_encoding e) noexcept {
  switch (e) {
    case value_encoding::fp32:
      return "fp32";
    case value_encoding::fp16:
      return "fp16";
    case value_encoding::bf16:
      return "bf16";
    case value_encoding::chunk_sign:
      return "chunk_sign";
    case value_encoding::chunk_2bit:
      return "chunk_2bit";
  }
  return "unknown";
}

/// What a section carries (the 16-bit wire value at byte 6 of its header).
enum class section_kind : std::uint16_t {
  tensor = 0,   ///< the sparse selection of one tensor: indices and values
  control = 1,  ///< a typed payload for the receiving library or application, no tensor
};

/// Type ids of control sections (`message_packer::add_control`). The library uses the ids
/// below `first_application`; applications choose their own at or above it.
namespace control_type {
/// The pipeline's per-step measurement reports (docs/wire-format.md, "Step reports").
inline constexpr std::uint32_t step_reports = 1;
/// The first id free for applications.
inline constexpr std::uint32_t first_application = 0x10000;
}  // namespace control_type

/// Constants of wire format version 2 (docs/wire-format.md).
namespace wire {

/// The first four bytes of every message: "STPK".
inline constexpr std::array<std::byte, 4> magic = {std::byte{'S'}, std::byte{'T'}, std::byte{'P'},
                                                   std::byte{'K'}};
/// The newest format version this build writes and reads: version 3 is version 2 with the
/// chunked encodings. A message is written as version 2 unless it holds a chunked section, so
/// that a reader of version 2 reads every message it can.
inline constexpr std::uint16_t version = 3;
/// The oldest version this build reads.
inline constexpr std::uint16_t oldest_version = 2;
/// Bytes of the message header (magic .. tag).
inline constexpr std::size_t message_header_bytes = 32;
/// Bytes of the trailer (the CRC-32C of everything before it).
inline constexpr std::size_t message_trailer_bytes = 4;
/// Bytes of a section header (tensor id .. value payload bytes).
inline constexpr std::size_t section_header_bytes = 40;
/// Control sections one message may carry (each of another type).
inline constexpr std::size_t max_control_sections = 16;
/// Bytes of the index payload of a `random_k` section (seed, step, tensor key).
inline constexpr std::size_t random_k_payload_bytes = 16;
/// Indices per chunk of the delta encodings; chunks after the first are listed in a directory
/// so that they can be decoded independently (and on separate threads).
inline constexpr std::uint64_t chunk_elements = 16384;
/// Bytes of one chunk directory entry (base index, byte offset).
inline constexpr std::size_t directory_entry_bytes = 16;
/// Gaps per block of `delta_bitpacked` (the last block of a section may be shorter).
inline constexpr std::size_t block_elements = 256;
/// Bytes of a `delta_bitpacked` block header (bit width, exception count).
inline constexpr std::size_t block_header_bytes = 3;
/// Largest bit width of a `delta_bitpacked` block.
inline constexpr unsigned max_block_bits = 32;

// Field offsets in the message header.
inline constexpr std::size_t offset_magic = 0;
inline constexpr std::size_t offset_version = 4;
inline constexpr std::size_t offset_flags = 6;
inline constexpr std::size_t offset_section_count = 8;
inline constexpr std::size_t offset_header_bytes = 12;
inline constexpr std::size_t offset_message_bytes = 16;
/// The tag: unsigned, any 64-bit value; the reader carries it unchanged
/// (`message_info::tag`). The pipeline and the Python DDP hook write their step there, a
/// signed 64-bit count from 0, and read it back as one: the pipeline refuses a tag other than
/// the step it expects, the step-reports reader one at or above 2^63 (no step), as it refuses a
/// report's step at or above 2^63 (docs/wire-format.md, "The tag as a step").
inline constexpr std::size_t offset_tag = 24;

// Field offsets in a section header.
inline constexpr std::size_t offset_tensor = 0;
inline constexpr std::size_t offset_index_encoding = 4;
inline constexpr std::size_t offset_value_encoding = 5;
inline constexpr std::size_t offset_section_kind = 6;
inline constexpr std::size_t offset_dense_size = 8;
inline constexpr std::size_t offset_count = 16;
inline constexpr std::size_t offset_index_bytes = 24;
inline constexpr std::size_t offset_value_bytes = 32;

/// Number of chunks of a delta-encoded section of `count` indices.
[[nodiscard]] constexpr std::uint64_t chunk_count(std::uint64_t count) noexcept {
  return (count + chunk_elements - 1) / chunk_elements;
}

/// Bytes of the chunk directory of a delta-encoded section of `count` indices.
[[nodiscard]] constexpr std::uint64_t directory_bytes(std::uint64_t count) noexcept {
  const std::uint64_t chunks = chunk_count(count);
  return chunks <= 1 ? 0 : (chunks - 1) * directory_entry_bytes;
}

/// Bytes of a `bitmap` index payload for a tensor of `dense_size` elements.
[[nodiscard]] constexpr std::uint64_t bitmap_bytes(std::uint64_t dense_size) noexcept {
  return dense_size / 8 + (dense_size % 8 != 0 ? 1 : 0);
}

/// Bytes before the packed indices of a `chunked_topk` payload: b (1 byte), 3 zero bytes, k
/// (4 bytes).
inline constexpr std::size_t chunked_prefix_bytes = 8;
/// Largest tensor a chunked section holds (so that its sizes cannot overflow).
inline constexpr std::uint64_t max_chunked_elements = std::uint64_t{1} << 56;

/// The sizes of a chunked section of a tensor of `n` elements, chunks of 2^b elements, k
/// sent per chunk (every element of a shorter last chunk if it has fewer) and `code_bits`
/// (1 or 2) per value.
struct chunked_shape {
  std::uint64_t chunks = 0;       ///< ceil(n / 2^b)
  std::uint64_t count = 0;        ///< elements sent
  std::uint64_t index_bytes = 0;  ///< the prefix and count b-bit indices, to a whole byte
  std::uint64_t scale_bytes = 0;  ///< 2 bytes per scale, 1 or 2 scales per chunk
  std::uint64_t value_bytes = 0;  ///< the scales and count codes, to a whole byte
};

/// The sizes for parameters that are valid: 1 <= b <= 16, 1 <= k <= 2^b, code_bits 1 or 2,
/// n <= `max_chunked_elements`.
[[nodiscard]] constexpr chunked_shape chunked_shape_of(std::uint64_t n, unsigned b, std::uint64_t k,
                                                       unsigned code_bits) noexcept {
  chunked_shape s;
  const std::uint64_t full = n >> b;
  const std::uint64_t rest = n & ((std::uint64_t{1} << b) - 1);
  s.chunks = full + (rest != 0 ? 1 : 0);
  s.count = full * k + (rest < k ? rest : k);
  s.index_bytes = chunked_prefix_bytes + (s.count * b + 7) / 8;
  s.scale_bytes = 2 * code_bits * s.chunks;
  s.value_bytes = s.scale_bytes + (s.count * code_bits + 7) / 8;
  return s;
}

}  // namespace wire

/// A chunked section as its sender holds it (`message_packer::add_chunked`): the top k of
/// every chunk of 2^b elements of a tensor of `dense_size` elements, each chunk's indices
/// chunk-local and ascending, the chunks in order, and the values as codes of `code_bits` bits
/// packed from the lowest bit of each byte (bit 0 the sign, 1: negative; bit 1 with 2-bit codes:
/// the high magnitude) with per chunk one scale (1-bit codes) or a low and a high magnitude
/// (2-bit codes). `chunked_selection` (compress/chunked_codec.hpp) is one.
struct chunked_section {
  std::uint64_t dense_size = 0;
  unsigned chunk_bits = 12;
  std::uint32_t k = 64;
  unsigned code_bits = 2;
  std::span<const std::uint16_t> indices;
  std::span<const std::uint8_t> codes;
  std::span<const bf16> scales;
};

}  // namespace stellatrain
