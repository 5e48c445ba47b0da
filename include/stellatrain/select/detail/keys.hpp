// SPDX-License-Identifier: Apache-2.0
// Magnitude keys of the selection kernels: the raw bits of an element with the sign cleared,
// and conversions between keys, bits, values and magnitudes.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/float16.hpp>

#include <bit>
#include <cstdint>
#include <type_traits>

namespace stellatrain::detail {

/// Mask that clears the sign of a raw element: what remains is the magnitude key.
template <class T>
inline constexpr std::uint32_t key_mask_of = sizeof(T) == 4 ? 0x7fffffffu : 0x7fffu;

/// Largest finite magnitude key of `T` (keys above it are infinity, then NaNs).
template <class T>
inline constexpr std::uint32_t max_finite_key_of = std::is_same_v<T, float>
                                                       ? 0x7f7fffffu
                                                       : (std::is_same_v<T, fp16> ? 0x7bffu
                                                                                  : 0x7f7fu);

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

/// The magnitude (as a float) that a key of element type `T` stands for.
template <class T>
[[nodiscard]] inline float magnitude_of_key(std::uint32_t key) noexcept {
  return to_float(value_from_bits<T>(key));
}

/// The largest key of type `T` whose magnitude is at most `m` (m >= 0, finite or +inf).
template <class T>
[[nodiscard]] inline std::uint32_t key_at_most(float m) noexcept {
  if (!(m > 0.0f)) return 0;
  std::uint32_t key = raw_bits(from_float<T>(m)) & key_mask_of<T>;
  // Rounding may have gone up: step down until the key's magnitude is <= m.
  while (key > 0 && magnitude_of_key<T>(key) > m) --key;
  return key;
}

}  // namespace stellatrain::detail
