// SPDX-License-Identifier: Apache-2.0
// What the CPU selectors read: the `selection_source` concept and its three models, a plain
// tensor and the two error-feedback sources whose first read also updates the residual (and
// the momentum), so that selection and error feedback share one pass over memory.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/detail/keys.hpp>

#include <xsimd/xsimd.hpp>

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace stellatrain {

/// The raw bits of `width` elements as 32-bit lanes (fp16 and bf16 zero-extended), the unit
/// a SIMD selection kernel reads.
template <class Arch>
using selection_lanes = xsimd::batch<std::int32_t, Arch>;

/// The raw bits of `x`'s lanes as `selection_lanes` (what a source's `load` returns for fp32
/// values), the same with every supported xsimd version.
template <class Arch>
[[nodiscard]] STELLATRAIN_FORCE_INLINE selection_lanes<Arch> to_selection_lanes(
    const xsimd::batch<float, Arch>& x) noexcept {
  return detail::bitcast_lanes<std::int32_t>(x);
}

/// The elements a selector reads, as raw bits: a tensor as it is (`plain_source`), or values
/// computed while they are read (`error_feedback_source`: acc = g + r, stored back into r).
///
/// Requirements, for `const S& s`, an element index `i` (`std::uint64_t`) and an xsimd
/// architecture `Arch`:
/// - `S::value_type`: float, fp16 or bf16, the type whose raw bits the source yields, and
///   `S::key_mask`: a `std::uint32_t` that clears their sign bit (0x7fffffff or 0x7fff).
/// - `s.load_scalar(i)` -> `std::uint32_t`: the raw bits of element i.
/// - `s.template load<Arch>(i)` -> `selection_lanes<Arch>`: the raw bits of elements i ..
///   i + width - 1 (any SIMD architecture a selector is built for; not needed for
///   `scalar_arch`).
/// - The first pass of a selection call loads every element of [0, n) exactly once, through
///   `load` or `load_scalar`: a source may do work on that load (error feedback writes the
///   accumulated value back), which is why it must happen once.
/// - `s.peek(i)` -> `std::uint32_t`: what the load of element i would return, without its
///   effects (to sample before the pass); `s.prefetch(i)`: a hint that element i comes soon.
/// - `s.reread()`: a source without effects that yields what the first pass produced; later
///   passes and the emission read through it.
/// - `s.offset_by(b)`: a source of the same type whose element i is element b + i of `s` (a
///   slice of the tensor, for partitioned selection).
///
/// \code
///   // Selection of the k largest |x| that also counts how often each element was read.
///   struct counting_source {
///     using value_type = float;
///     static constexpr std::uint32_t key_mask = 0x7fffffffu;
///     const float* x;
///     std::uint32_t* reads;
///     std::uint32_t load_scalar(std::uint64_t i) const { ++reads[i]; return
///     std::bit_cast<std::uint32_t>(x[i]); } template <class Arch>
///     stellatrain::selection_lanes<Arch> load(std::uint64_t i) const {
///       for (std::size_t l = 0; l < stellatrain::selection_lanes<Arch>::size; ++l) ++reads[i + l];
///       return stellatrain::to_selection_lanes(xsimd::batch<float, Arch>::load_unaligned(x + i));
///     }
///     std::uint32_t peek(std::uint64_t i) const { return std::bit_cast<std::uint32_t>(x[i]); }
///     void prefetch(std::uint64_t) const {}
///     stellatrain::plain_source<float> reread() const { return {x}; }
///     counting_source offset_by(std::uint64_t b) const { return {x + b, reads + b}; }
///   };
/// \endcode
template <class S, class Arch = scalar_arch>
concept selection_source = value_type<typename S::value_type> && std::copy_constructible<S> &&
    requires(const S& s, std::uint64_t i) {
  { S::key_mask } -> std::convertible_to<std::uint32_t>;
  { s.load_scalar(i) } -> std::same_as<std::uint32_t>;
  { s.peek(i) } -> std::same_as<std::uint32_t>;
  s.prefetch(i);
  { s.reread().load_scalar(i) } -> std::same_as<std::uint32_t>;
  { s.offset_by(i) } -> std::same_as<S>;
} &&(std::is_same_v<Arch, scalar_arch> || requires(const S& s, std::uint64_t i) {
  { s.template load<Arch>(i) } -> std::same_as<selection_lanes<Arch>>;
});

/// Reads a tensor of `T` as it is.
template <value_type T>
struct plain_source {
  using value_type = T;
  static constexpr std::uint32_t key_mask = detail::key_mask_of<T>;
  const T* data = nullptr;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE selection_lanes<Arch> load(
      std::uint64_t i) const noexcept {
    if constexpr (std::is_same_v<T, float>) {
      return detail::lane_ops<Arch>::load_bits(data + i);
    } else {
      // fp16 and bf16 are exactly their 16 bits (static_asserted in float16.hpp); the vector
      // load goes through an intrinsic, which may alias any type.
      return detail::lane_ops<Arch>::load_bits(reinterpret_cast<const std::uint16_t*>(data + i));
    }
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    return detail::raw_bits(data[i]);
  }
  /// Hints that element i will be read soon (a no-op past the end).
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept {
    __builtin_prefetch(data + i);
  }
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept {
    return detail::raw_bits(data[i]);
  }
  [[nodiscard]] plain_source reread() const noexcept { return *this; }
  [[nodiscard]] plain_source offset_by(std::uint64_t b) const noexcept { return {data + b}; }
};

/// Error feedback: yields acc = g + r and stores acc into r while reading (one pass: read g
/// and r, write r). After the pass, r holds acc, which `reread()` reads.
struct error_feedback_source {
  using value_type = float;
  static constexpr std::uint32_t key_mask = detail::key_mask_of<float>;
  const float* g = nullptr;
  float* r = nullptr;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE selection_lanes<Arch> load(
      std::uint64_t i) const noexcept {
    using fbatch = typename detail::lane_ops<Arch>::fbatch;
    const fbatch acc = fbatch::load_unaligned(g + i) + fbatch::load_unaligned(r + i);
    acc.store_unaligned(r + i);
    return to_selection_lanes(acc);
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    const float acc = g[i] + r[i];
    r[i] = acc;
    return detail::raw_bits(acc);
  }
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept {
    return detail::raw_bits(g[i] + r[i]);
  }
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept {
    __builtin_prefetch(g + i);
    __builtin_prefetch(r + i, 1);
  }
  [[nodiscard]] plain_source<float> reread() const noexcept { return {r}; }
  [[nodiscard]] error_feedback_source offset_by(std::uint64_t b) const noexcept {
    return {g + b, r + b};
  }
};

/// Error feedback with DGC momentum correction: u = mu * u + g (momentum), v = v + u (the
/// accumulated, corrected gradient); yields v and stores u and v (read g, u, v; write u, v).
struct momentum_source {
  using value_type = float;
  static constexpr std::uint32_t key_mask = detail::key_mask_of<float>;
  const float* g = nullptr;
  float* u = nullptr;
  float* v = nullptr;
  float mu = 0.0f;

  template <class Arch>
  [[nodiscard]] STELLATRAIN_FORCE_INLINE selection_lanes<Arch> load(
      std::uint64_t i) const noexcept {
    using fbatch = typename detail::lane_ops<Arch>::fbatch;
    const fbatch m = fbatch::load_unaligned(u + i) * fbatch(mu) + fbatch::load_unaligned(g + i);
    const fbatch acc = fbatch::load_unaligned(v + i) + m;
    m.store_unaligned(u + i);
    acc.store_unaligned(v + i);
    return to_selection_lanes(acc);
  }
  [[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t load_scalar(std::uint64_t i) const noexcept {
    const float m = u[i] * mu + g[i];
    const float acc = v[i] + m;
    u[i] = m;
    v[i] = acc;
    return detail::raw_bits(acc);
  }
  [[nodiscard]] std::uint32_t peek(std::uint64_t i) const noexcept {
    return detail::raw_bits(v[i] + (u[i] * mu + g[i]));
  }
  STELLATRAIN_FORCE_INLINE void prefetch(std::uint64_t i) const noexcept {
    __builtin_prefetch(g + i);
    __builtin_prefetch(u + i, 1);
    __builtin_prefetch(v + i, 1);
  }
  [[nodiscard]] plain_source<float> reread() const noexcept { return {v}; }
  [[nodiscard]] momentum_source offset_by(std::uint64_t b) const noexcept {
    return {g + b, u + b, v + b, mu};
  }
};

static_assert(selection_source<plain_source<float>, xsimd::default_arch>);
static_assert(selection_source<plain_source<bf16>, xsimd::default_arch>);
static_assert(selection_source<error_feedback_source, xsimd::default_arch>);
static_assert(selection_source<momentum_source, xsimd::default_arch>);

namespace detail {

/// Runs the source's first pass over [0, n) without selecting anything (the error-feedback
/// update of elements no selection looks at).
template <class Arch, class Source, executor Ex>
void consume_source(Ex& ex, const Source& src, std::uint64_t n) {
  for_each_chunk(ex, n, std::uint64_t{32768}, [&](std::uint64_t b, std::uint64_t e) {
    std::uint64_t i = b;
    if constexpr (!is_scalar_arch<Arch>) {
      constexpr std::uint64_t w = lane_ops<Arch>::width;
      for (; i + w <= e; i += w) (void)src.template load<Arch>(i);
    }
    for (; i < e; ++i) (void)src.load_scalar(i);
  });
}

}  // namespace detail

}  // namespace stellatrain
