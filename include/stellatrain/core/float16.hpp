// SPDX-License-Identifier: Apache-2.0
// Host and device 16-bit floating-point value types: IEEE 754 binary16 (`fp16`) and bfloat16
// (`bf16`), with exact round-to-nearest-even conversion from float.
#pragma once

#include <stellatrain/config.hpp>

#include <bit>
#include <cstdint>
#include <type_traits>

namespace stellatrain {

namespace detail {

STELLATRAIN_HOST_DEVICE constexpr std::uint32_t float_bits(float f) noexcept {
#if STELLATRAIN_DEVICE_PASS
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}

STELLATRAIN_HOST_DEVICE constexpr float bits_float(std::uint32_t u) noexcept {
#if STELLATRAIN_DEVICE_PASS
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

// float -> binary16, round to nearest, ties to even, on the bit patterns alone (no FPU state,
// so the result is the same on every host, device and compiler flag set).
STELLATRAIN_HOST_DEVICE constexpr std::uint16_t fp16_bits_from_float(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    if (ax == 0x7f800000u) return sign | 0x7c00u;  // infinity
    // NaN: keep the sign and the top 10 payload bits, force the quiet bit (as F16C does).
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x03ffu));
  }
  // 65520 = 65504 + half an ulp: from there on the value rounds to infinity.
  if (ax >= 0x477ff000u) return sign | 0x7c00u;
  if (ax >= 0x38800000u) {  // normal binary16 range: rebias the exponent by 127 - 15
    const std::uint32_t h = (ax - 0x38000000u) >> 13;
    const std::uint32_t rest = ax & 0x1fffu;
    const std::uint32_t up = (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;
    // A carry out of the mantissa increments the exponent: still correct rounding.
    return static_cast<std::uint16_t>(sign | (h + up));
  }
  // Subnormal or zero: the result counts units of 2^-24.
  const std::uint32_t e = ax >> 23;
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  const std::uint32_t m = (ax & 0x007fffffu) | 0x00800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  const std::uint32_t h = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t up = (rest > half || (rest == half && (h & 1u))) ? 1u : 0u;
  return static_cast<std::uint16_t>(sign | (h + up));
}

// binary16 -> float, exact. A signalling NaN comes back quiet (as F16C does); its payload and
// sign are kept.
STELLATRAIN_HOST_DEVICE constexpr float float_from_fp16_bits(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x03ffu;
  if (exponent == 0x1fu) {
    const std::uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return bits_float(sign | 0x7f800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {
    // mantissa * 2^-24 is exact in float (a small integer times a power of two).
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> bfloat16, round to nearest, ties to even. The integer add carries into the exponent
// exactly as rounding should, also from the largest finite float into infinity.
STELLATRAIN_HOST_DEVICE constexpr std::uint16_t bf16_bits_from_float(float f) noexcept {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);  // NaN: keep sign, quiet it
  }
  const std::uint32_t lsb = (x >> 16) & 1u;
  return static_cast<std::uint16_t>((x + 0x7fffu + lsb) >> 16);
}

STELLATRAIN_HOST_DEVICE constexpr float float_from_bf16_bits(std::uint16_t b) noexcept {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

/// IEEE 754 binary16 value (1 sign, 5 exponent, 10 mantissa bits), usable on host and device.
///
/// Conversion from float rounds to nearest, ties to even: values from 65520 up become
/// infinity, values below 2^-25 in magnitude become signed zero, subnormals are exact, and
/// a NaN stays a NaN of the same sign (quiet; its top payload bits kept). Conversion to float
/// is exact. The layout is the 16 bits alone, so arrays of `fp16` can be copied to and from
/// CUDA `__half` arrays or the wire byte for byte.
///
/// \code
///   stellatrain::fp16 h{0.1f};            // rounds: 0.0999755859375
///   float back = static_cast<float>(h);   // exact
///   auto bits = h.bits();                 // 0x2e66
/// \endcode
class fp16 {
 public:
  fp16() = default;
  STELLATRAIN_HOST_DEVICE constexpr explicit fp16(float value) noexcept
      : bits_(detail::fp16_bits_from_float(value)) {}

  /// The value with exactly these 16 bits.
  [[nodiscard]] STELLATRAIN_HOST_DEVICE static constexpr fp16 from_bits(
      std::uint16_t bits) noexcept {
    fp16 h;
    h.bits_ = bits;
    return h;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint16_t bits() const noexcept {
    return bits_;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr float to_float() const noexcept {
    return detail::float_from_fp16_bits(bits_);
  }
  STELLATRAIN_HOST_DEVICE constexpr explicit operator float() const noexcept { return to_float(); }

  /// Bitwise equality (so NaN == NaN with the same bits, and +0 != -0).
  [[nodiscard]] STELLATRAIN_HOST_DEVICE friend constexpr bool same_bits(fp16 a, fp16 b) noexcept {
    return a.bits_ == b.bits_;
  }

 private:
  std::uint16_t bits_;
};

/// bfloat16 value (1 sign, 8 exponent, 7 mantissa bits: the exponent range of float), usable
/// on host and device.
///
/// Conversion from float rounds to nearest, ties to even (values past the largest finite bf16
/// round to infinity, subnormals round like any other value), and a NaN stays a NaN of the same
/// sign (quiet). Conversion to float is exact (the 16 bits become the top half of the float).
class bf16 {
 public:
  bf16() = default;
  STELLATRAIN_HOST_DEVICE constexpr explicit bf16(float value) noexcept
      : bits_(detail::bf16_bits_from_float(value)) {}

  [[nodiscard]] STELLATRAIN_HOST_DEVICE static constexpr bf16 from_bits(
      std::uint16_t bits) noexcept {
    bf16 b;
    b.bits_ = bits;
    return b;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint16_t bits() const noexcept {
    return bits_;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr float to_float() const noexcept {
    return detail::float_from_bf16_bits(bits_);
  }
  STELLATRAIN_HOST_DEVICE constexpr explicit operator float() const noexcept { return to_float(); }

  [[nodiscard]] STELLATRAIN_HOST_DEVICE friend constexpr bool same_bits(bf16 a, bf16 b) noexcept {
    return a.bits_ == b.bits_;
  }

 private:
  std::uint16_t bits_;
};

static_assert(sizeof(fp16) == 2 && alignof(fp16) == 2, "fp16 must be exactly 16 bits");
static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2, "bf16 must be exactly 16 bits");

/// Converts a float to `T` (float, fp16 or bf16), rounding to nearest even.
template <class T>
[[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr T from_float(float value) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return T(value);
  }
}

/// Converts float, fp16 or bf16 to float, exactly.
template <class T>
[[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr float to_float(T value) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return value.to_float();
  }
}

}  // namespace stellatrain
