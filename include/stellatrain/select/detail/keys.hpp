// SPDX-License-Identifier: Apache-2.0
// Magnitude keys, the one ranking of every selection kernel on host and device: an element
// ranks by the bit pattern of |x| read as an unsigned integer (+0 == -0, +inf above every
// finite value, NaN above +inf; ties go to the lowest index). Conversions between keys, bits,
// values and magnitudes; the STELLATRAIN_HOST_DEVICE functions serve the .cuh kernels too.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>

#include <bit>
#include <cstdint>
#include <type_traits>

namespace stellatrain::detail {

/// Mask that clears the sign of a raw element: what remains is the magnitude key.
template <class T>
inline constexpr std::uint32_t key_mask_of = sizeof(T) == 4 ? 0x7fffffffu : 0x7fffu;

/// Significant bits of the magnitude key of `T`: 31 for float, 15 for fp16/bf16.
template <class T>
inline constexpr std::uint32_t magnitude_key_bits =
    static_cast<std::uint32_t>(std::popcount(key_mask_of<T>));

/// The key of +infinity in `T` (keys above it are NaNs).
template <class T>
inline constexpr std::uint32_t infinity_key = std::is_same_v<T, float>  ? 0x7f800000u
                                              : std::is_same_v<T, fp16> ? 0x7c00u
                                                                        : 0x7f80u;

STELLATRAIN_HOST_DEVICE constexpr std::uint32_t magnitude_key(float x) noexcept {
  return float_bits(x) & key_mask_of<float>;
}
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t magnitude_key(fp16 x) noexcept {
  return x.bits() & key_mask_of<fp16>;
}
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t magnitude_key(bf16 x) noexcept {
  return x.bits() & key_mask_of<bf16>;
}

/// The non-negative value (as a float) whose magnitude key of element type `T` is `key`.
template <class T>
STELLATRAIN_HOST_DEVICE constexpr float key_value(std::uint32_t key) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return bits_float(key);
  } else {
    return T::from_bits(static_cast<std::uint16_t>(key)).to_float();
  }
}

// The raw bits of an element and back, as the CPU kernels store candidates (sign included).
[[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t raw_bits(float x) noexcept {
  return std::bit_cast<std::uint32_t>(x);
}
[[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t raw_bits(fp16 x) noexcept { return x.bits(); }
[[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t raw_bits(bf16 x) noexcept { return x.bits(); }

template <class T>
[[nodiscard]] STELLATRAIN_FORCE_INLINE T value_from_bits(std::uint32_t bits) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(bits);
  } else {
    return T::from_bits(static_cast<std::uint16_t>(bits));
  }
}

/// The largest key of type `T` whose magnitude is at most `m` (m >= 0, finite or +inf).
template <class T>
[[nodiscard]] inline std::uint32_t key_at_most(float m) noexcept {
  if (!(m > 0.0f)) return 0;
  std::uint32_t key = magnitude_key(from_float<T>(m));
  // Rounding may have gone up: step down until the key's magnitude is <= m.
  while (key > 0 && key_value<T>(key) > m) --key;
  return key;
}

}  // namespace stellatrain::detail
