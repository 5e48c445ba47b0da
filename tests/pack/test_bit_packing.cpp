// SPDX-License-Identifier: Apache-2.0
// Bit packing (vertical SIMD layout against its scalar oracle and its documented byte layout,
// horizontal layout, indices from gaps), the width search's counts and exception positions,
// varints, value conversions and the parallel checksum.
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/detail/bit_packing.hpp>
#include <stellatrain/pack/detail/crc32c_combine.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>

#include "catch.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::detail;

namespace {

std::vector<std::uint32_t> random_values(std::size_t count, unsigned b, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> v(count);
  for (auto& x : v) x = static_cast<std::uint32_t>(rng()) & low_mask32(b);
  return v;
}

}  // namespace

TEST_CASE("vertical packing: SIMD equals scalar and round-trips at every width", "[pack][bits]") {
  for (unsigned b = 0; b <= 32; ++b) {
    INFO("width " << b);
    auto v = random_values(256, b, b);
    if (b > 0) v[255] = low_mask32(b);  // the widest value
    std::vector<std::byte> simd(32 * b + 1, std::byte{0xAB}), scalar(32 * b + 1, std::byte{0xAB});
    pack_vertical(v.data(), b, simd.data());
    pack_vertical_scalar(v.data(), b, scalar.data());
    REQUIRE(simd == scalar);
    REQUIRE(simd.back() == std::byte{0xAB});  // nothing written past 32 * b bytes
    std::vector<std::uint32_t> a(256, 7), c(256, 7);
    unpack_vertical(simd.data(), b, a.data());
    unpack_vertical_scalar(simd.data(), b, c.data());
    REQUIRE(a == v);
    REQUIRE(c == v);
    // High bits above the width are ignored when packing.
    auto dirty = v;
    for (auto& x : dirty) x |= ~low_mask32(b);
    std::vector<std::byte> masked(32 * b + 1, std::byte{0xAB});
    pack_vertical(dirty.data(), b, masked.data());
    REQUIRE(masked == simd);
  }
}

TEST_CASE("vertical packing follows the documented layout", "[pack][bits]") {
  // Width 3: value j sits in lane j % 8, slot j / 8, at bits [3s, 3s + 3) of its lane; word w of
  // lane l is stored at byte (8w + l) * 4.
  std::vector<std::uint32_t> v(256);
  for (std::size_t j = 0; j < 256; ++j) v[j] = static_cast<std::uint32_t>((j * 5 + 1) % 8);
  std::vector<std::byte> out(96);
  pack_vertical(v.data(), 3, out.data());
  for (std::size_t j = 0; j < 256; ++j) {
    const std::size_t lane = j % 8, slot = j / 8;
    std::uint32_t got = 0;
    for (unsigned k = 0; k < 3; ++k) {
      const std::size_t bit = slot * 3 + k;
      const std::size_t byte = ((bit / 32) * 8 + lane) * 4 + (bit % 32) / 8;
      got |= ((std::to_integer<std::uint32_t>(out[byte]) >> (bit % 8)) & 1u) << k;
    }
    REQUIRE(got == v[j]);
  }
}

TEST_CASE("indices from gaps equal the running sum, wrapping in 32 bits", "[pack][bits]") {
  // out[j] = start + (g[0] + 1) + ... + (g[j] + 1) - 1: every count (the SIMD groups and the
  // scalar tail), small and wrapping values.
  for (unsigned b : {0u, 5u, 31u, 32u}) {
    for (std::size_t count : {1u, 3u, 4u, 7u, 8u, 9u, 17u, 255u, 256u}) {
      INFO("width " << b << " count " << count);
      const auto g = random_values(256, b, 10 * b + count);
      for (std::uint32_t start : {0u, 12345u, 0xfffffff0u}) {
        std::vector<std::uint32_t> out(count, 7);
        store_indices_u32<xsimd::default_arch>(g.data(), count, start, out.data());
        std::uint32_t expect = start;
        for (std::size_t j = 0; j < count; ++j) {
          expect += g[j];
          if (out[j] != expect) FAIL("position " << j << ": " << out[j] << " != " << expect);
          ++expect;
        }
      }
    }
  }
}

