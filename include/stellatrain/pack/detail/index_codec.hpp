// SPDX-License-Identifier: Apache-2.0
// Encoders, validators and decoders of the index payloads of one chunk: delta_bitpacked
// (patched frame of reference over 256-gap blocks), delta_varint, raw and bitmap. Decoders
// never read outside [begin, end) and report malformed input instead of trusting it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/detail/bit_packing.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

namespace stellatrain::detail {

inline constexpr std::uint64_t no_position = std::numeric_limits<std::uint64_t>::max();

/// What went wrong while reading an index payload (filled only on failure).
struct codec_failure {
  errc code = errc::malformed_message;
  std::string what;
};

[[nodiscard]] inline bool fail(codec_failure& f, errc code, std::string what) {
  f.code = code;
  f.what = std::move(what);
  return false;
}

// ------------------------------------------------------------------------------------------
// Sizes and bounds

/// Bytes of the packed low bits of a block of `count` gaps at width b.
[[nodiscard]] constexpr std::size_t block_low_bytes(std::size_t count, unsigned b) noexcept {
  return count == wire::block_elements ? 32 * std::size_t{b} : horizontal_bytes(count, b);
}

/// Most bytes `encode_bitpacked_chunk` writes for `count` indices of type I.
template <class I>
[[nodiscard]] constexpr std::uint64_t bitpacked_chunk_bound(std::uint64_t count) noexcept {
  const std::uint64_t blocks = (count + wire::block_elements - 1) / wire::block_elements;
  // u32 gaps always fit a block without exceptions; u64 gaps above 32 bits need at most one
  // position byte and a 5-byte varint (the bits above 32) each.
  const std::uint64_t per_element = sizeof(I) == 4 ? 4 : 4 + 1 + 5;
  return blocks * wire::block_header_bytes + count * per_element;
}

/// Most bytes `encode_varint_chunk` writes for `count` indices of type I.
template <class I>
[[nodiscard]] constexpr std::uint64_t varint_chunk_bound(std::uint64_t count) noexcept {
  return count * (sizeof(I) == 4 ? 5 : 10);
}

// ------------------------------------------------------------------------------------------
// Encoding (sender). Indices must ascend strictly from `base` (the first index may equal base);
// the encoders report the first position that does not, and then write nothing useful.

struct chunk_encoding {
  std::uint64_t bytes = 0;              ///< bytes written
  std::uint64_t varint_bytes = 0;       ///< bytes of the same chunk as delta_varint
  std::uint64_t bad_position = no_position;  ///< first index not above its predecessor
};

// Gaps of a block: d[0] = idx[0] - base, d[j] = idx[j] - idx[j-1] - 1. Returns the OR of the
// gaps and sets `bad` when an index does not ascend strictly.
// `base` is 64-bit because the index after 2^32 - 1 does not fit a 32-bit index.
template <class I>
STELLATRAIN_FORCE_INLINE I block_gaps(const I* STELLATRAIN_RESTRICT idx, std::size_t count, std::uint64_t base,
                                      I* STELLATRAIN_RESTRICT d, bool& bad) noexcept {
  I any = static_cast<I>(idx[0] - base);
  I not_above = idx[0] < base ? 1 : 0;
  d[0] = any;
  for (std::size_t j = 1; j < count; ++j) {
    const I g = idx[j] - idx[j - 1] - 1;
    not_above |= idx[j] <= idx[j - 1] ? 1 : 0;
    d[j] = g;
    any |= g;
  }
  bad = not_above != 0;
  return any;
}

// Encodes one block of count (1..256) gaps; returns its bytes. hist_varint accumulates the
// varint bytes of the same gaps.
template <class I, class Arch>
std::size_t encode_block(const I* d, std::size_t count, I any, std::byte* out,
                         std::uint64_t& varint_total) noexcept {
  constexpr unsigned gap_bits = sizeof(I) * 8;
  const unsigned wmax = static_cast<unsigned>(std::bit_width(any));
  // Histogram of gap bit widths, in four interleaved copies so that runs of equal widths do
  // not serialise on the same counter.
  std::array<std::array<std::uint16_t, 68>, 4> h{};
  std::size_t j = 0;
  for (; j + 4 <= count; j += 4) {
    ++h[0][std::bit_width(d[j])];
    ++h[1][std::bit_width(d[j + 1])];
    ++h[2][std::bit_width(d[j + 2])];
    ++h[3][std::bit_width(d[j + 3])];
  }
  for (; j < count; ++j) ++h[0][std::bit_width(d[j])];
  // above[t] = number of gaps wider than t bits.
  std::array<std::uint32_t, 66> above{};
  std::uint32_t acc = 0;
  for (unsigned w = 64; w >= 1; --w) {
    acc += static_cast<std::uint32_t>(h[0][w] + h[1][w] + h[2][w] + h[3][w]);
    above[w - 1] = acc;
  }
  // A gap of w bits takes max(1, ceil(w / 7)) varint bytes: 1 + #{m >= 1 : w > 7m}.
  std::uint64_t vb = count;
  for (unsigned t = 7; t < 64; t += 7) vb += above[t];
  varint_total += vb;

  // Pick the width with the fewest bytes: low bits of every gap, plus for each gap wider than
  // b one position byte and the varint of its high bits (a gap of w > b bits has w - b high
  // bits: ceil((w - b) / 7) bytes = #{m >= 0 : w > b + 7m}).
  const unsigned b_hi = std::min(wmax, wire::max_block_bits);
  const unsigned b_lo = b_hi > 10 ? b_hi - 10 : 0;
  unsigned best_b = b_hi;
  std::size_t best_cost = std::numeric_limits<std::size_t>::max();
  for (unsigned b = b_hi + 1; b-- > b_lo;) {
    std::size_t cost = block_low_bytes(count, b) + above[b];
    for (unsigned t = b; t < 64; t += 7) cost += above[t];
    if (cost < best_cost) {
      best_cost = cost;
      best_b = b;
    }
  }
  const unsigned b = best_b;
  const std::size_t exceptions = above[b];

  out[0] = static_cast<std::byte>(b);
  store_le<std::uint16_t>(out + 1, static_cast<std::uint16_t>(exceptions));
  std::byte* p = out + wire::block_header_bytes;
  alignas(64) std::uint32_t low[wire::block_elements];
  const std::uint32_t mask = low_mask32(b);
  for (std::size_t i = 0; i < count; ++i) low[i] = static_cast<std::uint32_t>(d[i]) & mask;
  if (count == wire::block_elements) {
    pack_vertical<Arch>(low, b, p);
  } else {
    pack_horizontal(low, count, b, p);
  }
  p += block_low_bytes(count, b);
  if (exceptions != 0 && b < gap_bits) {
    std::byte* positions = p;
    std::byte* high = p + exceptions;
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint64_t hv = static_cast<std::uint64_t>(d[i]) >> b;
      if (hv != 0) {
        *positions++ = static_cast<std::byte>(i);
        high = write_varint(high, hv);
      }
    }
    p = high;
  }
  return static_cast<std::size_t>(p - out);
}

