// SPDX-License-Identifier: Apache-2.0
// Loads of float / fp16 / bf16 arrays as float batches and stores of float batches as float /
// fp16 / bf16, bit-identical to the scalar conversions of core/float16.hpp (round to nearest
// even, NaN kept quiet), with x86 paths per architecture and a portable fallback.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace stellatrain::detail {

template <class Arch>
inline constexpr bool arch_is_avx512 = std::is_base_of_v<xsimd::avx512f, Arch>;
template <class Arch>
inline constexpr bool arch_is_avx = std::is_base_of_v<xsimd::avx, Arch>;
template <class Arch>
inline constexpr bool arch_is_sse2 = std::is_base_of_v<xsimd::sse2, Arch>;

/// Loads `batch<float, Arch>::size` values of `T` from `p` (no alignment needed) as floats.
template <class Arch, class T>
STELLATRAIN_FORCE_INLINE xsimd::batch<float, Arch> load_as_float(const T* p) noexcept {
  using batch = xsimd::batch<float, Arch>;
  if constexpr (std::is_same_v<T, float>) {
    return batch::load_unaligned(p);
  } else {
#if defined(__AVX512F__)
    if constexpr (arch_is_avx512<Arch>) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (std::is_same_v<T, bf16>) {
        return batch(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      } else {
        return batch(_mm512_cvtph_ps(h));
      }
    }
#endif
#if defined(__AVX2__)
    if constexpr (arch_is_avx<Arch> && std::is_same_v<T, bf16>) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return batch(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
#endif
#if defined(__F16C__)
    if constexpr (arch_is_avx<Arch> && std::is_same_v<T, fp16>) {
      return batch(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    if constexpr (arch_is_sse2<Arch> && std::is_same_v<T, fp16>) {
      return batch(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
#endif
#if defined(__SSE2__)
    if constexpr (arch_is_sse2<Arch> && std::is_same_v<T, bf16>) {
      // Interleaving zeros below each 16-bit value is exactly "shift left by 16".
      const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return batch(_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h)));
    }
#endif
    alignas(64) float tmp[batch::size];
    for (std::size_t k = 0; k < batch::size; ++k) tmp[k] = to_float(p[k]);
    return batch::load_aligned(tmp);
  }
}

/// Stores the lanes of `x` to `p` (no alignment needed) as `T`, rounding to nearest even.
template <class Arch, class T>
STELLATRAIN_FORCE_INLINE void store_from_float(T* p, const xsimd::batch<float, Arch>& x) noexcept {
  using batch = xsimd::batch<float, Arch>;
  if constexpr (std::is_same_v<T, float>) {
    x.store_unaligned(p);
    return;
  } else {
#if defined(__AVX512F__)
    if constexpr (arch_is_avx512<Arch>) {
      __m256i h;
      if constexpr (std::is_same_v<T, fp16>) {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      } else {
        const __m512i bits = _mm512_castps_si512(x);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(
            r, nan, _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40)));
        h = _mm512_cvtepi32_epi16(r);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
      return;
    }
#endif
#if defined(__F16C__)
    if constexpr (arch_is_avx<Arch> && std::is_same_v<T, fp16>) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                       _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    }
    if constexpr (arch_is_sse2<Arch> && std::is_same_v<T, fp16>) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p),
                       _mm_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      return;
    }
#endif
#if defined(__AVX2__)
    if constexpr (arch_is_avx<Arch> && std::is_same_v<T, bf16>) {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
      const __m256i quiet_nan =
          _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, nan);
      // Values fit 16 bits, so unsigned saturation keeps them; packing works per 128-bit
      // lane, the permute puts the two lanes' results next to each other.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
      return;
    }
#endif
#if defined(__SSE2__)
    if constexpr (arch_is_sse2<Arch> && std::is_same_v<T, bf16>) {
      const __m128i bits = _mm_castps_si128(x);
      const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
      const __m128i rounded =
          _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7fff)), lsb), 16);
      const __m128i quiet_nan = _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40));
      const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(x, x));
      __m128i r = _mm_or_si128(_mm_and_si128(nan, quiet_nan), _mm_andnot_si128(nan, rounded));
      // SSE2 has only signed saturation: sign-extend the 16-bit values first so it keeps them.
      r = _mm_srai_epi32(_mm_slli_epi32(r, 16), 16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(r, r));
      return;
    }
#endif
    alignas(64) float tmp[batch::size];
    x.store_aligned(tmp);
    for (std::size_t k = 0; k < batch::size; ++k) p[k] = from_float<T>(tmp[k]);
  }
}

}  // namespace stellatrain::detail
