// SPDX-License-Identifier: Apache-2.0
// The float <-> fp16 / bf16 conversions of every vector kernel, bit-identical to the scalar
// ones of core/float16.hpp (round to nearest even, NaN kept quiet): loads and stores of one
// batch<float, Arch> for kernels over xsimd, and loops over arrays for callers that choose the
// architecture at run time (cpu_dispatch.hpp). Both levels share the register code below; the
// architecture type picks it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>
#include <stellatrain/core/float16.hpp>

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace stellatrain::detail {

// One register of W floats to and from W 16-bit values of type T in memory (no alignment),
// per x86 family; defined below for the pairs that have instructions.
template <lane_isa Isa, class T>
struct half_lanes;

// Array loops of one family, compiled for its instruction set so that the register code
// inlines into them whatever the unit's flags. `Arch`, the architecture they run for, only
// names the copy: units built for more than a loop's family (whose copy may use all of it)
// never share theirs with units that reach the loop at run time, as the linker keeps one copy
// of each inline function.
template <lane_isa Isa>
struct half_loops;

#if STELLATRAIN_X86_INTRINSICS

template <>
struct half_lanes<lane_isa::sse2, bf16> {
  static constexpr std::size_t width = 4;
  STELLATRAIN_TARGET("sse2") STELLATRAIN_FORCE_INLINE static __m128 load(const void* p) noexcept {
    // Interleaving zeros below each 16-bit value is exactly "shift left by 16".
    const __m128i h = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
  }
  STELLATRAIN_TARGET("sse2")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m128 x) noexcept {
    const __m128i bits = _mm_castps_si128(x);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
    const __m128i rounded =
        _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7fff)), lsb), 16);
    const __m128i quiet_nan = _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40));
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(x, x));
    __m128i r = _mm_or_si128(_mm_and_si128(nan, quiet_nan), _mm_andnot_si128(nan, rounded));
    // SSE2 has only signed saturation: sign-extend the 16-bit values first so it keeps them.
    r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
    _mm_storel_epi64(static_cast<__m128i*>(p), _mm_packs_epi32(r, r));
  }
};

