// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/crc32c.hpp>

#include "catch.hpp"

#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

using namespace stellatrain;

namespace {

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

// Bit-at-a-time CRC-32C straight from the definition: the oracle.
std::uint32_t crc32c_bitwise(std::span<const std::byte> data) {
  std::uint32_t crc = 0xffffffffu;
  for (std::byte b : data) {
    crc ^= static_cast<std::uint32_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ ((crc & 1u) != 0 ? 0x82f63b78u : 0u);
  }
  return ~crc;
}

}  // namespace

TEST_CASE("crc32c matches the standard check values", "[core][crc32c]") {
  CHECK(crc32c(bytes_of("123456789")) == 0xE3069283u);
  CHECK(crc32c_portable(bytes_of("123456789")) == 0xE3069283u);
  const std::vector<std::byte> zeros(32, std::byte{0});
  CHECK(crc32c(zeros) == 0x8A9136AAu);
  CHECK(crc32c_portable(zeros) == 0x8A9136AAu);
  const std::vector<std::byte> ones(32, std::byte{0xff});
  CHECK(crc32c(ones) == 0x62A8AB43u);  // RFC 3720 B.4
  CHECK(crc32c({}) == 0u);
}

TEST_CASE("crc32c: hardware and table paths agree with the definition at every length and offset",
          "[core][crc32c]") {
  std::mt19937 rng(7);
  std::vector<std::byte> data(1100);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  for (std::size_t off = 0; off < 9; ++off) {
    for (std::size_t len = 0; len + off <= data.size(); len += (len < 40 ? 1 : 97)) {
      const auto s = std::span<const std::byte>(data).subspan(off, len);
      const auto want = crc32c_bitwise(s);
      REQUIRE(crc32c(s) == want);
      REQUIRE(crc32c_portable(s) == want);
    }
  }
}

TEST_CASE("crc32c continues from a seed", "[core][crc32c]") {
  std::mt19937 rng(8);
  std::vector<std::byte> data(777);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const std::span<const std::byte> all(data);
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{8}, std::size_t{300}, std::size_t{777}}) {
    CHECK(crc32c(all.subspan(cut), crc32c(all.first(cut))) == crc32c(all));
    CHECK(crc32c_portable(all.subspan(cut), crc32c_portable(all.first(cut))) == crc32c(all));
  }
}
