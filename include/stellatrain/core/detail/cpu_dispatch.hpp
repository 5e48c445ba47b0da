// SPDX-License-Identifier: Apache-2.0
// The library's only run-time choices of instruction set. A kernel is a template on the xsimd
// architecture; where a unit built for less should still use what the CPU has (the checksum's
// crc32 instruction, F16C in value payloads), `dispatch_arch` calls the kernel for the best
// architecture the CPU runs. Such kernels use raw intrinsics in functions compiled for their
// instruction set (STELLATRAIN_TARGET), not xsimd batches, which exist only for the unit's own.
#pragma once

#include <stellatrain/core/detail/isa_compat.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#if STELLATRAIN_X86_INTRINSICS
#include <cpuid.h>
#endif

namespace stellatrain::detail {

enum cpu_feature : std::uint32_t {
  cpu_sse2 = 1u << 0,
  cpu_sse3 = 1u << 1,
  cpu_ssse3 = 1u << 2,
  cpu_sse4_1 = 1u << 3,
  cpu_sse4_2 = 1u << 4,
  cpu_fma4 = 1u << 5,
  cpu_avx = 1u << 6,  // with the OS saving the YMM registers, as every AVX-based bit below
  cpu_f16c = 1u << 7,
  cpu_fma = 1u << 8,
  cpu_avx2 = 1u << 9,
  cpu_avx512f = 1u << 10,  // with the OS saving the ZMM and mask registers, as the rest
  cpu_avx512cd = 1u << 11,
  cpu_avx512dq = 1u << 12,
  cpu_avx512bw = 1u << 13,
  cpu_avx512vl = 1u << 14,
};

// The cpu_feature bits of the running CPU. cpuid is slow (and traps in virtual machines), so
// the answer, a fixed property of the machine, is computed once.
[[nodiscard]] inline std::uint32_t host_cpu_features() noexcept {
  static const std::uint32_t features = [] {
    std::uint32_t f = 0;
#if STELLATRAIN_X86_INTRINSICS
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return f;
    auto bit = [](unsigned reg, int i) { return ((reg >> i) & 1u) != 0; };
    if (bit(d, 26)) f |= cpu_sse2;
    if (bit(c, 0)) f |= cpu_sse3;
    if (bit(c, 9)) f |= cpu_ssse3;
    if (bit(c, 19)) f |= cpu_sse4_1;
    if (bit(c, 20)) f |= cpu_sse4_2;
    std::uint64_t xcr0 = 0;
    if (bit(c, 27)) {  // OSXSAVE: xgetbv says which registers the OS saves
      unsigned lo = 0, hi = 0;
      __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
      xcr0 = (static_cast<std::uint64_t>(hi) << 32) | lo;
    }
    const bool ymm = (xcr0 & 0x06u) == 0x06u;
    const bool zmm = ymm && (xcr0 & 0xe0u) == 0xe0u;
    if (ymm && bit(c, 28)) f |= cpu_avx;
    if (ymm && bit(c, 29)) f |= cpu_f16c;
    if (ymm && bit(c, 12)) f |= cpu_fma;
    if (__get_cpuid(0x80000001u, &a, &b, &c, &d) != 0 && ymm && bit(c, 16)) f |= cpu_fma4;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) != 0) {
      if (ymm && bit(b, 5)) f |= cpu_avx2;
      if (zmm && bit(b, 16)) f |= cpu_avx512f;
      if (zmm && bit(b, 17)) f |= cpu_avx512dq;
      if (zmm && bit(b, 28)) f |= cpu_avx512cd;
      if (zmm && bit(b, 30)) f |= cpu_avx512bw;
      if (zmm && bit(b, 31)) f |= cpu_avx512vl;
    }
#endif
    return f;
  }();
  return features;
}

// What the CPU needs for the kernels of `Arch`: the instruction sets xsimd's tag names, plus
// F16C for the avx families (kernels reached at run time convert fp16 with it) and AVX-512 VL
// for the avx512 ones (units built for AVX-512 use it in 256-bit code). x86 tags only.
template <class Arch>
constexpr std::uint32_t cpu_needs() noexcept {
  std::uint32_t f = 0;
  auto need = [&](auto base, std::uint32_t bits) {
    if (std::is_base_of_v<decltype(base), Arch>) f |= bits;
  };
  need(xsimd::sse2{}, cpu_sse2);
  need(xsimd::sse3{}, cpu_sse2 | cpu_sse3);
  need(xsimd::ssse3{}, cpu_ssse3);
  need(xsimd::sse4_1{}, cpu_sse4_1);
  need(xsimd::sse4_2{}, cpu_sse4_2);
  need(xsimd::fma3<xsimd::sse4_2>{}, cpu_fma);
  need(xsimd::fma4{}, cpu_fma4);
  need(xsimd::avx{}, cpu_sse2 | cpu_sse4_2 | cpu_avx | cpu_f16c);
  need(xsimd::fma3<xsimd::avx>{}, cpu_fma);
  need(xsimd::avx2{}, cpu_avx2);
  need(xsimd::fma3<xsimd::avx2>{}, cpu_fma);
  need(xsimd::avx512f{}, cpu_sse2 | cpu_sse4_2 | cpu_avx | cpu_f16c | cpu_fma | cpu_avx2 |
                             cpu_avx512f | cpu_avx512vl);
  need(xsimd::avx512cd{}, cpu_avx512cd);
  need(xsimd::avx512dq{}, cpu_avx512dq);
  need(xsimd::avx512bw{}, cpu_avx512bw);
  return f;
}

