// SPDX-License-Identifier: Apache-2.0
// fp16 and bf16 conversions: exhaustive over all 2^16 bit patterns, every rounding boundary,
// and a large random sample of floats, against oracles computed independently in double
// (nearest neighbour with ties to even) and, where the CPU has F16C, against the hardware.
#include <stellatrain/core/float16.hpp>

#include "catch.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STELLATRAIN_TEST_HAS_X86 1
#else
#define STELLATRAIN_TEST_HAS_X86 0
#endif

using stellatrain::bf16;
using stellatrain::fp16;

namespace {

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// The value of a binary16 pattern from its definition.
double fp16_value(std::uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  if (e == 0x1f) return m ? std::nan("") : sign * HUGE_VAL;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

// Oracle for float -> binary16: the nearest of the representable magnitudes (infinity taking
// part as 2^16, the next step after 65504), ties to the even pattern.
class fp16_oracle {
 public:
  fp16_oracle() {
    for (std::uint32_t h = 0; h <= 0x7c00; ++h) {
      magnitudes_.push_back({h == 0x7c00 ? 65536.0 : fp16_value(static_cast<std::uint16_t>(h)),
                             static_cast<std::uint16_t>(h)});
    }
  }
  std::uint16_t operator()(float f) const {
    const std::uint16_t sign = (bits(f) >> 16) & 0x8000;
    if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7e00 | ((bits(f) >> 13) & 0x3ff));
    const double a = std::fabs(static_cast<double>(f));
    if (a >= 65536.0) return sign | 0x7c00;
    auto hi = std::lower_bound(magnitudes_.begin(), magnitudes_.end(), a,
                               [](const auto& p, double v) { return p.first < v; });
    if (hi->first == a) return static_cast<std::uint16_t>(sign | hi->second);
    auto lo = hi - 1;
    const double dl = a - lo->first;
    const double dh = hi->first - a;
    std::uint16_t pick;
    if (dl < dh) {
      pick = lo->second;
    } else if (dh < dl) {
      pick = hi->second;
    } else {
      pick = (lo->second & 1) ? hi->second : lo->second;
    }
    return static_cast<std::uint16_t>(sign | pick);
  }

 private:
  std::vector<std::pair<double, std::uint16_t>> magnitudes_;
};

// Oracle for float -> bfloat16: the two neighbours by truncation, compared in double.
std::uint16_t bf16_oracle(float f) {
  const std::uint32_t x = bits(f);
  if (std::isnan(f)) return static_cast<std::uint16_t>((x >> 16) | 0x40);
  const std::uint32_t sign = x & 0x80000000u;
  const std::uint32_t lo = (x & 0x7fffffffu) & 0xffff0000u;
  if (lo == (x & 0x7fffffffu)) return static_cast<std::uint16_t>((sign | lo) >> 16);
  const std::uint32_t hi = lo + 0x10000u;
  const double a = std::fabs(static_cast<double>(f));
  const double vlo = static_cast<double>(from_bits(lo));
  const double vhi = hi == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(from_bits(hi));
  const double dl = a - vlo;
  const double dh = vhi - a;
  std::uint32_t pick;
  if (dl < dh) {
    pick = lo;
  } else if (dh < dl) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1) ? hi : lo;
  }
  return static_cast<std::uint16_t>((sign | pick) >> 16);
}

