// SPDX-License-Identifier: Apache-2.0
// The checks of one section header of a received message (docs/wire-format.md, "What a
// reader checks", 4), before any payload is read: its fields against each other, against the
// encodings and against the bytes left in the message. What depends on the receiver (the
// registered tensors, repeated tensors or control types) is checked by the unpacker.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/pack/detail/chunked_payload.hpp>
#include <stellatrain/pack/detail/unpack_error.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace stellatrain::detail {

/// The fields of one section header as the wire holds them.
struct wire_section_header {
  std::uint32_t id = 0;  // the tensor, or the type of a control section
  std::uint8_t index_id = 0;
  std::uint8_t value_id = 0;
  std::uint16_t kind = 0;
  std::uint64_t dense_size = 0;
  std::uint64_t count = 0;
  std::uint64_t index_bytes = 0;  // of a control section: its payload
  std::uint64_t value_bytes = 0;

  [[nodiscard]] static wire_section_header read(const std::byte* h) noexcept {
    wire_section_header s;
    s.id = load_le<std::uint32_t>(h + wire::offset_tensor);
    s.index_id = std::to_integer<std::uint8_t>(h[wire::offset_index_encoding]);
    s.value_id = std::to_integer<std::uint8_t>(h[wire::offset_value_encoding]);
    s.kind = load_le<std::uint16_t>(h + wire::offset_section_kind);
    s.dense_size = load_le<std::uint64_t>(h + wire::offset_dense_size);
    s.count = load_le<std::uint64_t>(h + wire::offset_count);
    s.index_bytes = load_le<std::uint64_t>(h + wire::offset_index_bytes);
    s.value_bytes = load_le<std::uint64_t>(h + wire::offset_value_bytes);
    return s;
  }
};

/// Checks that `count` section headers fit in the message and that the receiver can take them
/// (`registered` tensors, plus the control sections a message may hold). Both are faults of
/// the message, not of the caller, so both are `malformed_message`.
inline void check_section_count(std::uint64_t count, std::uint64_t message_bytes,
                                std::uint64_t registered) {
  const std::uint64_t body = message_bytes - wire::message_trailer_bytes;
  if (count > (body - wire::message_header_bytes) / wire::section_header_bytes) {
    fail_unpack(errc::malformed_message, std::to_string(count) + " sections cannot fit in " +
                                             std::to_string(message_bytes) + " bytes");
  }
  if (count > registered + wire::max_control_sections) {
    fail_unpack(errc::malformed_message,
                std::to_string(count) + " sections, but only " + std::to_string(registered) +
                    " tensors are registered (and " + std::to_string(wire::max_control_sections) +
                    " control sections allowed)");
  }
}

/// Checks a control section's header: no encodings, size, count or values, and a payload
/// inside the `room` bytes that follow the header. `what()` names the section.
template <class What>
void check_control_header(const wire_section_header& s, std::uint64_t room, const What& what) {
  if (s.index_id != 0 || s.value_id != 0 || s.dense_size != 0 || s.count != 0 ||
      s.value_bytes != 0) {
    fail_unpack(errc::malformed_message,
                what() + ": a control section has no encodings, size, count or values");
  }
  if (s.index_bytes > room) {
    fail_unpack(errc::malformed_message, what() + ": payload of " + std::to_string(s.index_bytes) +
                                             " bytes runs past the end of the message (" +
                                             std::to_string(room) + " bytes left)");
  }
}