// Whether this unit's flags already promise what the kernels of `Arch` need (the unit runs
// only where they hold).
template <class Arch>
constexpr bool unit_runs() noexcept {
  if constexpr (is_scalar_arch<Arch>) {
    return true;
  } else {
    constexpr lane_isa isa = lane_isa_of<Arch>();
    return Arch::supported() &&
           (unit_targets_f16c || (isa != lane_isa::avx && isa != lane_isa::avx2));
  }
}

/// Whether the running CPU executes the kernels of `Arch` (an xsimd architecture or
/// `scalar_arch`). Free where the unit is built for `Arch`; else one load of a cached answer.
template <class Arch>
[[nodiscard]] bool cpu_runs() noexcept {
  if constexpr (unit_runs<Arch>()) {
    return true;
  } else if constexpr (lane_isa_of<Arch>() == lane_isa::generic) {
    return false;  // another processor family's architecture
  } else {
    constexpr std::uint32_t needs = cpu_needs<Arch>();
    return (host_cpu_features() & needs) == needs;
  }
}

// How good an architecture is, for "better than the unit's own": xsimd's own rank where it
// has one; from xsimd 13 on, one more than the number of instruction sets its kernels need
// (each x86 tag needs all that the tags it derives from need, and more).
template <class Arch>
constexpr unsigned arch_version() noexcept {
  if constexpr (is_scalar_arch<Arch>) {
    return 0;
  } else if constexpr (has_arch_version<Arch>) {
    return Arch::version();
  } else {
    return 1u + static_cast<unsigned>(std::popcount(cpu_needs<Arch>()));
  }
}

template <class... Archs>
constexpr bool best_first() noexcept {
  const unsigned v[] = {arch_version<Archs>()..., 0u};
  for (std::size_t i = 0; i + 1 < sizeof...(Archs); ++i) {
    if (v[i] <= v[i + 1]) return false;
  }
  return true;
}

template <class Unit, class Kernel>
decltype(auto) dispatch_upgrades(Kernel& kernel) {
  if (cpu_runs<Unit>()) return kernel(Unit{});
  return kernel(scalar_arch{});
}

template <class Unit, class Kernel, class Upgrade, class... Rest>
decltype(auto) dispatch_upgrades(Kernel& kernel) {
  if constexpr (arch_version<Upgrade>() <= arch_version<Unit>()) {
    // Never better than the unit's own: not even compiled, so a unit built for more never
    // holds a copy of a kernel that units built for less call at run time.
    return dispatch_upgrades<Unit, Kernel, Rest...>(kernel);
  } else {
    if (cpu_runs<Upgrade>()) return kernel(Upgrade{});
    return dispatch_upgrades<Unit, Kernel, Rest...>(kernel);
  }
}

/// Calls `kernel(Arch{})` for the first of `Upgrades` (best first) that the running CPU
/// executes and that is better (a higher xsimd version) than `Unit`, the architecture the
/// caller is built for; else `kernel(Unit{})`, or `kernel(scalar_arch{})` on a CPU that lacks
/// even what `Unit`'s kernels need. `kernel` must accept each of them and `scalar_arch`, with
/// one return type.
///
/// \code
///   auto crc = dispatch_arch<xsimd::default_arch, xsimd::sse4_2>(
///       [&](auto arch) { return crc32c_update<decltype(arch)>(~seed, p, n); });
/// \endcode
template <class Unit, class... Upgrades, class Kernel>
decltype(auto) dispatch_arch(Kernel&& kernel) {
  static_assert(((arch_version<Upgrades>() > 0) && ...), "upgrades are xsimd architectures");
  static_assert(best_first<Upgrades...>(), "upgrades are listed best first");
  return dispatch_upgrades<Unit, Kernel, Upgrades...>(kernel);
}

}  // namespace stellatrain::detail
