// SPDX-License-Identifier: Apache-2.0
// Conversion of value arrays (float, fp16, bf16) to and from the little-endian value payload of
// a section, with the exact round-to-nearest-even conversions of core/float16.hpp. F16C does the
// float <-> fp16 conversions where the CPU has it (bit-identical to the scalar code, which the
// tests check).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define STELLATRAIN_PACK_X86 1
#else
#define STELLATRAIN_PACK_X86 0
#endif

namespace stellatrain::detail {

#if STELLATRAIN_PACK_X86
// F16C with the OS saving the AVX registers. cpuid is slow (and traps in virtual machines), so
// the answer, a fixed property of the machine, is computed once.
inline bool cpu_has_f16c() noexcept {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return false;
    const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
    if (!(osxsave && avx && f16c)) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    const std::uint64_t xcr0 = (static_cast<std::uint64_t>(hi) << 32) | lo;
    return (xcr0 & 6u) == 6u;  // the OS saves the XMM and YMM registers
  }();
  return has;
}

__attribute__((target("avx,f16c"))) inline std::size_t floats_to_fp16_f16c(const float* src, std::size_t n,
                                                                          std::byte* out) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), h);
  }
  return i;
}

__attribute__((target("avx,f16c"))) inline std::size_t fp16_to_floats_f16c(const std::byte* in, std::size_t n,
                                                                          float* dst) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  return i;
}
#endif

/// Writes n values as `enc` to `out` (n * value_bytes(enc) bytes).
template <class V>
void encode_values(const V* STELLATRAIN_RESTRICT src, std::size_t n, value_encoding enc,
                   std::byte* STELLATRAIN_RESTRICT out) noexcept {
  constexpr bool little = std::endian::native == std::endian::little;
  if (n == 0) return;  // src and out may be null then (memcpy's arguments may not)
  if (value_encoding_of<V> == enc && little) {
    std::memcpy(out, src, n * sizeof(V));
    return;
  }
  switch (enc) {
    case value_encoding::fp32:
      for (std::size_t i = 0; i < n; ++i) store_le<std::uint32_t>(out + 4 * i, float_bits(to_float(src[i])));
      return;
    case value_encoding::bf16:
      if constexpr (std::is_same_v<V, float>) {
        // A plain loop over the integer rounding, which the compiler vectorizes.
        for (std::size_t i = 0; i < n; ++i) store_le<std::uint16_t>(out + 2 * i, bf16_bits_from_float(src[i]));
      } else {
        for (std::size_t i = 0; i < n; ++i) store_le<std::uint16_t>(out + 2 * i, bf16(to_float(src[i])).bits());
      }
      return;
    case value_encoding::fp16: {
      std::size_t i = 0;
#if STELLATRAIN_PACK_X86
      if constexpr (std::is_same_v<V, float>) {
        if (cpu_has_f16c()) i = floats_to_fp16_f16c(src, n, out);
      }
#endif
      for (; i < n; ++i) store_le<std::uint16_t>(out + 2 * i, fp16(to_float(src[i])).bits());
      return;
    }
  }
}

/// Reads n values stored as `enc` at `in` into dst, converting to V (rounding to nearest even
/// when V is narrower than the wire type).
template <class V>
void decode_values(const std::byte* STELLATRAIN_RESTRICT in, std::size_t n, value_encoding enc,
                   V* STELLATRAIN_RESTRICT dst) noexcept {
  constexpr bool little = std::endian::native == std::endian::little;
  if (n == 0) return;  // in and dst may be null then (memcpy's arguments may not)
  if (value_encoding_of<V> == enc && little) {
    std::memcpy(dst, in, n * sizeof(V));
    return;
  }
  switch (enc) {
    case value_encoding::fp32:
      for (std::size_t i = 0; i < n; ++i) dst[i] = from_float<V>(bits_float(load_le<std::uint32_t>(in + 4 * i)));
      return;
    case value_encoding::bf16:
      if constexpr (std::is_same_v<V, float>) {
        for (std::size_t i = 0; i < n; ++i) dst[i] = float_from_bf16_bits(load_le<std::uint16_t>(in + 2 * i));
      } else {
        for (std::size_t i = 0; i < n; ++i) dst[i] = from_float<V>(float_from_bf16_bits(load_le<std::uint16_t>(in + 2 * i)));
      }
      return;
    case value_encoding::fp16: {
      std::size_t i = 0;
#if STELLATRAIN_PACK_X86
      if constexpr (std::is_same_v<V, float>) {
        if (cpu_has_f16c()) i = fp16_to_floats_f16c(in, n, dst);
      }
#endif
      for (; i < n; ++i) dst[i] = from_float<V>(float_from_fp16_bits(load_le<std::uint16_t>(in + 2 * i)));
      return;
    }
  }
}

}  // namespace stellatrain::detail
