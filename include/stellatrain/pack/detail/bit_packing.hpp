// SPDX-License-Identifier: Apache-2.0
// Bit packing of 32-bit values at a width of 0..32 bits: the vertical layout of full 256-value
// blocks (SIMD, 8 interleaved 32-bit lanes) and the horizontal layout of shorter blocks, plus
// LEB128 varints. Scalar versions are the test oracles of the SIMD ones.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <xsimd/xsimd.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace stellatrain::detail {

// Vertical layout of a block of 256 values v[0..255] at width b: value j goes to lane j % 8,
// slot j / 8. Lane l is a little-endian bit stream of its 32 values, b bits each (slot s at bits
// [s*b, s*b + b)), cut into b 32-bit words; word w of lane l is stored at byte (8*w + l) * 4.
// The block takes 32 * b bytes. One 8-lane SIMD register holds the same word of every lane,
// so packing and unpacking are shifts and masks with no shuffles.
inline constexpr std::size_t vertical_lanes = 8;

[[nodiscard]] constexpr std::uint32_t low_mask32(unsigned b) noexcept {
  return b >= 32 ? 0xffffffffu : (std::uint32_t{1} << b) - 1u;
}

inline void pack_vertical_scalar(const std::uint32_t* v, unsigned b, std::byte* out) noexcept {
  for (std::size_t lane = 0; lane < vertical_lanes; ++lane) {
    std::uint64_t acc = 0;
    unsigned fill = 0;
    std::size_t word = 0;
    for (std::size_t s = 0; s < wire::block_elements / vertical_lanes; ++s) {
      acc |= static_cast<std::uint64_t>(v[s * vertical_lanes + lane] & low_mask32(b)) << fill;
      fill += b;
      if (fill >= 32) {
        store_le<std::uint32_t>(out + (word * vertical_lanes + lane) * 4,
                                static_cast<std::uint32_t>(acc));
        acc >>= 32;
        fill -= 32;
        ++word;
      }
    }
  }
}

inline void unpack_vertical_scalar(const std::byte* in, unsigned b, std::uint32_t* v) noexcept {
  const std::uint32_t mask = low_mask32(b);
  for (std::size_t lane = 0; lane < vertical_lanes; ++lane) {
    for (std::size_t s = 0; s < wire::block_elements / vertical_lanes; ++s) {
      if (b == 0) {
        v[s * vertical_lanes + lane] = 0;
        continue;
      }
      const std::size_t bit = s * b;
      const std::size_t word = bit / 32;
      const unsigned shift = static_cast<unsigned>(bit % 32);
      std::uint64_t x = load_le<std::uint32_t>(in + (word * vertical_lanes + lane) * 4) >> shift;
      if (shift + b > 32) {
        x |= static_cast<std::uint64_t>(
                 load_le<std::uint32_t>(in + ((word + 1) * vertical_lanes + lane) * 4))
             << (32 - shift);
      }
      v[s * vertical_lanes + lane] = static_cast<std::uint32_t>(x) & mask;
    }
  }
}

// SIMD versions: a batch of W = 4 or 8 lanes covers lanes [h, h + W) of the layout. AVX-512
// architectures use their AVX2 batches (vertical_arch); scalar architectures and big-endian
// hosts use the scalar code.
// GCC's AddressSanitizer builds use the scalar code too: instrumenting the unrolled kernels
// (33 widths x 32 slots, per architecture) takes GCC gigabytes and many minutes per translation
// unit. The optimised builds test the SIMD kernels against the scalar ones; clang's fuzzing
// build (scripts/fuzz) runs them under AddressSanitizer.
#if defined(__SANITIZE_ADDRESS__) && !defined(__clang__)
inline constexpr bool vertical_simd_enabled = false;
#else
inline constexpr bool vertical_simd_enabled = true;
#endif

template <class Arch>
inline constexpr bool vertical_simd = vertical_simd_enabled&& std::endian::native ==
                                          std::endian::little &&
                                      (xsimd::batch<std::uint32_t, Arch>::size == 4 ||
                                       xsimd::batch<std::uint32_t, Arch>::size == 8);