/// Encodes `count` indices (strictly ascending, the first >= base) as one delta_bitpacked
/// chunk at `out` (room for `bitpacked_chunk_bound<I>(count)` bytes).
template <class I, class Arch = xsimd::default_arch>
chunk_encoding encode_bitpacked_chunk(const I* idx, std::size_t count, std::uint64_t base, std::byte* out) noexcept {
  chunk_encoding r;
  alignas(64) I d[wire::block_elements];
  std::uint64_t b0 = base;
  std::byte* p = out;
  for (std::size_t begin = 0; begin < count; begin += wire::block_elements) {
    const std::size_t n = std::min(wire::block_elements, count - begin);
    bool bad = false;
    const I any = block_gaps(idx + begin, n, b0, d, bad);
    if (bad) [[unlikely]] {
      std::uint64_t expect = b0;
      for (std::size_t j = 0; j < n; ++j) {
        if (idx[begin + j] < expect) {
          r.bad_position = begin + j;
          return r;
        }
        expect = static_cast<std::uint64_t>(idx[begin + j]) + 1;
      }
    }
    p += encode_block<I, Arch>(d, n, any, p, r.varint_bytes);
    b0 = static_cast<std::uint64_t>(idx[begin + n - 1]) + 1;
    if (b0 == 0 && begin + n < count) [[unlikely]] {  // 2^64 - 1 followed by more indices
      r.bad_position = begin + n;
      return r;
    }
  }
  r.bytes = static_cast<std::uint64_t>(p - out);
  return r;
}

