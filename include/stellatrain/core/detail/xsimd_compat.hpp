// SPDX-License-Identifier: Apache-2.0
// The one place that papers over differences between xsimd versions (Debian 12 ships 8.1;
// newer releases renamed some functions). Code elsewhere calls these wrappers only.
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

}  // namespace stellatrain::detail