// The architecture whose batches the vertical kernels of Arch use.
template <class Arch>
using vertical_arch =
    std::conditional_t<XSIMD_WITH_AVX2 && xsimd::batch<std::uint32_t, Arch>::size == 16,
                       xsimd::avx2, Arch>;

// One width B fixed at compile time and the 32 slots unrolled: every shift, store and word
// boundary is a constant, so the kernel is straight-line shifts, ORs and stores (no branches).
// A loop that the compiler unrolls, rather than one template per slot, keeps the number of
// instantiations (and the compile time of a translation unit that packs) down.
template <unsigned B, class Arch>
void pack_vertical_fixed(const std::uint32_t* v, std::byte* out) noexcept {
  using batch = xsimd::batch<std::uint32_t, Arch>;
  if constexpr (B > 0) {
    auto* const words = reinterpret_cast<std::uint32_t*>(out);
    const batch mask(low_mask32(B));
    for (std::size_t h = 0; h < vertical_lanes; h += batch::size) {
      batch acc(0u);
#pragma GCC unroll 32
      for (unsigned s = 0; s < wire::block_elements / vertical_lanes; ++s) {
        const unsigned fill = s * B % 32;
        const batch x = batch::load_unaligned(v + s * vertical_lanes + h) & mask;
        acc = fill == 0 ? x : acc | (x << static_cast<std::int32_t>(fill));
        if (fill + B >= 32) {
          acc.store_unaligned(words + s * B / 32 * vertical_lanes + h);
          if (fill + B > 32) acc = x >> static_cast<std::int32_t>(32 - fill);
        }
      }
    }
  }
}

template <unsigned B, class Arch>
void unpack_vertical_fixed(const std::byte* in, std::uint32_t* v) noexcept {
  using batch = xsimd::batch<std::uint32_t, Arch>;
  if constexpr (B == 0) {
    std::memset(v, 0, wire::block_elements * sizeof(std::uint32_t));
  } else {
    const auto* const words = reinterpret_cast<const std::uint32_t*>(in);
    const batch mask(low_mask32(B));
    for (std::size_t h = 0; h < vertical_lanes; h += batch::size) {
#pragma GCC unroll 32
      for (unsigned s = 0; s < wire::block_elements / vertical_lanes; ++s) {
        const unsigned shift = s * B % 32;
        const std::uint32_t* w = words + s * B / 32 * vertical_lanes + h;
        batch x = batch::load_unaligned(w);
        if (shift != 0) x = x >> static_cast<std::int32_t>(shift);
        if (shift + B > 32)
          x = x |
              (batch::load_unaligned(w + vertical_lanes) << static_cast<std::int32_t>(32 - shift));
        if (B < 32) x = x & mask;
        x.store_unaligned(v + s * vertical_lanes + h);
      }
    }
  }
}

// Calls the instantiation for width b in [Lo, Hi] through a binary tree of comparisons (six
// levels, predicted well since neighbouring blocks share widths).
template <class Arch, unsigned Lo, unsigned Hi>
STELLATRAIN_FORCE_INLINE void pack_vertical_dispatch(unsigned b, const std::uint32_t* v,
                                                     std::byte* out) noexcept {
  if constexpr (Lo == Hi) {
    pack_vertical_fixed<Lo, Arch>(v, out);
  } else {
    constexpr unsigned mid = (Lo + Hi) / 2;
    if (b <= mid) {
      pack_vertical_dispatch<Arch, Lo, mid>(b, v, out);
    } else {
      pack_vertical_dispatch<Arch, mid + 1, Hi>(b, v, out);
    }
  }
}