/// Checks that the index payload's size fits its encoding, k indices and a tensor of n
/// elements (`s.index_id` is a known encoding).
template <class What>
void check_index_bytes(const wire_section_header& s, const What& what) {
  const auto encoding = static_cast<index_encoding>(s.index_id);
  const std::uint64_t k = s.count;
  const std::uint64_t n = s.dense_size;
  auto expect = [&](std::uint64_t width) {
    if (s.index_bytes % width != 0 || s.index_bytes / width != k) {
      fail_unpack(errc::malformed_message, what() + ": " + std::string(name_of(encoding)) +
                                               " payload of " + std::to_string(s.index_bytes) +
                                               " bytes for " + std::to_string(k) + " indices");
    }
  };
  switch (encoding) {
    case index_encoding::raw_u16:
      if (n > 65536)
        fail_unpack(errc::malformed_message, what() + ": raw_u16 indices for a tensor of " +
                                                 std::to_string(n) + " elements");
      expect(2);
      return;
    case index_encoding::raw_u32:
      if (n > (std::uint64_t{1} << 32)) {
        fail_unpack(errc::malformed_message, what() + ": raw_u32 indices for a tensor of " +
                                                 std::to_string(n) + " elements");
      }
      expect(4);
      return;
    case index_encoding::raw_u64:
      expect(8);
      return;
    case index_encoding::bitmap:
      if (s.index_bytes != wire::bitmap_bytes(n)) {
        fail_unpack(errc::malformed_message,
                    what() + ": bitmap of " + std::to_string(s.index_bytes) +
                        " bytes for a tensor of " + std::to_string(n) + " elements");
      }
      return;
    case index_encoding::random_k:
      if (s.index_bytes != wire::random_k_payload_bytes) {
        fail_unpack(errc::malformed_message, what() + ": random_k payload of " +
                                                 std::to_string(s.index_bytes) + " bytes, not 16");
      }
      return;
    case index_encoding::delta_varint:
    case index_encoding::delta_bitpacked:
      // At least the directory and one byte (varint) or one block header per chunk.
      if (k == 0 ? s.index_bytes != 0
                 : s.index_bytes < wire::directory_bytes(k) + wire::chunk_count(k) ||
                       s.index_bytes - wire::directory_bytes(k) >
                           10 * k + wire::block_header_bytes * k) {
        fail_unpack(errc::malformed_message, what() + ": " + std::string(name_of(encoding)) +
                                                 " payload of " + std::to_string(s.index_bytes) +
                                                 " bytes cannot hold " + std::to_string(k) +
                                                 " indices");
      }
      return;
    case index_encoding::chunked_topk:
      // The rest once the prefix can be read: check_chunked_sizes.
      if (s.index_bytes < wire::chunked_prefix_bytes) {
        fail_unpack(errc::malformed_message, what() + ": chunked_topk payload of " +
                                                 std::to_string(s.index_bytes) +
                                                 " bytes has no room for its prefix");
      }
      return;
    case index_encoding::automatic:
      return;
  }
}

/// Whether `v` is a value encoding of chunked sections.
[[nodiscard]] constexpr bool is_chunked(value_encoding v) noexcept {
  return v == value_encoding::chunk_sign || v == value_encoding::chunk_2bit;
}

