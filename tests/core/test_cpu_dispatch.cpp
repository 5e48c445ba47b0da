// SPDX-License-Identifier: Apache-2.0
// The run-time choice of architecture: what the CPU is asked, which kernel `dispatch_arch`
// calls, and that the library's dispatched kernels (checksum, value payloads) give the results
// of the unit's own architecture.
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/detail/cpu_dispatch.hpp>

#include "catch.hpp"

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

using namespace stellatrain;

namespace {

struct name_of_arch {
  template <class Arch>
  std::string_view operator()(Arch) const {
    return Arch::name();
  }
};

}  // namespace

TEST_CASE("the unit's own architecture and the scalar one always run", "[core][dispatch]") {
  STATIC_REQUIRE(detail::unit_runs<scalar_arch>());
  REQUIRE(detail::cpu_runs<scalar_arch>());
  REQUIRE(detail::cpu_runs<xsimd::default_arch>());
  // Another processor family's architecture never does.
#if STELLATRAIN_X86_INTRINSICS
  REQUIRE_FALSE(detail::cpu_runs<xsimd::neon64>());
#endif
}

TEST_CASE("the CPU's answers nest as the instruction sets do", "[core][dispatch]") {
  const std::uint32_t f = detail::host_cpu_features();
  CAPTURE(f);
  if (detail::cpu_runs<xsimd::avx512bw>()) REQUIRE(detail::cpu_runs<xsimd::fma3<xsimd::avx2>>());
  if (detail::cpu_runs<xsimd::fma3<xsimd::avx2>>()) REQUIRE(detail::cpu_runs<xsimd::avx2>());
  if (detail::cpu_runs<xsimd::avx2>()) REQUIRE(detail::cpu_runs<xsimd::avx>());
  if (detail::cpu_runs<xsimd::avx>()) REQUIRE(detail::cpu_runs<xsimd::sse4_2>());
  if (detail::cpu_runs<xsimd::sse4_2>()) REQUIRE(detail::cpu_runs<xsimd::sse2>());
  // The avx families need F16C, the kernels reached at run time convert fp16 with it.
  if (detail::cpu_runs<xsimd::avx>()) REQUIRE((f & detail::cpu_f16c) != 0);
  // Whatever this unit is built for, the CPU has.
  constexpr std::uint32_t own = detail::cpu_needs<xsimd::default_arch>();
  if constexpr (own != 0) REQUIRE((f & own) == own);
}

TEST_CASE("dispatch_arch calls the best upgrade the CPU runs, else the unit's kernel",
          "[core][dispatch]") {
  const name_of_arch name;
  // An upgrade above the unit's architecture, where the CPU has it.
  const auto chosen = detail::dispatch_arch<xsimd::sse2, xsimd::avx512bw, xsimd::avx2>(name);
  if (detail::cpu_runs<xsimd::avx512bw>()) {
    REQUIRE(chosen == xsimd::avx512bw::name());
  } else if (detail::cpu_runs<xsimd::avx2>()) {
    REQUIRE(chosen == xsimd::avx2::name());
  } else if (detail::cpu_runs<xsimd::sse2>()) {
    REQUIRE(chosen == xsimd::sse2::name());
  } else {
    REQUIRE(chosen == scalar_arch::name());
  }
  // Upgrades no better than the unit's architecture are never taken.
  const auto own = detail::dispatch_arch<xsimd::avx2, xsimd::sse4_2>(name);
  REQUIRE(own == (detail::cpu_runs<xsimd::avx2>() ? xsimd::avx2::name() : scalar_arch::name()));
  // A unit architecture the CPU lacks falls back to the scalar kernel.
  REQUIRE(detail::dispatch_arch<xsimd::neon64>(name) ==
          (detail::cpu_runs<xsimd::neon64>() ? xsimd::neon64::name() : scalar_arch::name()));
}

TEST_CASE("the checksum of every architecture the CPU runs equals the portable one",
          "[core][dispatch]") {
  std::vector<std::byte> data(3 * 4096 * 2 + 1000);
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<std::byte>(i * 131u + (i >> 7));
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  const std::uint32_t want = detail::crc32c_software(data);
  auto check = [&]<class Arch>() {
    if (!detail::cpu_runs<Arch>()) return;
    INFO("architecture " << Arch::name());
    REQUIRE(~detail::crc32c_update<Arch>(~0u, p, data.size()) == want);
  };
  check.template operator()<scalar_arch>();
  check.template operator()<xsimd::sse2>();
  check.template operator()<xsimd::sse4_2>();
  check.template operator()<xsimd::avx2>();
  check.template operator()<xsimd::avx512bw>();
  REQUIRE(crc32c(data) == want);
}