/// Encodes `count` indices as one delta_varint chunk.
template <class I>
chunk_encoding encode_varint_chunk(const I* idx, std::size_t count, std::uint64_t base, std::byte* out) noexcept {
  chunk_encoding r;
  std::byte* p = out;
  std::uint64_t expect = base;
  for (std::size_t j = 0; j < count; ++j) {
    const std::uint64_t x = idx[j];
    if (x < expect) [[unlikely]] {
      r.bad_position = j;
      return r;
    }
    p = write_varint(p, x - expect);
    expect = x + 1;
    if (expect == 0 && j + 1 < count) [[unlikely]] {  // 2^64 - 1 followed by more indices
      r.bad_position = j + 1;
      return r;
    }
  }
  r.bytes = static_cast<std::uint64_t>(p - out);
  r.varint_bytes = r.bytes;
  return r;
}

/// First position j in [0, count) where idx[j] does not lie above idx[j - 1] (or, for j = 0,
/// below `base`), or no_position.
template <class I>
[[nodiscard]] std::uint64_t first_not_ascending(const I* idx, std::size_t count, std::uint64_t base) noexcept {
  if (count == 0) return no_position;
  if (idx[0] < base) return 0;
  // Vectorizable screen first; the position is searched only when something is wrong.
  I bad = 0;
  for (std::size_t j = 1; j < count; ++j) bad |= idx[j] <= idx[j - 1] ? 1 : 0;
  if (bad == 0) return no_position;
  for (std::size_t j = 1; j < count; ++j) {
    if (idx[j] <= idx[j - 1]) return j;
  }
  return no_position;
}

// ------------------------------------------------------------------------------------------
// Decoding (receiver). `Out` is std::uint32_t or std::uint64_t to store indices, or void to
// validate only. Every decoder checks each byte it reads against `end`.