#if STELLATRAIN_TEST_HAS_X86
__attribute__((target("f16c"))) std::uint16_t f16c_from_float(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float f16c_to_float(std::uint16_t h) { return _cvtsh_ss(h); }
bool have_f16c() { return __builtin_cpu_supports("f16c"); }
#else
std::uint16_t f16c_from_float(float) { return 0; }
float f16c_to_float(std::uint16_t) { return 0; }
bool have_f16c() { return false; }
#endif

// Floats that probe every rounding boundary of a 16-bit format: for each pattern, its exact
// value, the midpoint to the next pattern and one float ulp either side of both.
std::vector<float> boundary_floats(float (*to_float)(std::uint16_t)) {
  std::vector<float> out;
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float v = to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(v) || std::isinf(v)) continue;
    const float next = to_float(static_cast<std::uint16_t>(h + 1));
    out.push_back(v);
    out.push_back(std::nextafter(v, HUGE_VALF));
    out.push_back(std::nextafter(v, -HUGE_VALF));
    if ((h & 0x7fff) != 0x7fff && !std::isnan(next)) {
      const double mid = (static_cast<double>(v) + static_cast<double>(next)) / 2.0;
      const float m = static_cast<float>(mid);
      if (static_cast<double>(m) == mid) {
        out.push_back(m);
        out.push_back(std::nextafter(m, HUGE_VALF));
        out.push_back(std::nextafter(m, -HUGE_VALF));
      }
    }
  }
  return out;
}

float fp16_to_float(std::uint16_t h) { return fp16::from_bits(h).to_float(); }
float bf16_to_float(std::uint16_t h) { return bf16::from_bits(h).to_float(); }

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> out(n);
  for (auto& f : out) f = from_bits(static_cast<std::uint32_t>(rng()));  // every exponent
  return out;
}

}  // namespace

TEST_CASE("fp16 to float is exact for all 2^16 patterns", "[float16]") {
  const bool hw = have_f16c();
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float f = fp16::from_bits(b).to_float();
    const double expected = fp16_value(b);
    if (std::isnan(expected)) {
      REQUIRE(std::isnan(f));
      REQUIRE(std::signbit(f) == static_cast<bool>(h & 0x8000));
      REQUIRE((bits(f) & 0x00400000u) != 0);  // quiet
    } else {
      REQUIRE(static_cast<double>(f) == expected);
      REQUIRE(std::signbit(f) == static_cast<bool>(h & 0x8000));  // -0 stays -0
    }
    if (hw) REQUIRE(bits(f) == bits(f16c_to_float(b)));
  }
}

TEST_CASE("fp16 round-trips every pattern", "[float16]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const fp16 back{fp16::from_bits(b).to_float()};
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (nan) {
      REQUIRE((back.bits() & 0x7c00) == 0x7c00);
      REQUIRE((back.bits() & 0x3ff) != 0);
      REQUIRE((back.bits() & 0x8000) == (h & 0x8000));
    } else {
      REQUIRE(back.bits() == b);
    }
  }
}

TEST_CASE("float to fp16 rounds to nearest even at every boundary", "[float16]") {
  const fp16_oracle oracle;
  const bool hw = have_f16c();
  for (float f : boundary_floats(fp16_to_float)) {
    const std::uint16_t got = fp16{f}.bits();
    INFO("float bits 0x" << std::hex << bits(f));
    REQUIRE(got == oracle(f));
    if (hw) REQUIRE(got == f16c_from_float(f));
  }
}

