// SPDX-License-Identifier: Apache-2.0
// The array loops of the fp16 / bf16 conversions for every architecture this CPU runs (each
// loop is compiled for its instruction set whatever this unit's flags, so a plain x86-64 build
// checks the AVX2 and AVX-512 ones too) against the scalar conversions: every 16-bit pattern
// widened, tricky floats rounded, odd lengths, nothing written past what a loop reports.
#include <stellatrain/core/detail/cpu_dispatch.hpp>
#include <stellatrain/core/detail/value_convert.hpp>
#include <stellatrain/core/float16.hpp>

#include "catch.hpp"

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

using namespace stellatrain;

namespace {

std::vector<float> tricky_floats() {
  using limits = std::numeric_limits<float>;
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
                       limits::max(),
                       limits::denorm_min(),
                       limits::min(),
                       limits::infinity(),
                       -limits::infinity(),
                       limits::quiet_NaN(),
                       std::bit_cast<float>(0xff812345u),
                       std::bit_cast<float>(0x7fa00001u),
                       std::bit_cast<float>(0x3f808000u),
                       std::bit_cast<float>(0x3f818000u),
                       std::bit_cast<float>(0x3f80fff0u)};
  std::mt19937 rng(1);
  for (int k = 0; k < 4000; ++k) {
    v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  }
  return v;
}

std::uint16_t load16(const std::byte* p) {
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return b;
}

template <class Arch, class T>
void check_from_floats(const std::vector<float>& v, std::size_t n) {
  std::vector<std::byte> out(2 * n + 2, std::byte{0xa5});
  const std::size_t m = detail::halves_from_floats<Arch, T>(v.data(), n, out.data());
  REQUIRE(m <= n);
  REQUIRE((m == 0 || n - m < 16));  // nothing (no vector path) or whole vectors to the end
  for (std::size_t i = 0; i < m; ++i) {
    INFO("input bits " << std::bit_cast<std::uint32_t>(v[i]));
    REQUIRE(load16(out.data() + 2 * i) == T(v[i]).bits());
  }
  for (std::size_t b = 2 * m; b < out.size(); ++b) REQUIRE(out[b] == std::byte{0xa5});
}

template <class Arch, class T>
void check_to_floats(std::size_t n) {
  std::vector<std::byte> in(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto bits = static_cast<std::uint16_t>(i);
    std::memcpy(in.data() + 2 * i, &bits, 2);
  }
  std::vector<float> out(n + 1, -2.0f);
  const std::size_t m = detail::floats_from_halves<Arch, T>(in.data(), n, out.data());
  REQUIRE(m <= n);
  REQUIRE((m == 0 || n - m < 16));
  for (std::size_t i = 0; i < m; ++i) {
    INFO("bits " << i);
    const float want = to_float(T::from_bits(static_cast<std::uint16_t>(i)));
    REQUIRE(std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(want));
  }
  for (std::size_t i = m; i < out.size(); ++i) REQUIRE(out[i] == -2.0f);
}

}  // namespace

TEMPLATE_TEST_CASE("array conversions of every architecture this CPU runs equal the scalar ones",
                   "[core][convert]", scalar_arch, xsimd::sse2, xsimd::avx, xsimd::avx2,
                   xsimd::fma3<xsimd::avx2>, xsimd::avx512bw) {
  if (!detail::cpu_runs<TestType>()) {
    WARN("skipped: this CPU lacks " << TestType::name());
    return;
  }
  const auto v = tricky_floats();
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{4},
                        std::size_t{5}, std::size_t{7}, std::size_t{8}, std::size_t{9},
                        std::size_t{15}, std::size_t{16}, std::size_t{17}, v.size()}) {
    CAPTURE(n);
    check_from_floats<TestType, fp16>(v, n);
    check_from_floats<TestType, bf16>(v, n);
  }
  for (std::size_t n : {std::size_t{0}, std::size_t{17}, std::size_t{65536}}) {
    CAPTURE(n);
    check_to_floats<TestType, fp16>(n);
    check_to_floats<TestType, bf16>(n);
  }
}

TEST_CASE("the architectures with array conversions convert whole vectors", "[core][convert]") {
  const auto v = tricky_floats();
  std::vector<std::byte> out(2 * v.size());
  // No vector path: the caller converts everything.
  REQUIRE(detail::halves_from_floats<scalar_arch, fp16>(v.data(), 64, out.data()) == 0);
  REQUIRE(detail::halves_from_floats<scalar_arch, bf16>(v.data(), 64, out.data()) == 0);
  if (detail::cpu_runs<xsimd::sse2>()) {
    // SSE2 promises no F16C.
    REQUIRE(detail::halves_from_floats<xsimd::sse2, fp16>(v.data(), 64, out.data()) == 0);
    REQUIRE(detail::halves_from_floats<xsimd::sse2, bf16>(v.data(), 63, out.data()) == 60);
  }
  if (detail::cpu_runs<xsimd::avx2>()) {
    REQUIRE(detail::halves_from_floats<xsimd::avx2, fp16>(v.data(), 63, out.data()) == 56);
    REQUIRE(detail::halves_from_floats<xsimd::avx2, bf16>(v.data(), 63, out.data()) == 56);
  }
}
