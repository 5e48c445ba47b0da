// SPDX-License-Identifier: Apache-2.0
// The SIMD loads and stores of fp16 / bf16 values against the scalar conversions.
#include <stellatrain/core/detail/value_convert.hpp>
#include <stellatrain/core/float16.hpp>

#include "catch.hpp"

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace stellatrain;

namespace {

using batch = xsimd::batch<float>;
constexpr std::size_t width = batch::size;

// Floats that exercise every rounding path: ties, carries into the exponent, subnormals of
// both formats, overflow, infinities, NaNs with payloads, signed zeros, and random bits.
std::vector<float> tricky_floats() {
  std::vector<float> v{0.0f,
                       -0.0f,
                       1.0f,
                       -1.0f,
                       1.00390625f,
                       1.01171875f,
                       65504.0f,
                       65519.0f,
                       65520.0f,
                       70000.0f,
                       6.0e-8f,
                       3.0e-8f,
                       2.9e-8f,
                       1.0e-6f,
                       -6.1e-5f,
                       3.3895313892515355e38f,
                       std::numeric_limits<float>::max(),
                       std::numeric_limits<float>::denorm_min(),
                       std::numeric_limits<float>::min(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(),
                       std::bit_cast<float>(0xff812345u),
                       std::bit_cast<float>(0x7fa00001u),
                       std::bit_cast<float>(0x3f808000u),
                       std::bit_cast<float>(0x3f818000u),
                       std::bit_cast<float>(0x3f80fff0u)};
  std::mt19937 rng(1);
  for (int k = 0; k < 4000; ++k) {
    v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  }
  while (v.size() % width != 0) v.push_back(0.5f);
  return v;
}

template <class T>
std::uint16_t bits_of(T x) {
  return x.bits();
}

}  // namespace

TEMPLATE_TEST_CASE("batch stores round to 16 bits exactly like the scalar conversion",
                   "[optim][convert]", fp16, bf16) {
  const auto v = tricky_floats();
  std::vector<TestType> out(v.size() + 1, TestType::from_bits(0xabcd));
  for (std::size_t i = 0; i < v.size(); i += width) {
    detail::store_from_float<xsimd::default_arch>(out.data() + i + 1,
                                                  batch::load_unaligned(v.data() + i));
  }
  CHECK(bits_of(out[0]) == 0xabcd);  // nothing written before the destination
  for (std::size_t i = 0; i < v.size(); ++i) {
    INFO("input bits " << std::bit_cast<std::uint32_t>(v[i]));
    REQUIRE(bits_of(out[i + 1]) == bits_of(TestType(v[i])));
  }
}

TEMPLATE_TEST_CASE("batch loads widen 16-bit values exactly", "[optim][convert]", fp16, bf16) {
  std::vector<TestType> in(65536 + 1);
  for (std::uint32_t b = 0; b < 65536; ++b) {
    in[b + 1] = TestType::from_bits(static_cast<std::uint16_t>(b));
  }
  for (std::size_t i = 0; i + width <= 65536; i += width) {
    const batch x = detail::load_as_float<xsimd::default_arch>(in.data() + i + 1);  // unaligned
    alignas(64) float lanes[width];
    x.store_aligned(lanes);
    for (std::size_t k = 0; k < width; ++k) {
      const float want = to_float(in[i + 1 + k]);
      INFO("bits " << i + k);
      REQUIRE(std::memcmp(&lanes[k], &want, 4) == 0);
    }
  }
}

TEST_CASE("float loads and stores are plain copies", "[optim][convert]") {
  const auto v = tricky_floats();
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); i += width) {
    detail::store_from_float<xsimd::default_arch>(
        out.data() + i, detail::load_as_float<xsimd::default_arch>(v.data() + i));
  }
  CHECK(std::memcmp(out.data(), v.data(), v.size() * 4) == 0);
}