/// Checks a tensor section's header whose tensor the receiver expects: known encodings, no
/// more pairs than elements, payload sizes that fit the encodings and the count, and payloads
/// inside the `room` bytes that follow the header. `what()` names the section.
/// In a message of format version `version`.
template <class What>
void check_tensor_header(const wire_section_header& s, std::uint64_t room, std::uint16_t version,
                         const What& what) {
  const bool v3 = version >= 3;  // the chunked encodings
  const auto last_index = v3 ? index_encoding::chunked_topk : index_encoding::random_k;
  const auto last_value = v3 ? value_encoding::chunk_2bit : value_encoding::bf16;
  if (s.index_id < 1 || s.index_id > static_cast<std::uint8_t>(last_index)) {
    fail_unpack(errc::malformed_message, what() + ": unknown index encoding " +
                                             std::to_string(s.index_id) + " in version " +
                                             std::to_string(version));
  }
  if (s.value_id < 1 || s.value_id > static_cast<std::uint8_t>(last_value)) {
    fail_unpack(errc::malformed_message, what() + ": unknown value encoding " +
                                             std::to_string(s.value_id) + " in version " +
                                             std::to_string(version));
  }
  if (s.count > s.dense_size) {
    fail_unpack(errc::malformed_message, what() + ": " + std::to_string(s.count) +
                                             " pairs in a tensor of " +
                                             std::to_string(s.dense_size) + " elements");
  }
  const auto values = static_cast<value_encoding>(s.value_id);
  const bool chunked_indices =
      s.index_id == static_cast<std::uint8_t>(index_encoding::chunked_topk);
  if (chunked_indices != is_chunked(values)) {
    fail_unpack(
        errc::malformed_message,
        what() + ": " + std::string(name_of(static_cast<index_encoding>(s.index_id))) +
            " indices with " + std::string(name_of(values)) +
            " values (chunked_topk goes with chunk_sign or chunk_2bit, and only with them)");
  }
  const std::uint64_t vb = chunked_indices ? 1 : value_bytes(values);
  if (!chunked_indices && (s.value_bytes % vb != 0 || s.value_bytes / vb != s.count)) {
    fail_unpack(errc::malformed_message,
                what() + ": value payload of " + std::to_string(s.value_bytes) + " bytes for " +
                    std::to_string(s.count) + " " + std::string(name_of(values)) + " values");
  }
  check_index_bytes(s, what);
  if (s.index_bytes > room || s.value_bytes > room - s.index_bytes) {
    fail_unpack(errc::malformed_message, what() + ": payloads of " + std::to_string(s.index_bytes) +
                                             " + " + std::to_string(s.value_bytes) +
                                             " bytes run past the end of the message (" +
                                             std::to_string(room) + " bytes left)");
  }
}

/// Checks a chunked section's prefix (`payload`: its index payload, inside the message) and
/// its sizes against the header; returns the prefix.
template <class What>
chunked_prefix check_chunked_sizes(const wire_section_header& s, const std::byte* payload,
                                   const What& what) {
  const chunked_prefix p = chunked_prefix::read(payload);
  if (p.chunk_bits < 1 || p.chunk_bits > 16 || p.reserved != 0) {
    fail_unpack(errc::malformed_message,
                what() + ": chunked_topk prefix: b = " + std::to_string(p.chunk_bits) +
                    " (1 to 16) and reserved bytes " + (p.reserved != 0 ? "set" : "zero"));
  }
  if (p.k < 1 || p.k > (std::uint64_t{1} << p.chunk_bits)) {
    fail_unpack(errc::malformed_message, what() +
                                             ": chunked_topk prefix: k = " + std::to_string(p.k) +
                                             " for chunks of 2^" + std::to_string(p.chunk_bits));
  }
  if (s.dense_size > wire::max_chunked_elements) {
    fail_unpack(errc::malformed_message, what() + ": a chunked section of a tensor of " +
                                             std::to_string(s.dense_size) +
                                             " elements (at most 2^56)");
  }
  const unsigned code_bits = code_bits_of(static_cast<value_encoding>(s.value_id));
  const wire::chunked_shape shape =
      wire::chunked_shape_of(s.dense_size, p.chunk_bits, p.k, code_bits);
  if (s.count != shape.count || s.index_bytes != shape.index_bytes ||
      s.value_bytes != shape.value_bytes) {
    fail_unpack(errc::malformed_message,
                what() + ": " + std::to_string(s.count) + " pairs in " +
                    std::to_string(s.index_bytes) + " + " + std::to_string(s.value_bytes) +
                    " bytes, but " + std::to_string(p.k) + " of every 2^" +
                    std::to_string(p.chunk_bits) + " elements of " + std::to_string(s.dense_size) +
                    " are " + std::to_string(shape.count) + " pairs in " +
                    std::to_string(shape.index_bytes) + " + " + std::to_string(shape.value_bytes) +
                    " bytes");
  }
  return p;
}

/// The key of a random_k section, from the start of its index payload.
[[nodiscard]] inline random_key read_random_key(const std::byte* payload) noexcept {
  random_key key;
  key.seed = load_le<std::uint64_t>(payload);
  key.step = load_le<std::uint32_t>(payload + 8);
  key.tensor = load_le<std::uint32_t>(payload + 12);
  return key;
}

}  // namespace stellatrain::detail
