// SPDX-License-Identifier: Apache-2.0
// The 32-byte frame header that the MPI and ZeroMQ backends put in front of every message,
// and the CRC32C that guards it. A receiver decodes and verifies the header before it trusts
// the length in it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace stellatrain::detail {

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), slice-by-8 tables built at compile
// time. Guards frame headers always and payloads on request; the packing layer has its own
// checksum over the message contents.
struct frame_crc_tables {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  constexpr frame_crc_tables() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) != 0 ? 0x82F63B78u : 0u);
      t[0][i] = c;
    }
    for (std::size_t s = 1; s < 8; ++s) {
      for (std::size_t i = 0; i < 256; ++i)
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
    }
  }
};

inline constexpr frame_crc_tables frame_crc_table{};

inline std::uint32_t frame_load_u32(const std::byte* p) noexcept {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}

inline std::uint64_t frame_load_u64(const std::byte* p) noexcept {
  return static_cast<std::uint64_t>(frame_load_u32(p)) |
         (static_cast<std::uint64_t>(frame_load_u32(p + 4)) << 32);
}

inline void frame_store_u32(std::byte* p, std::uint32_t v) noexcept {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}

inline void frame_store_u64(std::byte* p, std::uint64_t v) noexcept {
  frame_store_u32(p, static_cast<std::uint32_t>(v));
  frame_store_u32(p + 4, static_cast<std::uint32_t>(v >> 32));
}

// CRC32C of `bytes` continuing from `crc` (start with 0).
inline std::uint32_t frame_crc32c(std::span<const std::byte> bytes,
                                  std::uint32_t crc = 0) noexcept {
  const auto& t = frame_crc_table.t;
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  while (n >= 8) {
    const std::uint32_t lo = frame_load_u32(p) ^ c;
    const std::uint32_t hi = frame_load_u32(p + 4);
    c = t[7][lo & 0xFFu] ^ t[6][(lo >> 8) & 0xFFu] ^ t[5][(lo >> 16) & 0xFFu] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFu] ^ t[2][(hi >> 8) & 0xFFu] ^ t[1][(hi >> 16) & 0xFFu] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- != 0) c = (c >> 8) ^ t[0][(c ^ static_cast<std::uint32_t>(*p++)) & 0xFFu];
  return ~c;
}

// What a frame carries.
enum class frame_kind : std::uint8_t {
  data = 0,   // a message of the transport
  hello = 1,  // connection set-up: "I am rank `source` of `tag` ranks"
  bye = 2,    // orderly close: no more messages follow from `source`
  abort = 3,  // `source` failed; the payload is the reason (UTF-8)
};

inline constexpr std::uint32_t frame_magic = 0x46545453u;  // "STTF" little-endian
inline constexpr std::uint8_t frame_version = 1;
inline constexpr std::size_t frame_header_bytes = 32;
inline constexpr std::uint16_t frame_flag_payload_crc = 1;

// Byte layout (little-endian):
//   0 u32 magic  4 u8 version  5 u8 kind  6 u16 flags  8 u32 source rank  12 u32 tag
//  16 u64 payload length  24 u32 payload CRC32C (0 without the flag)  28 u32 CRC32C of 0..27
struct frame_header {
  frame_kind kind = frame_kind::data;
  std::uint16_t flags = 0;
  std::uint32_t source = 0;
  std::uint32_t tag = 0;
  std::uint64_t length = 0;
  std::uint32_t payload_crc = 0;
};

using frame_bytes = std::array<std::byte, frame_header_bytes>;

inline void encode_frame(const frame_header& h,
                         std::span<std::byte, frame_header_bytes> out) noexcept {
  std::byte* p = out.data();
  frame_store_u32(p, frame_magic);
  p[4] = static_cast<std::byte>(frame_version);
  p[5] = static_cast<std::byte>(h.kind);
  p[6] = static_cast<std::byte>(h.flags & 0xFFu);
  p[7] = static_cast<std::byte>(h.flags >> 8);
  frame_store_u32(p + 8, h.source);
  frame_store_u32(p + 12, h.tag);
  frame_store_u64(p + 16, h.length);
  frame_store_u32(p + 24, h.payload_crc);
  frame_store_u32(p + 28, frame_crc32c(std::span<const std::byte>(p, 28)));
}

