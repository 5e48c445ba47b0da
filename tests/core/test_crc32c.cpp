// SPDX-License-Identifier: Apache-2.0
// CRC-32C: published check values, a bit-at-a-time oracle written from the definition, the
// hardware path against the portable one at every length around the lane and stripe sizes,
// and continuation through `seed`.
#include <stellatrain/core/crc32c.hpp>

#include "catch.hpp"

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

using stellatrain::crc32c;

namespace {

std::span<const std::byte> bytes_of(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// The definition: reflected CRC, register preset to all ones, one bit at a time, final inversion.
std::uint32_t crc32c_bitwise(std::span<const std::byte> data) {
  std::uint32_t r = 0xffffffffu;
  for (std::byte b : data) {
    r ^= std::to_integer<std::uint32_t>(b);
    for (int k = 0; k < 8; ++k) r = (r & 1u) ? (r >> 1) ^ 0x82F63B78u : r >> 1;
  }
  return ~r;
}

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

}  // namespace

TEST_CASE("crc32c: published check values", "[crc32c]") {
  CHECK(crc32c(bytes_of("123456789")) == 0xE3069283u);
  CHECK(stellatrain::detail::crc32c_software(bytes_of("123456789")) == 0xE3069283u);
  CHECK(crc32c({}) == 0u);
  // RFC 3720 (iSCSI), appendix B.4: 32 bytes of zeros, of ones, ascending and descending.
  std::vector<std::byte> v(32, std::byte{0});
  CHECK(crc32c(v) == 0x8A9136AAu);
  for (auto& b : v) b = std::byte{0xff};
  CHECK(crc32c(v) == 0x62A8AB43u);
  for (std::size_t i = 0; i < 32; ++i) v[i] = static_cast<std::byte>(i);
  CHECK(crc32c(v) == 0x46DD794Eu);
  for (std::size_t i = 0; i < 32; ++i) v[i] = static_cast<std::byte>(31 - i);
  CHECK(crc32c(v) == 0x113FDB5Cu);
}

TEST_CASE("crc32c: portable and hardware paths agree with the bitwise definition", "[crc32c]") {
  const auto data = random_bytes(3 * 3 * 4096 + 3 * 256 + 100, 42);
  const std::vector<std::size_t> lengths = {
      0,   1,   7,    8,    9,     15,    63,    64,    255,   256,   767,
      768, 769, 1000, 3071, 12287, 12288, 12289, 13055, 13056, 13057, data.size()};
  for (std::size_t len : lengths) {
    for (std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{3}}) {
      if (offset + len > data.size()) continue;
      const auto s = std::span<const std::byte>(data).subspan(offset, len);
      const std::uint32_t expected = crc32c_bitwise(s);
      INFO("length " << len << " offset " << offset);
      CHECK(stellatrain::detail::crc32c_software(s) == expected);
      CHECK(crc32c(s) == expected);
    }
  }
}

TEST_CASE("crc32c: seed continues a running checksum", "[crc32c]") {
  const auto data = random_bytes(40000, 7);
  const std::uint32_t whole = crc32c(data);
  for (std::size_t cut : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{12288},
                          std::size_t{39999}, data.size()}) {
    const auto s = std::span<const std::byte>(data);
    const std::uint32_t first = crc32c(s.first(cut));
    CHECK(crc32c(s.subspan(cut), first) == whole);
    CHECK(stellatrain::detail::crc32c_software(s.subspan(cut), first) == whole);
  }
  CHECK(crc32c({}, 0x12345678u) == 0x12345678u);
}

TEST_CASE("crc32c: detects every single-bit error in a message", "[crc32c]") {
  auto data = random_bytes(600, 3);
  const std::uint32_t good = crc32c(data);
  for (std::size_t bit = 0; bit < data.size() * 8; ++bit) {
    data[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    REQUIRE(crc32c(data) != good);
    data[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
  }
}

TEST_CASE("crc32c: zeros operator shifts a register past zero bytes", "[crc32c]") {
  using namespace stellatrain::detail;
  // Feeding n zero bytes to a raw register equals multiplying it by x^(8n) mod P.
  for (std::uint64_t n : {0ull, 1ull, 5ull, 256ull, 4096ull, 10007ull}) {
    std::vector<unsigned char> zeros(n, 0);
    const std::uint32_t r = 0xDEADBEEFu;
    CHECK(crc32c_update_software(r, zeros.data(), zeros.size()) ==
          crc32c_multiply(crc32c_zeros_operator(n), r));
  }
  CHECK(crc32c_shift(crc32c_long_shift, 0x1234567u) ==
        crc32c_multiply(crc32c_zeros_operator(crc32c_long_lane), 0x1234567u));
}