TEST_CASE("horizontal packing round-trips and reports padding", "[pack][bits]") {
  for (std::size_t count : {0, 1, 2, 7, 8, 9, 100, 255}) {
    for (unsigned b : {0u, 1u, 3u, 7u, 8u, 13u, 31u, 32u}) {
      const auto v = random_values(count, b, count * 33 + b);
      std::vector<std::byte> out(horizontal_bytes(count, b) + 1, std::byte{0xCD});
      pack_horizontal(v.data(), count, b, out.data());
      REQUIRE(out.back() == std::byte{0xCD});
      std::vector<std::uint32_t> back(count);
      REQUIRE(unpack_horizontal(out.data(), count, b, back.data()) == 0);
      REQUIRE(back == v);
      if ((count * b) % 8 != 0) {
        out[horizontal_bytes(count, b) - 1] |= std::byte{0x80};  // a padding bit
        REQUIRE(unpack_horizontal(out.data(), count, b, back.data()) != 0);
      }
    }
  }
}

TEST_CASE("varints: sizes, round trip, and malformed input", "[pack][varint]") {
  const std::uint64_t values[] = {0,
                                  1,
                                  127,
                                  128,
                                  300,
                                  16383,
                                  16384,
                                  (1ull << 35) + 5,
                                  (1ull << 63),
                                  std::numeric_limits<std::uint64_t>::max()};
  for (std::uint64_t x : values) {
    std::byte buf[10];
    std::byte* end = write_varint(buf, x);
    REQUIRE(static_cast<std::size_t>(end - buf) == varint_bytes(x));
    std::uint64_t y = 1234;
    REQUIRE(read_varint(buf, end, y) == end);
    REQUIRE(y == x);
    if (end - buf > 1) {
      REQUIRE(read_varint(buf, end - 1, y) == nullptr);  // truncated
    }
  }
  CHECK(varint_bytes(std::numeric_limits<std::uint64_t>::max()) == 10);
  std::uint64_t y = 0;
  const std::byte overlong[] = {std::byte{0x80}, std::byte{0x00}};
  CHECK(read_varint(overlong, overlong + 2, y) == nullptr);
  const std::byte too_wide[] = {std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff},
                                std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff},
                                std::byte{0xff}, std::byte{0x02}};
  CHECK(read_varint(too_wide, too_wide + 10, y) == nullptr);
  const std::byte eleven[] = {std::byte{0x80}, std::byte{0x80}, std::byte{0x80}, std::byte{0x80},
                              std::byte{0x80}, std::byte{0x80}, std::byte{0x80}, std::byte{0x80},
                              std::byte{0x80}, std::byte{0x80}, std::byte{0x01}};
  CHECK(read_varint(eleven, eleven + 11, y) == nullptr);
  CHECK(read_varint(overlong, overlong, y) == nullptr);  // empty
}

namespace {

std::vector<float> special_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          0.1f,
                          65504.0f,
                          65520.0f,
                          1e-8f,
                          -3e-5f,
                          6.1e-5f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::bit_cast<float>(0x7f800001u),
                          std::bit_cast<float>(0xffc12345u),
                          1.0f + 1.0f / 256.0f,
                          1.0f + 3.0f / 512.0f,
                          std::bit_cast<float>(0x3f808000u),
                          std::bit_cast<float>(0x3f818000u)};
  std::mt19937_64 rng(5);
  for (int i = 0; i < 2000; ++i)
    v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  return v;
}

template <class V>
std::vector<V> as(const std::vector<float>& f) {
  std::vector<V> out;
  for (float x : f) out.push_back(from_float<V>(x));
  return out;
}

template <class V>
std::uint32_t bits_of(V v) {
  if constexpr (std::is_same_v<V, float>) {
    return std::bit_cast<std::uint32_t>(v);
  } else {
    return v.bits();
  }
}

// What a value of type V reads back as after a trip through wire encoding `enc`, by the
// scalar conversions of core/float16.hpp.
template <class V>
V through_wire(V v, value_encoding enc) {
  const float f = to_float(v);
  float w = f;
  if (enc == value_encoding::fp16) w = to_float(fp16(f));
  if (enc == value_encoding::bf16) w = to_float(bf16(f));
  return from_float<V>(w);
}

