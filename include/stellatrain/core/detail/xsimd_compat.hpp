// SPDX-License-Identifier: Apache-2.0
// The one place that papers over differences between xsimd versions: Debian 12 ships 8.1,
// vcpkg 14.3, and between them `hadd` became `reduce_add` (9), `bitwise_cast` took the element
// type instead of the batch (11), `batch_constant` took the element type and the architecture
// instead of the batch and architectures lost their `version()` (13). Code elsewhere uses these
// wrappers only.
#pragma once

#include <xsimd/xsimd.hpp>

#include <cstddef>
#include <type_traits>

namespace stellatrain::detail {

/// Whether `xsimd::swizzle` of 32-bit lanes exists for `Arch`: xsimd 8 has none for plain AVX
/// (only from AVX2 on).
template <class Arch>
inline constexpr bool has_swizzle32 =
    !std::is_base_of_v<xsimd::avx, Arch> || std::is_base_of_v<xsimd::avx2, Arch>;

/// Sum of the lanes of a batch: `hadd` before xsimd 9, `reduce_add` from 9 on.
template <class T, class Arch>
[[nodiscard]] inline T reduce_add(const xsimd::batch<T, Arch>& b) noexcept {
#if XSIMD_VERSION_MAJOR < 9
  return xsimd::hadd(b);
#else
  return xsimd::reduce_add(b);
#endif
}

/// Largest lane of a batch: `hmax` does not exist before xsimd 9, so 8.x reduces by hand.
template <class T, class Arch>
[[nodiscard]] inline T reduce_max(const xsimd::batch<T, Arch>& b) noexcept {
#if XSIMD_VERSION_MAJOR < 9
  alignas(Arch::alignment()) T lanes[xsimd::batch<T, Arch>::size];
  b.store_aligned(lanes);
  T m = lanes[0];
  for (std::size_t i = 1; i < xsimd::batch<T, Arch>::size; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
#else
  return xsimd::reduce_max(b);
#endif
}

/// The lanes of `x` reinterpreted as `To` (an element type of the same width).
template <class To, class T, class Arch>
[[nodiscard]] inline xsimd::batch<To, Arch> bitcast_lanes(const xsimd::batch<T, Arch>& x) noexcept {
  static_assert(sizeof(To) == sizeof(T), "lanes keep their width");
#if XSIMD_VERSION_MAJOR < 11
  return xsimd::bitwise_cast<xsimd::batch<To, Arch>>(x);
#else
  return xsimd::bitwise_cast<To>(x);
#endif
}

/// The compile-time batch of `Batch` with lanes `Values` (for `xsimd::swizzle` and masks).
template <class Batch, typename Batch::value_type... Values>
using batch_constant =
#if XSIMD_VERSION_MAJOR < 13
    xsimd::batch_constant<Batch, Values...>;
#else
    xsimd::batch_constant<typename Batch::value_type, typename Batch::arch_type, Values...>;
#endif

/// Whether the xsimd architecture tag `Arch` ranks itself (`Arch::version()`, before xsimd 13).
template <class Arch>
inline constexpr bool has_arch_version = requires {
  Arch::version();
};

}  // namespace stellatrain::detail
