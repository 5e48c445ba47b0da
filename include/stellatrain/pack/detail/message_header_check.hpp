// SPDX-License-Identifier: Apache-2.0
// The first checks of a received message (docs/wire-format.md, "What a reader checks", 1 to
// 3): its size against the limit, the message header's fields, and the CRC-32C trailer.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/detail/unpack_error.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

namespace stellatrain::detail {

/// Checks everything before the checksum: the size against `max_message_bytes` and the
/// message header's fields. Returns the sender's tag.
[[nodiscard]] inline std::uint64_t check_message_header(std::span<const std::byte> message,
                                                        std::uint64_t max_message_bytes) {
  const std::uint64_t size = message.size();
  const std::byte* m = message.data();
  constexpr std::uint64_t minimum = wire::message_header_bytes + wire::message_trailer_bytes;
  if (size < minimum) {
    fail_unpack(errc::malformed_message, "truncated: " + std::to_string(size) +
                                             " bytes, shorter than the " + std::to_string(minimum) +
                                             " bytes of header and checksum");
  }
  if (size > max_message_bytes) {
    fail_unpack(errc::resource_exhausted, "message of " + std::to_string(size) +
                                              " bytes exceeds the limit of " +
                                              std::to_string(max_message_bytes));
  }
  if (std::memcmp(m, wire::magic.data(), 4) != 0) {
    fail_unpack(errc::malformed_message,
                "bad magic " + hex_string(load_le<std::uint32_t>(m)) +
                    " (expected the bytes \"STPK\"): not a stellatrain message");
  }
  const auto version = load_le<std::uint16_t>(m + wire::offset_version);
  if (version < wire::oldest_version || version > wire::version) {
    fail_unpack(errc::version_mismatch,
                "format version " + std::to_string(version) + ", this build reads versions " +
                    std::to_string(wire::oldest_version) + " to " + std::to_string(wire::version));
  }
  const auto flags = load_le<std::uint16_t>(m + wire::offset_flags);
  if (flags != 0) fail_unpack(errc::unsupported, "unknown message flags " + hex_string(flags));
  const auto header_bytes = load_le<std::uint32_t>(m + wire::offset_header_bytes);
  if (header_bytes != wire::message_header_bytes) {
    fail_unpack(errc::malformed_message, "header size " + std::to_string(header_bytes) +
                                             ", version " + std::to_string(version) + " has " +
                                             std::to_string(wire::message_header_bytes));
  }
  const auto stated = load_le<std::uint64_t>(m + wire::offset_message_bytes);
  if (stated > size) {
    fail_unpack(errc::malformed_message, "truncated: the header says " + std::to_string(stated) +
                                             " bytes, " + std::to_string(size) + " arrived");
  }
  if (stated < size) {
    fail_unpack(errc::malformed_message, "oversized: " + std::to_string(size) +
                                             " bytes arrived, the header says " +
                                             std::to_string(stated));
  }
  return load_le<std::uint64_t>(m + wire::offset_tag);
}

/// The bytes the checksum covers: all but the trailer.
[[nodiscard]] inline std::span<const std::byte> message_body(
    std::span<const std::byte> message) noexcept {
  return message.first(message.size() - wire::message_trailer_bytes);
}

/// Compares the CRC-32C `computed` over the body with the one the trailer stores.
inline void check_message_checksum(std::uint32_t computed, std::span<const std::byte> message) {
  const std::uint32_t stored =
      load_le<std::uint32_t>(message.data() + message_body(message).size());
  if (stored != computed) {
    fail_unpack(errc::checksum_mismatch, "CRC-32C " + hex_string(computed) +
                                             " of the message does not match the stored " +
                                             hex_string(stored) + ": corrupted in transit");
  }
}

}  // namespace stellatrain::detail