/// Decodes `count` gaps of a delta_bitpacked chunk from [p, end), starting at `base`. On
/// success returns true, sets `base` past the last index (last + 1) and `p` past the chunk.
/// With Out = void nothing is stored. Fails on any structural error or when an index would
/// pass 2^64 - 1.
template <class Out, class Arch = xsimd::default_arch>
bool decode_bitpacked_chunk(const std::byte*& p, const std::byte* end, std::uint64_t count, std::uint64_t& base,
                            Out* out, codec_failure& f) {
  alignas(64) std::uint32_t low[wire::block_elements];
  std::uint8_t pos[wire::block_elements];
  std::uint64_t high[wire::block_elements];
  const std::byte* const chunk_start = p;
  for (std::uint64_t begin = 0; begin < count; begin += wire::block_elements) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(wire::block_elements, count - begin));
    auto where = [&] {
      return "block at byte " + std::to_string(p - chunk_start) + " of its chunk (indices " +
             std::to_string(begin) + ".." + std::to_string(begin + n - 1) + " of the chunk)";
    };
    if (end - p < static_cast<std::ptrdiff_t>(wire::block_header_bytes)) {
      return fail(f, errc::malformed_message, where() + ": block header runs past the payload");
    }
    const unsigned b = std::to_integer<unsigned>(p[0]);
    const std::size_t e = load_le<std::uint16_t>(p + 1);
    if (b > wire::max_block_bits) {
      return fail(f, errc::malformed_message, where() + ": bit width " + std::to_string(b) + " > 32");
    }
    if (e > n) {
      return fail(f, errc::malformed_message, where() + ": " + std::to_string(e) + " exceptions for " +
                                                  std::to_string(n) + " gaps");
    }
    p += wire::block_header_bytes;
    const std::size_t low_bytes = block_low_bytes(n, b);
    if (static_cast<std::size_t>(end - p) < low_bytes + e) {
      return fail(f, errc::malformed_message, where() + ": packed bits run past the payload");
    }
    if (n == wire::block_elements) {
      unpack_vertical<Arch>(p, b, low);
    } else if (unpack_horizontal(p, n, b, low) != 0) {
      return fail(f, errc::malformed_message, where() + ": nonzero padding bits");
    }
    p += low_bytes;
    for (std::size_t q = 0; q < e; ++q) {
      pos[q] = std::to_integer<std::uint8_t>(p[q]);
      if (pos[q] >= n || (q > 0 && pos[q] <= pos[q - 1])) {
        return fail(f, errc::malformed_message, where() + ": exception positions not ascending within the block");
      }
    }
    p += e;
    for (std::size_t q = 0; q < e; ++q) {
      std::uint64_t hv = 0;
      const std::byte* next = read_varint(p, end, hv);
      if (next == nullptr) return fail(f, errc::malformed_message, where() + ": malformed exception varint");
      if (hv == 0 || (b > 0 && (hv >> (64 - b)) != 0)) {
        return fail(f, errc::malformed_message, where() + ": exception high bits " + std::to_string(hv) +
                                                    " do not fit a 64-bit gap above " + std::to_string(b) + " bits");
      }
      high[q] = hv << b;
      p = next;
    }
    // The block's indices are base + j + (prefix sums of the gaps); check the last one first
    // (all others lie below it), then store.
    std::uint64_t sum = n;
    for (std::size_t j = 0; j < n; ++j) sum += low[j];
    bool overflow = false;
    for (std::size_t q = 0; q < e; ++q) overflow |= __builtin_add_overflow(sum, high[q], &sum);
    std::uint64_t next_base = 0;
    overflow |= __builtin_add_overflow(base, sum, &next_base);
    if (overflow) return fail(f, errc::out_of_range, where() + ": indices pass 2^64");
    if constexpr (!std::is_void_v<Out>) {
      Out* o = out + begin;
      auto acc = static_cast<Out>(base);
      std::size_t j = 0;
      for (std::size_t q = 0; q <= e; ++q) {
        const std::size_t stop = q < e ? pos[q] : n;
        for (; j < stop; ++j) {
          acc = static_cast<Out>(acc + low[j]);
          o[j] = acc;
          ++acc;
        }
        if (q < e) acc = static_cast<Out>(acc + high[q]);
      }
    }
    base = next_base;
  }
  return true;
}

/// Decodes `count` varint gaps from [p, end) starting at `base` (as decode_bitpacked_chunk).
template <class Out>
bool decode_varint_chunk(const std::byte*& p, const std::byte* end, std::uint64_t count, std::uint64_t& base,
                         Out* out, codec_failure& f) {
  const std::byte* const chunk_start = p;
  for (std::uint64_t j = 0; j < count; ++j) {
    std::uint64_t d = 0;
    const std::byte* next = read_varint(p, end, d);
    if (next == nullptr) {
      return fail(f, errc::malformed_message, "varint " + std::to_string(j) + " of its chunk at byte " +
                                                  std::to_string(p - chunk_start) +
                                                  " is truncated, longer than 64 bits or not canonical");
    }
    std::uint64_t x = 0;
    if (__builtin_add_overflow(base, d, &x) || x == std::numeric_limits<std::uint64_t>::max()) {
      return fail(f, errc::out_of_range, "varint " + std::to_string(j) + " of its chunk: index passes 2^64");
    }
    if constexpr (!std::is_void_v<Out>) out[j] = static_cast<Out>(x);
    base = x + 1;
    p = next;
  }
  return true;
}