TEST_CASE("float to fp16 on a random sample of 4M floats and special values", "[float16]") {
  const fp16_oracle oracle;
  const bool hw = have_f16c();
  auto sample = random_floats(std::size_t{1} << 22, 12345);
  for (float f : {0.0f, -0.0f, HUGE_VALF, -HUGE_VALF, std::nanf(""), -std::nanf(""), 65504.0f,
                  65519.99f, 65520.0f, -65520.0f, 1e-8f, 2.9802322e-8f /* 2^-25 */, 2.9802326e-8f,
                  5.9604645e-8f /* 2^-24 */, 6.1035156e-5f /* 2^-14 */,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  from_bits(0x7f800001u) /* signalling NaN */, from_bits(0xffc12345u)}) {
    sample.push_back(f);
  }
  std::size_t mismatches = 0;
  for (float f : sample) {
    const std::uint16_t got = fp16{f}.bits();
    if (got != oracle(f) || (hw && got != f16c_from_float(f))) {
      if (++mismatches <= 5) {
        UNSCOPED_INFO("float 0x" << std::hex << bits(f) << " -> 0x" << got << ", oracle 0x"
                                 << oracle(f));
      }
    }
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("fp16 overflow, underflow and specials", "[float16]") {
  STATIC_REQUIRE(fp16{65504.0f}.bits() == 0x7bff);
  STATIC_REQUIRE(fp16{65519.0f}.bits() == 0x7bff);
  STATIC_REQUIRE(fp16{65520.0f}.bits() == 0x7c00);  // ties to even: to infinity
  STATIC_REQUIRE(fp16{-1e9f}.bits() == 0xfc00);
  STATIC_REQUIRE(fp16{0x1p-25f}.bits() == 0x0000);  // tie between 0 and 2^-24: to even (0)
  STATIC_REQUIRE(fp16{0x1.000002p-25f}.bits() == 0x0001);
  STATIC_REQUIRE(fp16{0x1p-24f}.bits() == 0x0001);
  STATIC_REQUIRE(fp16{0x3p-25f}.bits() == 0x0002);  // 1.5 units: to even (2)
  STATIC_REQUIRE(fp16{-0.0f}.bits() == 0x8000);
  STATIC_REQUIRE(fp16{1.0f}.bits() == 0x3c00);
  STATIC_REQUIRE(fp16{0.1f}.bits() == 0x2e66);
  STATIC_REQUIRE(fp16::from_bits(0x3555).to_float() == 0x1.554p-2f);
}

TEST_CASE("bf16 to float is exact and round-trips all 2^16 patterns", "[float16]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<std::uint16_t>(h);
    const float f = bf16::from_bits(b).to_float();
    REQUIRE(bits(f) == (h << 16));
    const bf16 back{f};
    if (std::isnan(f)) {
      REQUIRE(std::isnan(back.to_float()));
      REQUIRE((back.bits() & 0x8000) == (h & 0x8000));
    } else {
      REQUIRE(back.bits() == b);
    }
  }
}

TEST_CASE("float to bf16 rounds to nearest even at every boundary and on 4M random floats",
          "[float16]") {
  auto sample = boundary_floats(bf16_to_float);
  const auto random = random_floats(std::size_t{1} << 22, 6789);
  sample.insert(sample.end(), random.begin(), random.end());
  for (float f : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), from_bits(0x7f7f8000u),
                  from_bits(0x7f7f7fffu), from_bits(0x7f800001u), from_bits(0xffc00001u)}) {
    sample.push_back(f);
  }
  std::size_t mismatches = 0;
  for (float f : sample) {
    const std::uint16_t got = bf16{f}.bits();
    if (got != bf16_oracle(f)) {
      if (++mismatches <= 5) {
        UNSCOPED_INFO("float 0x" << std::hex << bits(f) << " -> 0x" << got << ", oracle 0x"
                                 << bf16_oracle(f));
      }
    }
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("bf16 overflow, subnormals and specials", "[float16]") {
  STATIC_REQUIRE(bf16{std::numeric_limits<float>::max()}.bits() == 0x7f80);  // rounds to inf
  STATIC_REQUIRE(bf16{1.0f}.bits() == 0x3f80);
  STATIC_REQUIRE(bf16{-0.0f}.bits() == 0x8000);
  STATIC_REQUIRE(bf16{std::bit_cast<float>(0x3f808000u)}.bits() == 0x3f80);  // tie: to even
  STATIC_REQUIRE(bf16{std::bit_cast<float>(0x3f818000u)}.bits() == 0x3f82);  // tie: to even
  STATIC_REQUIRE(bf16{std::bit_cast<float>(0x00008001u)}.bits() == 0x0001);  // subnormal
  STATIC_REQUIRE(bf16{std::bit_cast<float>(0x7f800001u)}.bits() == 0x7fc0);  // sNaN -> qNaN
}

TEST_CASE("from_float and to_float dispatch on the value type", "[float16]") {
  STATIC_REQUIRE(stellatrain::to_float(stellatrain::from_float<fp16>(0.5f)) == 0.5f);
  STATIC_REQUIRE(stellatrain::to_float(stellatrain::from_float<bf16>(-2.0f)) == -2.0f);
  STATIC_REQUIRE(stellatrain::from_float<float>(0.1f) == 0.1f);
}