template <class V>
void check_value_codec() {
  const auto values = as<V>(special_floats());
  for (auto enc : {value_encoding::fp32, value_encoding::fp16, value_encoding::bf16}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                          std::size_t{9}, std::size_t{17}, values.size()}) {
      INFO("encoding " << name_of(enc) << " count " << n);
      std::vector<std::byte> wire(n * value_bytes(enc) + 1, std::byte{0x5A});
      encode_values(values.data(), n, enc, wire.data() + 1);  // odd address on purpose
      std::vector<V> back(n);
      decode_values(wire.data() + 1, n, enc, back.data());
      for (std::size_t i = 0; i < n; ++i) {
        const V expect = through_wire(values[i], enc);
        if (bits_of(back[i]) != bits_of(expect)) {
          FAIL("value " << i << ": bits " << std::hex << bits_of(values[i]) << " came back as "
                        << bits_of(back[i]) << ", expected " << bits_of(expect));
        }
      }
      // The wire bytes are little-endian values of the encoding.
      for (std::size_t i = 0; i < n && enc != value_encoding::fp32; ++i) {
        const std::uint16_t stored = load_le<std::uint16_t>(wire.data() + 1 + 2 * i);
        const float f = to_float(values[i]);
        const std::uint16_t expect = enc == value_encoding::fp16 ? fp16(f).bits() : bf16(f).bits();
        REQUIRE(stored == expect);
      }
    }
  }
}

}  // namespace

TEST_CASE("value payloads: every value type through every encoding matches the scalar conversions",
          "[pack][values]") {
  check_value_codec<float>();
  check_value_codec<fp16>();
  check_value_codec<bf16>();
}

TEST_CASE("gap counts and exception positions equal their scalar definitions", "[pack][bits]") {
  std::mt19937_64 rng(17);
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                            std::size_t{100}, std::size_t{256}}) {
    for (int trial = 0; trial < 20; ++trial) {
      // Gaps of mixed widths, some at the extremes (0 and 2^32 - 1).
      std::vector<std::uint32_t> d(count);
      for (auto& x : d) {
        const unsigned w = static_cast<unsigned>(rng() % 33);
        x = static_cast<std::uint32_t>(rng()) & low_mask32(w);
      }
      if (trial == 0) d[0] = 0xffffffffu;
      const unsigned thresholds[8] = {0, 1, 5, 7, 12, 20, 31, 3};
      std::uint32_t counts[8];
      count_wider<std::uint32_t, xsimd::default_arch>(d.data(), count, thresholds, 8, counts);
      for (unsigned b = 0; b < 32; ++b) {
        INFO("count " << count << " trial " << trial << " width " << b);
        std::vector<std::uint8_t> expected;
        for (std::size_t j = 0; j < count; ++j) {
          if ((d[j] >> b) != 0) expected.push_back(static_cast<std::uint8_t>(j));
        }
        std::uint8_t pos[256 + 8];
        const std::size_t found = exception_positions(d.data(), count, b, pos);
        REQUIRE(found == expected.size());
        CHECK(std::equal(expected.begin(), expected.end(), pos));
        for (std::size_t i = 0; i < 8; ++i) {
          if (thresholds[i] == b) CHECK(counts[i] == expected.size());
        }
      }
    }
  }
}

TEST_CASE("crc32c_combine and the parallel checksum equal the sequential CRC", "[pack][crc32c]") {
  std::mt19937_64 rng(9);
  std::vector<std::byte> data(3 * crc32c_parallel_grain + 12345);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const auto all = std::span<const std::byte>(data);
  for (std::size_t cut :
       {std::size_t{0}, std::size_t{1}, std::size_t{1000}, data.size() - 1, data.size()}) {
    CHECK(crc32c_combine(crc32c(all.first(cut)), crc32c(all.subspan(cut)), data.size() - cut) ==
          crc32c(all));
  }
  thread_pool pool(3);
  CHECK(crc32c_parallel(all, pool) == crc32c(all));
  inline_executor inline_ex;
  CHECK(crc32c_parallel(all, inline_ex) == crc32c(all));
  CHECK(crc32c_parallel(all.first(100), pool) == crc32c(all.first(100)));
  // Pieces checksummed apart (empty ones included) and appended in order.
  std::uint32_t running = crc32c(all.first(10));
  std::size_t at = 10;
  for (std::size_t length :
       {std::size_t{0}, std::size_t{1}, std::size_t{4096}, std::size_t{0}, std::size_t{77777}}) {
    running = crc32c_piece::of(all.subspan(at, length)).after(running);
    at += length;
  }
  CHECK(running == crc32c(all.first(at)));
  CHECK(crc32c_zeros_operator(0) == 0x80000000u);
}