template <>
struct half_lanes<lane_isa::sse2, fp16> {
  static constexpr std::size_t width = 4;
  STELLATRAIN_TARGET("avx,f16c")
  STELLATRAIN_FORCE_INLINE static __m128 load(const void* p) noexcept {
    return _mm_cvtph_ps(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  STELLATRAIN_TARGET("avx,f16c")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m128 x) noexcept {
    _mm_storel_epi64(static_cast<__m128i*>(p),
                     _mm_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <>
struct half_lanes<lane_isa::avx, fp16> {
  static constexpr std::size_t width = 8;
  STELLATRAIN_TARGET("avx,f16c")
  STELLATRAIN_FORCE_INLINE static __m256 load(const void* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  STELLATRAIN_TARGET("avx,f16c")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m256 x) noexcept {
    _mm_storeu_si128(static_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

template <>
struct half_lanes<lane_isa::avx2, fp16> : half_lanes<lane_isa::avx, fp16> {};

template <>
struct half_lanes<lane_isa::avx2, bf16> {
  static constexpr std::size_t width = 8;
  STELLATRAIN_TARGET("avx2") STELLATRAIN_FORCE_INLINE static __m256 load(const void* p) noexcept {
    const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  STELLATRAIN_TARGET("avx2")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m256 x) noexcept {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, nan);
    // Values fit 16 bits, so unsigned saturation keeps them; packing works per 128-bit
    // lane, the permute puts the two lanes' results next to each other.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

// GCC 12's unmasked AVX-512 intrinsics start from a deliberately undefined register, which its
// -Wmaybe-uninitialized then reports (GCC bug 105593); the zero-masked forms with every lane
// set compile to the same instructions without it.
template <>
struct half_lanes<lane_isa::avx512, fp16> {
  static constexpr std::size_t width = 16;
  STELLATRAIN_TARGET("avx512f")
  STELLATRAIN_FORCE_INLINE static __m512 load(const void* p) noexcept {
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    return _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xffff), h);
  }
  STELLATRAIN_TARGET("avx512f")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m512 x) noexcept {
    const __m256i h = _mm512_maskz_cvtps_ph(static_cast<__mmask16>(0xffff), x,
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(static_cast<__m256i*>(p), h);
  }
};

template <>
struct half_lanes<lane_isa::avx512, bf16> {
  static constexpr std::size_t width = 16;
  STELLATRAIN_TARGET("avx512f")
  STELLATRAIN_FORCE_INLINE static __m512 load(const void* p) noexcept {
    constexpr auto all = static_cast<__mmask16>(0xffff);
    const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(all, _mm512_maskz_cvtepu16_epi32(all, h), 16));
  }
  STELLATRAIN_TARGET("avx512f")
  STELLATRAIN_FORCE_INLINE static void store(void* p, __m512 x) noexcept {
    constexpr auto all = static_cast<__mmask16>(0xffff);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i high = _mm512_maskz_srli_epi32(all, bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_maskz_srli_epi32(
        all, _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r =
        _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(all, r));
  }
};

template <>
struct half_loops<lane_isa::sse2> {
  template <class Arch, class T>
  STELLATRAIN_TARGET("sse2")
  static std::size_t from_floats(const float* src, std::size_t n, std::byte* out) noexcept {
    std::size_t i = 0;
    for (; i + 4 <= n; i += 4)
      half_lanes<lane_isa::sse2, T>::store(out + 2 * i, _mm_loadu_ps(src + i));
    return i;
  }
  template <class Arch, class T>
  STELLATRAIN_TARGET("sse2")
  static std::size_t to_floats(const std::byte* in, std::size_t n, float* dst) noexcept {
    std::size_t i = 0;
    for (; i + 4 <= n; i += 4)
      _mm_storeu_ps(dst + i, half_lanes<lane_isa::sse2, T>::load(in + 2 * i));
    return i;
  }
};

template <>
struct half_loops<lane_isa::avx> {
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx,f16c")
  static std::size_t from_floats(const float* src, std::size_t n, std::byte* out) noexcept {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
      half_lanes<lane_isa::avx, T>::store(out + 2 * i, _mm256_loadu_ps(src + i));
    return i;
  }
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx,f16c")
  static std::size_t to_floats(const std::byte* in, std::size_t n, float* dst) noexcept {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, half_lanes<lane_isa::avx, T>::load(in + 2 * i));
    return i;
  }
};

template <>
struct half_loops<lane_isa::avx2> {
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx2")
  static std::size_t from_floats(const float* src, std::size_t n, std::byte* out) noexcept {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
      half_lanes<lane_isa::avx2, T>::store(out + 2 * i, _mm256_loadu_ps(src + i));
    return i;
  }
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx2")
  static std::size_t to_floats(const std::byte* in, std::size_t n, float* dst) noexcept {
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, half_lanes<lane_isa::avx2, T>::load(in + 2 * i));
    return i;
  }
};

template <>
struct half_loops<lane_isa::avx512> {
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx512f")
  static std::size_t from_floats(const float* src, std::size_t n, std::byte* out) noexcept {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16)
      half_lanes<lane_isa::avx512, T>::store(out + 2 * i, _mm512_loadu_ps(src + i));
    return i;
  }
  template <class Arch, class T>
  STELLATRAIN_TARGET("avx512f")
  static std::size_t to_floats(const std::byte* in, std::size_t n, float* dst) noexcept {
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, half_lanes<lane_isa::avx512, T>::load(in + 2 * i));
    return i;
  }
};

#endif  // STELLATRAIN_X86_INTRINSICS

// The family whose registers convert T inside kernels over batch<float, Arch>: the batch's
// own, where it has the instructions (F16C only with the unit's flag: the code inlines into
// the unit's).
template <class Arch, class T>
constexpr lane_isa batch_convert_isa() noexcept {
  constexpr lane_isa isa = lane_isa_of<Arch>();
  if constexpr (isa == lane_isa::avx512) {
    return isa;
  } else if constexpr (std::is_same_v<T, fp16>) {
    return isa != lane_isa::generic && unit_targets_f16c ? isa : lane_isa::generic;
  } else {
    return isa == lane_isa::sse2 || isa == lane_isa::avx2 ? isa : lane_isa::generic;
  }
}

// The family whose loops convert arrays of T for `Arch`. The avx families convert fp16 with
// F16C: kernels reached through cpu_dispatch.hpp run where the CPU has it.
template <class Arch, class T>
constexpr lane_isa array_convert_isa() noexcept {
  constexpr lane_isa isa = lane_isa_of<Arch>();
  if constexpr (isa == lane_isa::avx512 || isa == lane_isa::generic) {
    return isa;
  } else if constexpr (std::is_same_v<T, fp16>) {
    return isa == lane_isa::sse2 ? lane_isa::generic : lane_isa::avx;
  } else {
    return isa == lane_isa::avx2 ? isa : lane_isa::sse2;
  }
}

/// Loads `batch<float, Arch>::size` values of `T` (float, fp16 or bf16) from `p` (no alignment
/// needed) as floats, exactly.
template <class Arch, class T>
STELLATRAIN_FORCE_INLINE xsimd::batch<float, Arch> load_as_float(const T* p) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr lane_isa isa = batch_convert_isa<Arch, T>();
  if constexpr (std::is_same_v<T, float>) {
    return batch::load_unaligned(p);
  } else if constexpr (isa != lane_isa::generic) {
    return batch(half_lanes<isa, T>::load(p));
  } else {
    alignas(64) float tmp[batch::size];
    for (std::size_t k = 0; k < batch::size; ++k) tmp[k] = to_float(p[k]);
    return batch::load_aligned(tmp);
  }
}

/// Stores the lanes of `x` to `p` (no alignment needed) as `T`, rounding to nearest even.
template <class Arch, class T>
STELLATRAIN_FORCE_INLINE void store_from_float(T* p, const xsimd::batch<float, Arch>& x) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr lane_isa isa = batch_convert_isa<Arch, T>();
  if constexpr (std::is_same_v<T, float>) {
    x.store_unaligned(p);
  } else if constexpr (isa != lane_isa::generic) {
    half_lanes<isa, T>::store(p, x);
  } else {
    alignas(64) float tmp[batch::size];
    x.store_aligned(tmp);
    for (std::size_t k = 0; k < batch::size; ++k) p[k] = from_float<T>(tmp[k]);
  }
}

/// Converts src[0, m) to T (fp16 or bf16) at `out`, 2 bytes per value in the byte order of the
/// host, where m is the largest multiple of Arch's vector width up to n; returns m (0 where
/// Arch has no vector path for T). The caller converts the rest.
template <class Arch, class T>
std::size_t halves_from_floats(const float* src, std::size_t n, std::byte* out) noexcept {
  constexpr lane_isa isa = array_convert_isa<Arch, T>();
  if constexpr (isa == lane_isa::generic) {
    return 0;
  } else {
    return half_loops<isa>::template from_floats<Arch, T>(src, n, out);
  }
}

/// Converts the first m of the n values of T at `in` (as halves_from_floats writes them) to
/// floats at `dst`, exactly; returns m.
template <class Arch, class T>
std::size_t floats_from_halves(const std::byte* in, std::size_t n, float* dst) noexcept {
  constexpr lane_isa isa = array_convert_isa<Arch, T>();
  if constexpr (isa == lane_isa::generic) {
    return 0;
  } else {
    return half_loops<isa>::template to_floats<Arch, T>(in, n, dst);
  }
}

}  // namespace stellatrain::detail