// A data header for `payload` from `source` with `tag`; the payload CRC when `with_crc`.
inline frame_header data_frame(std::uint32_t source, std::uint32_t tag,
                               std::span<const std::byte> payload, bool with_crc) noexcept {
  frame_header h;
  h.source = source;
  h.tag = tag;
  h.length = payload.size();
  if (with_crc) {
    h.flags = frame_flag_payload_crc;
    h.payload_crc = frame_crc32c(payload);
  }
  return h;
}

// Decodes and verifies a header received from `peer` (named in errors as `who`). Throws
// malformed_message (wrong size, magic, kind or source), version_mismatch, checksum_mismatch
// (header CRC), or resource_exhausted (length above `max_length`).
inline frame_header decode_frame(std::span<const std::byte> bytes, std::uint32_t peer,
                                 std::uint64_t max_length, const std::string& who) {
  if (bytes.size() != frame_header_bytes) {
    throw_error(errc::malformed_message, who + ": frame header of " + std::to_string(bytes.size()) +
                                             " bytes from rank " + std::to_string(peer) +
                                             ", expected " + std::to_string(frame_header_bytes));
  }
  const std::byte* p = bytes.data();
  if (frame_load_u32(p) != frame_magic) {
    throw_error(errc::malformed_message, who + ": frame from rank " + std::to_string(peer) +
                                             " does not start with the magic");
  }
  if (static_cast<std::uint8_t>(p[4]) != frame_version) {
    throw_error(errc::version_mismatch, who + ": frame version " +
                                            std::to_string(static_cast<unsigned>(p[4])) +
                                            " from rank " + std::to_string(peer) +
                                            ", this build reads " + std::to_string(frame_version));
  }
  const std::uint32_t crc = frame_crc32c(bytes.first(28));
  if (frame_load_u32(p + 28) != crc) {
    throw_error(errc::checksum_mismatch,
                who + ": frame header from rank " + std::to_string(peer) + " fails its CRC32C");
  }
  frame_header h;
  const auto kind = static_cast<std::uint8_t>(p[5]);
  if (kind > static_cast<std::uint8_t>(frame_kind::abort)) {
    throw_error(errc::malformed_message, who + ": unknown frame kind " + std::to_string(kind) +
                                             " from rank " + std::to_string(peer));
  }
  h.kind = static_cast<frame_kind>(kind);
  h.flags = static_cast<std::uint16_t>(static_cast<std::uint16_t>(p[6]) |
                                       (static_cast<std::uint16_t>(p[7]) << 8));
  h.source = frame_load_u32(p + 8);
  h.tag = frame_load_u32(p + 12);
  h.length = frame_load_u64(p + 16);
  h.payload_crc = frame_load_u32(p + 24);
  if (h.source != peer) {
    throw_error(errc::malformed_message, who + ": frame claims source rank " +
                                             std::to_string(h.source) + " but came from rank " +
                                             std::to_string(peer));
  }
  if (h.length > max_length) {
    throw_error(errc::resource_exhausted, who + ": frame from rank " + std::to_string(peer) +
                                              " announces " + std::to_string(h.length) +
                                              " bytes, above the limit of " +
                                              std::to_string(max_length));
  }
  return h;
}

// Verifies the payload against its header: length and, when flagged, the CRC32C.
inline void verify_payload(const frame_header& h, std::span<const std::byte> payload,
                           const std::string& who) {
  if (payload.size() != h.length) {
    throw_error(errc::malformed_message, who + ": frame from rank " + std::to_string(h.source) +
                                             " announces " + std::to_string(h.length) +
                                             " payload bytes, " + std::to_string(payload.size()) +
                                             " arrived");
  }
  if ((h.flags & frame_flag_payload_crc) != 0 && frame_crc32c(payload) != h.payload_crc) {
    throw_error(errc::checksum_mismatch, who + ": payload of " + std::to_string(h.length) +
                                             " bytes from rank " + std::to_string(h.source) +
                                             " (tag " + std::to_string(h.tag) +
                                             ") fails its CRC32C");
  }
}

}  // namespace stellatrain::detail
