// SPDX-License-Identifier: Apache-2.0
// Element types the library moves around (gradient values and sparse indices), as C++ types
// constrained by concepts and as a runtime tag for formats that carry the type.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace stellatrain {

/// A gradient or parameter value type: `float`, `fp16` or `bf16`.
template <class T>
concept value_type = std::same_as<T, float> || std::same_as<T, fp16> || std::same_as<T, bf16>;

/// A sparse index type: `std::uint32_t` (tensors below 2^32 elements) or `std::uint64_t`.
template <class T>
concept index_type = std::same_as<T, std::uint32_t> || std::same_as<T, std::uint64_t>;

/// Runtime tag of an element type; the numeric values are stable (formats store them).
enum class dtype : std::uint8_t {
  f32 = 1,
  f16 = 2,
  bf16 = 3,
  u16 = 4,
  u32 = 5,
  u64 = 6,
};

/// Bytes per element of `t`; 0 for a value that is not a known tag.
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f16:
    case dtype::bf16:
    case dtype::u16:
      return 2;
    case dtype::f32:
    case dtype::u32:
      return 4;
    case dtype::u64:
      return 8;
  }
  return 0;
}

/// Short lower-case name of `t` ("f32", "bf16", ...); "unknown" for other values.
[[nodiscard]] constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::u16:
      return "u16";
    case dtype::u32:
      return "u32";
    case dtype::u64:
      return "u64";
  }
  return "unknown";
}

namespace detail {
template <class T>
struct dtype_of_impl;
template <>
struct dtype_of_impl<float> {
  static constexpr dtype value = dtype::f32;
};
template <>
struct dtype_of_impl<fp16> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of_impl<bf16> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of_impl<std::uint16_t> {
  static constexpr dtype value = dtype::u16;
};
template <>
struct dtype_of_impl<std::uint32_t> {
  static constexpr dtype value = dtype::u32;
};
template <>
struct dtype_of_impl<std::uint64_t> {
  static constexpr dtype value = dtype::u64;
};
}  // namespace detail

/// The tag of a C++ element type (cv-qualifiers ignored): `dtype_of<bf16> == dtype::bf16`.
template <class T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

}  // namespace stellatrain
