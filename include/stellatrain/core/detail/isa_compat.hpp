// SPDX-License-Identifier: Apache-2.0
// The one place that papers over which instruction sets a unit can name, and the architecture
// tags with the family each stands for. Kernels pick their paths by the architecture type
// (`if constexpr` on `lane_isa_of<Arch>()`); the gates here only make x86 intrinsics, and the
// attribute that compiles one function for an instruction set beyond the unit's flags,
// disappear where the compiler cannot target x86.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <type_traits>

// STELLATRAIN_X86_INTRINSICS: 1 where <immintrin.h> and GCC/Clang target attributes exist.
// Defining it to 0 first leaves only the portable paths.
#ifndef STELLATRAIN_X86_INTRINSICS
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define STELLATRAIN_X86_INTRINSICS 1
#else
#define STELLATRAIN_X86_INTRINSICS 0
#endif
#endif

#if STELLATRAIN_X86_INTRINSICS
#include <immintrin.h>
// Compiles one function for the named instruction sets ("avx2,f16c") whatever the unit's
// flags; inlinable into code built for at least those.
#define STELLATRAIN_TARGET(isas) __attribute__((target(isas)))
#else
#define STELLATRAIN_TARGET(isas)
#endif

namespace stellatrain {

/// Architecture tag that makes a selection kernel run its plain scalar loops instead of xsimd
/// batches. The scalar path defines the results: every SIMD architecture must agree with it
/// bit for bit (the tests compare them), so `scalar_arch` serves as the oracle of the kernels.
struct scalar_arch {
  static constexpr const char* name() noexcept { return "scalar"; }
};

}  // namespace stellatrain

namespace stellatrain::detail {

template <class Arch>
inline constexpr bool is_scalar_arch = std::is_same_v<Arch, scalar_arch>;

// The x86 family of an xsimd architecture, read off its type alone. In xsimd 8 avx512f does
// not derive from avx2, and avx (the base of avx2) not from sse2: each family is tested alone.
enum class lane_isa : std::uint8_t { generic, sse2, avx, avx2, avx512 };

template <class Arch>
constexpr lane_isa lane_isa_of() noexcept {
  if constexpr (!STELLATRAIN_X86_INTRINSICS) {
    return lane_isa::generic;
  } else if constexpr (std::is_base_of_v<xsimd::avx512f, Arch>) {
    return lane_isa::avx512;
  } else if constexpr (std::is_base_of_v<xsimd::avx2, Arch>) {
    return lane_isa::avx2;
  } else if constexpr (std::is_base_of_v<xsimd::avx, Arch>) {
    return lane_isa::avx;
  } else if constexpr (std::is_base_of_v<xsimd::sse2, Arch>) {
    return lane_isa::sse2;
  } else {
    return lane_isa::generic;
  }
}

// No xsimd architecture names F16C, so whether code inlined into a unit's kernels may use it
// is the unit's flag. (Every CPU with AVX2 has it: code the dispatch helper reaches at run time
// assumes it for the avx families, see cpu_dispatch.hpp.)
#if defined(__F16C__)
inline constexpr bool unit_targets_f16c = true;
#else
inline constexpr bool unit_targets_f16c = false;
#endif

}  // namespace stellatrain::detail