template <class Arch, unsigned Lo, unsigned Hi>
STELLATRAIN_FORCE_INLINE void unpack_vertical_dispatch(unsigned b, const std::byte* in,
                                                       std::uint32_t* v) noexcept {
  if constexpr (Lo == Hi) {
    unpack_vertical_fixed<Lo, Arch>(in, v);
  } else {
    constexpr unsigned mid = (Lo + Hi) / 2;
    if (b <= mid) {
      unpack_vertical_dispatch<Arch, Lo, mid>(b, in, v);
    } else {
      unpack_vertical_dispatch<Arch, mid + 1, Hi>(b, in, v);
    }
  }
}

/// Packs v[0..255] (only their low b bits are used, b <= 32) into 32 * b bytes at `out`.
template <class Arch = xsimd::default_arch>
void pack_vertical(const std::uint32_t* v, unsigned b, std::byte* out) noexcept {
  if constexpr (!vertical_simd<vertical_arch<Arch>>) {
    pack_vertical_scalar(v, b, out);
  } else {
    pack_vertical_dispatch<vertical_arch<Arch>, 0, 32>(b, v, out);
  }
}

/// Unpacks 256 values of b bits (b <= 32) from the 32 * b bytes at `in`.
template <class Arch = xsimd::default_arch>
void unpack_vertical(const std::byte* in, unsigned b, std::uint32_t* v) noexcept {
  if constexpr (!vertical_simd<vertical_arch<Arch>>) {
    unpack_vertical_scalar(in, b, v);
  } else {
    unpack_vertical_dispatch<vertical_arch<Arch>, 0, 32>(b, in, v);
  }
}

// out[j] = start + (g[0] + 1) + ... + (g[j] + 1) - 1 for j < count, in 32-bit arithmetic: the
// indices of a block from its gaps. Eight (or four) at a time: an in-register prefix sum by
// three (two) shifted adds, plus the running total of the previous groups.
template <class Arch>
void store_indices_u32(const std::uint32_t* g, std::size_t count, std::uint32_t start,
                       std::uint32_t* out) noexcept {
  using batch = xsimd::batch<std::uint32_t, Arch>;
  constexpr std::size_t width = batch::size;
  std::size_t j = 0;
  if constexpr (vertical_simd<Arch> && has_swizzle32<Arch>) {
    auto step = [](batch x) {
      // Inclusive prefix sum of the lanes of x.
      if constexpr (width == 8) {
        const batch one_up =
            xsimd::swizzle(x, batch_constant<batch, 0u, 0u, 1u, 2u, 3u, 4u, 5u, 6u>());
        x = x + (one_up & batch(batch_constant<batch, 0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u>()));
        const batch two_up =
            xsimd::swizzle(x, batch_constant<batch, 0u, 0u, 0u, 1u, 2u, 3u, 4u, 5u>());
        x = x + (two_up & batch(batch_constant<batch, 0u, 0u, ~0u, ~0u, ~0u, ~0u, ~0u, ~0u>()));
        const batch four_up =
            xsimd::swizzle(x, batch_constant<batch, 0u, 0u, 0u, 0u, 0u, 1u, 2u, 3u>());
        return x + (four_up & batch(batch_constant<batch, 0u, 0u, 0u, 0u, ~0u, ~0u, ~0u, ~0u>()));
      } else {
        const batch one_up = xsimd::swizzle(x, batch_constant<batch, 0u, 0u, 1u, 2u>());
        x = x + (one_up & batch(batch_constant<batch, 0u, ~0u, ~0u, ~0u>()));
        const batch two_up = xsimd::swizzle(x, batch_constant<batch, 0u, 0u, 0u, 1u>());
        return x + (two_up & batch(batch_constant<batch, 0u, 0u, ~0u, ~0u>()));
      }
    };
    auto last_lane = [](batch x) {
      if constexpr (width == 8) {
        return xsimd::swizzle(x, batch_constant<batch, 7u, 7u, 7u, 7u, 7u, 7u, 7u, 7u>());
      } else {
        return xsimd::swizzle(x, batch_constant<batch, 3u, 3u, 3u, 3u>());
      }
    };
    const batch one(1u);
    batch carry(start - 1u);
    for (; j + width <= count; j += width) {
      // The group's own total is broadcast off the chain from one group to the next, which
      // is then a single add (not an add and a lane broadcast).
      const batch s = step(batch::load_unaligned(g + j) + one);
      (s + carry).store_unaligned(out + j);
      carry = carry + last_lane(s);
    }
    if (j > 0) start = out[j - 1] + 1u;
  }
  for (; j < count; ++j) {
    start += g[j];
    out[j] = start;
    ++start;
  }
}