/// Checks `count` raw little-endian indices of type W at p: each above the previous one (the
/// first at least `base`), all below `dense_size`. Returns the first bad position or
/// no_position.
template <class W>
[[nodiscard]] std::uint64_t check_raw(const std::byte* p, std::size_t count, std::uint64_t base,
                                      std::uint64_t dense_size) noexcept {
  if (count == 0) return no_position;
  W prev = load_le<W>(p);
  if (prev < base || prev >= dense_size) return 0;
  W bad = 0;
  for (std::size_t j = 1; j < count; ++j) {
    const W x = load_le<W>(p + j * sizeof(W));
    bad |= x <= prev ? 1 : 0;
    prev = x;
  }
  if (bad == 0 && prev < dense_size) return no_position;
  prev = load_le<W>(p);
  for (std::size_t j = 1; j < count; ++j) {
    const W x = load_le<W>(p + j * sizeof(W));
    if (x <= prev || x >= dense_size) return j;
    prev = x;
  }
  return no_position;
}

/// Copies `count` raw little-endian indices of type W into out (widening or narrowing).
template <class W, class Out>
void decode_raw(const std::byte* p, std::size_t count, Out* out) noexcept {
  if constexpr (sizeof(W) == sizeof(Out) && std::endian::native == std::endian::little) {
    std::memcpy(out, p, count * sizeof(Out));
  } else {
    for (std::size_t j = 0; j < count; ++j) out[j] = static_cast<Out>(load_le<W>(p + j * sizeof(W)));
  }
}

template <class I, class W>
void encode_raw(const I* idx, std::size_t count, std::byte* out) noexcept {
  if constexpr (sizeof(W) == sizeof(I) && std::endian::native == std::endian::little) {
    std::memcpy(out, idx, count * sizeof(I));
  } else {
    for (std::size_t j = 0; j < count; ++j) store_le<W>(out + j * sizeof(W), static_cast<W>(idx[j]));
  }
}

/// Population count of bytes [p, p + bytes).
[[nodiscard]] inline std::uint64_t popcount_bytes(const std::byte* p, std::size_t bytes) noexcept {
  std::uint64_t c = 0;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) c += static_cast<std::uint64_t>(std::popcount(load_le<std::uint64_t>(p + i)));
  for (; i < bytes; ++i) c += static_cast<std::uint64_t>(std::popcount(std::to_integer<std::uint8_t>(p[i])));
  return c;
}

/// Writes the indices of the set bits of bitmap bytes [first_byte, last_byte) to out (the
/// bitmap starts at `bitmap`); returns how many were written.
template <class Out>
std::uint64_t decode_bitmap_range(const std::byte* bitmap, std::uint64_t first_byte, std::uint64_t last_byte,
                                  Out* out) noexcept {
  std::uint64_t c = 0;
  std::uint64_t i = first_byte;
  for (; i + 8 <= last_byte; i += 8) {
    std::uint64_t w = load_le<std::uint64_t>(bitmap + i);
    while (w != 0) {
      out[c++] = static_cast<Out>(i * 8 + static_cast<std::uint64_t>(std::countr_zero(w)));
      w &= w - 1;
    }
  }
  for (; i < last_byte; ++i) {
    unsigned w = std::to_integer<unsigned>(bitmap[i]);
    while (w != 0) {
      out[c++] = static_cast<Out>(i * 8 + static_cast<std::uint64_t>(std::countr_zero(w)));
      w &= w - 1;
    }
  }
  return c;
}

}  // namespace stellatrain::detail
