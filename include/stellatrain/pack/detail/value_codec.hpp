// SPDX-License-Identifier: Apache-2.0
// Conversion of value arrays (float, fp16, bf16) to and from the little-endian value payload of
// a section, with the exact round-to-nearest-even conversions of core/float16.hpp. Floats go
// through the vector loops of core/detail/value_convert.hpp (bit-identical to the scalar code,
// which the tests check).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/cpu_dispatch.hpp>
#include <stellatrain/core/detail/value_convert.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace stellatrain::detail {

// The vector part of the conversion of n floats to T at `out` (how many it converted). A unit
// built for less than AVX2 (a portable build) still uses F16C and AVX2 where the running CPU
// has them: without, fp16 payloads cost a scalar rounding per value. The wire is little-endian,
// as the vector code (x86 only) stores.
template <class Arch, class T>
std::size_t halves_from_floats_dispatched(const float* src, std::size_t n,
                                          std::byte* out) noexcept {
  if constexpr (std::endian::native != std::endian::little) {
    return 0;
  } else {
    return dispatch_arch<Arch, xsimd::avx2>(
        [&](auto arch) { return halves_from_floats<decltype(arch), T>(src, n, out); });
  }
}

template <class Arch, class T>
std::size_t floats_from_halves_dispatched(const std::byte* in, std::size_t n, float* dst) noexcept {
  if constexpr (std::endian::native != std::endian::little) {
    return 0;
  } else {
    return dispatch_arch<Arch, xsimd::avx2>(
        [&](auto arch) { return floats_from_halves<decltype(arch), T>(in, n, dst); });
  }
}

/// Writes n values as `enc` to `out` (n * value_bytes(enc) bytes). `Arch` is what the caller's
/// unit is built for; the conversion may use more where the CPU has it.
template <class V, class Arch = xsimd::default_arch>
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
      for (std::size_t i = 0; i < n; ++i)
        store_le<std::uint32_t>(out + 4 * i, float_bits(to_float(src[i])));
      return;
    case value_encoding::bf16: {
      std::size_t i = 0;
      if constexpr (std::is_same_v<V, float>)
        i = halves_from_floats_dispatched<Arch, bf16>(src, n, out);
      for (; i < n; ++i) store_le<std::uint16_t>(out + 2 * i, bf16(to_float(src[i])).bits());
      return;
    }
    case value_encoding::fp16: {
      std::size_t i = 0;
      if constexpr (std::is_same_v<V, float>)
        i = halves_from_floats_dispatched<Arch, fp16>(src, n, out);
      for (; i < n; ++i) store_le<std::uint16_t>(out + 2 * i, fp16(to_float(src[i])).bits());
      return;
    }
    case value_encoding::chunk_sign:  // chunked sections: detail/chunked_payload.hpp
    case value_encoding::chunk_2bit:
      return;
  }
}

/// Reads n values stored as `enc` at `in` into dst, converting to V (rounding to nearest even
/// when V is narrower than the wire type). `Arch` as for encode_values.
template <class V, class Arch = xsimd::default_arch>
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
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = from_float<V>(bits_float(load_le<std::uint32_t>(in + 4 * i)));
      return;
    case value_encoding::bf16: {
      std::size_t i = 0;
      if constexpr (std::is_same_v<V, float>)
        i = floats_from_halves_dispatched<Arch, bf16>(in, n, dst);
      for (; i < n; ++i)
        dst[i] = from_float<V>(float_from_bf16_bits(load_le<std::uint16_t>(in + 2 * i)));
      return;
    }
    case value_encoding::fp16: {
      std::size_t i = 0;
      if constexpr (std::is_same_v<V, float>)
        i = floats_from_halves_dispatched<Arch, fp16>(in, n, dst);
      for (; i < n; ++i)
        dst[i] = from_float<V>(float_from_fp16_bits(load_le<std::uint16_t>(in + 2 * i)));
      return;
    }
    case value_encoding::chunk_sign:  // chunked sections: detail/chunked_payload.hpp
    case value_encoding::chunk_2bit:
      return;
  }
}

}  // namespace stellatrain::detail
