// SPDX-License-Identifier: Apache-2.0
// The errors of the message reader: each says "unpack: " and then what was wrong and where,
// naming the section and its tensor where there is one (docs/wire-format.md has examples).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

namespace stellatrain::detail {

[[noreturn]] inline void fail_unpack(errc code, const std::string& what) {
  throw_error(code, "unpack: " + what);
}

[[noreturn]] inline void fail_unpack_section(std::size_t section, std::uint32_t tensor, errc code,
                                             const std::string& what) {
  throw_error(code, "unpack: section " + std::to_string(section) + " (tensor " +
                        std::to_string(tensor) + "): " + what);
}

/// `v` as "0x..." (lower-case hex digits).
[[nodiscard]] inline std::string hex_string(std::uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace stellatrain::detail
