// SPDX-License-Identifier: Apache-2.0
// What the selection kernels read: the raw bits of each element as a 32-bit lane, either
// straight from a tensor or computed on the fly (error feedback: acc = g + residual, written
// back while it is read, so that selection and residual update share one pass over memory).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/detail/simd_lanes.hpp>

#include <bit>
#include <cstdint>
#include <type_traits>

namespace stellatrain::detail {

/// Mask that clears the sign of a raw element: what remains is the magnitude key.
template <class T>
inline constexpr std::uint32_t key_mask_of = sizeof(T) == 4 ? 0x7fffffffu : 0x7fffu;

/// Largest finite magnitude key of `T` (keys above it are infinity, then NaNs).
template <class T>
inline constexpr std::uint32_t max_finite_key_of =
    std::is_same_v<T, float> ? 0x7f7fffffu : (std::is_same_v<T, fp16> ? 0x7bffu : 0x7f7fu);

[[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t raw_bits(float x) noexcept { return std::bit_cast<std::uint32_t>(x); }
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

/// Reads a tensor of `T` as it is.
template <class T>
struct plain_source {
  using value_type = T;
  static constexpr std::uint32_t key_mask = key_mask_of<T>;
  const T* data = nullptr;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE typename lane_ops<Arch>::ibatch load(std::uint64_t i) const noexcept {
    if constexpr (std::is_same_v<T, float>) {
      return lane_ops<Arch>::load_bits(data + i);
    } else {
      // fp16 and bf16 are exactly their 16 bits (static_asserted in float16.hpp); the vector
      // load goes through an intrinsic, which may alias any type.
      return lane_ops<Arch>::load_bits(reinterpret_cast<const std::uint16_t*>(data + i));
    }
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    return raw_bits(data[i]);
  }
  /// Hints that element i will be read soon (a no-op past the end).
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept { __builtin_prefetch(data + i); }
  /// The bits `load` would return, without side effects (for sampling before the pass).
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept { return raw_bits(data[i]); }
  /// A source that reads the values of this pass again, after it ran.
  [[nodiscard]] plain_source reread() const noexcept { return *this; }
};

/// Error feedback: yields acc = g + r and stores acc into r while reading (one pass: read g
/// and r, write r). After the pass, r holds acc, which `reread()` reads.
struct error_feedback_source {
  using value_type = float;
  static constexpr std::uint32_t key_mask = key_mask_of<float>;
  const float* g = nullptr;
  float* r = nullptr;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE typename lane_ops<Arch>::ibatch load(std::uint64_t i) const noexcept {
    using fbatch = typename lane_ops<Arch>::fbatch;
    const fbatch acc = fbatch::load_unaligned(g + i) + fbatch::load_unaligned(r + i);
    acc.store_unaligned(r + i);
    return xsimd::bitwise_cast<typename lane_ops<Arch>::ibatch>(acc);
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    const float acc = g[i] + r[i];
    r[i] = acc;
    return raw_bits(acc);
  }
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept { return raw_bits(g[i] + r[i]); }
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept {
    __builtin_prefetch(g + i);
    __builtin_prefetch(r + i, 1);
  }
  [[nodiscard]] plain_source<float> reread() const noexcept { return {r}; }
};

/// Error feedback with DGC momentum correction: u = mu * u + g (momentum), v = v + u (the
/// accumulated, corrected gradient); yields v and stores u and v (read g, u, v; write u, v).
struct momentum_source {
  using value_type = float;
  static constexpr std::uint32_t key_mask = key_mask_of<float>;
  const float* g = nullptr;
  float* u = nullptr;
  float* v = nullptr;
  float mu = 0.0f;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE typename lane_ops<Arch>::ibatch load(std::uint64_t i) const noexcept {
    using fbatch = typename lane_ops<Arch>::fbatch;
    const fbatch m = fbatch::load_unaligned(u + i) * fbatch(mu) + fbatch::load_unaligned(g + i);
    const fbatch acc = fbatch::load_unaligned(v + i) + m;
    m.store_unaligned(u + i);
    acc.store_unaligned(v + i);
    return xsimd::bitwise_cast<typename lane_ops<Arch>::ibatch>(acc);
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    const float m = u[i] * mu + g[i];
    const float acc = v[i] + m;
    u[i] = m;
    v[i] = acc;
    return raw_bits(acc);
  }
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept { return raw_bits(v[i] + (u[i] * mu + g[i])); }
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept {
    __builtin_prefetch(g + i);
    __builtin_prefetch(u + i, 1);
    __builtin_prefetch(v + i, 1);
  }
  [[nodiscard]] plain_source<float> reread() const noexcept { return {v}; }
};

}  // namespace stellatrain::detail