/// Bytes of `count` values of b bits in the horizontal layout.
[[nodiscard]] constexpr std::size_t horizontal_bytes(std::size_t count, unsigned b) noexcept {
  return (count * b + 7) / 8;
}

// Horizontal layout: one little-endian bit stream, value j at bits [j*b, j*b + b), the last
// byte padded with zero bits.
inline void pack_horizontal(const std::uint32_t* v, std::size_t count, unsigned b,
                            std::byte* out) noexcept {
  std::uint64_t acc = 0;
  unsigned fill = 0;
  const std::uint32_t mask = low_mask32(b);
  for (std::size_t j = 0; j < count; ++j) {
    acc |= static_cast<std::uint64_t>(v[j] & mask) << fill;
    fill += b;
    while (fill >= 8) {
      *out++ = static_cast<std::byte>(acc);
      acc >>= 8;
      fill -= 8;
    }
  }
  if (fill != 0) *out = static_cast<std::byte>(acc);
}

/// Unpacks `count` values of b bits; returns the padding bits of the last byte (0 when the
/// stream is canonical).
inline std::uint32_t unpack_horizontal(const std::byte* in, std::size_t count, unsigned b,
                                       std::uint32_t* v) noexcept {
  std::uint64_t acc = 0;
  unsigned have = 0;
  const std::uint32_t mask = low_mask32(b);
  for (std::size_t j = 0; j < count; ++j) {
    while (have < b) {
      acc |= static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(*in++)) << have;
      have += 8;
    }
    v[j] = static_cast<std::uint32_t>(acc) & mask;
    acc >>= b;
    have -= b;
  }
  return static_cast<std::uint32_t>(acc);
}

/// Bytes of the LEB128 varint of v (1..10).
[[nodiscard]] constexpr std::size_t varint_bytes(std::uint64_t v) noexcept {
  return v < 0x80 ? 1 : (static_cast<std::size_t>(std::bit_width(v)) + 6) / 7;
}

/// Writes v as an LEB128 varint (7 bits per byte, least significant first, high bit = more
/// bytes follow); returns the end.
STELLATRAIN_FORCE_INLINE std::byte* write_varint(std::byte* p, std::uint64_t v) noexcept {
  while (v >= 0x80) {
    *p++ = static_cast<std::byte>(v | 0x80u);
    v >>= 7;
  }
  *p++ = static_cast<std::byte>(v);
  return p;
}

/// Reads one canonical varint from [p, end) into `out`; returns the end of it, or nullptr when
/// it runs past `end`, does not fit 64 bits, or is not canonical (a last byte of zero after
/// other bytes).
STELLATRAIN_FORCE_INLINE const std::byte* read_varint(const std::byte* p, const std::byte* end,
                                                      std::uint64_t& out) noexcept {
  if (p != end) {
    const auto first = std::to_integer<std::uint8_t>(*p);
    if (first < 0x80) {
      out = first;
      return p + 1;
    }
  }
  std::uint64_t v = 0;
  for (unsigned shift = 0; shift < 70; shift += 7) {
    if (p == end) return nullptr;
    const auto byte = std::to_integer<std::uint8_t>(*p++);
    if (shift == 63 && byte > 1) return nullptr;  // bits past 64
    v |= static_cast<std::uint64_t>(byte & 0x7fu) << shift;
    if (byte < 0x80) {
      if (byte == 0 && shift != 0) return nullptr;  // overlong
      out = v;
      return p;
    }
  }
  return nullptr;
}

}  // namespace stellatrain::detail
