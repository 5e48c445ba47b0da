// SPDX-License-Identifier: Apache-2.0
// Encoders, validators and decoders of the index payloads of one chunk: delta_bitpacked
// (patched frame of reference over 256-gap blocks), delta_varint, raw and bitmap. Decoders
// never read outside [begin, end) and report malformed input instead of trusting it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>
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
  std::uint64_t bytes = 0;                   ///< bytes written
  std::uint64_t varint_bytes = 0;            ///< bytes of the same chunk as delta_varint
  std::uint64_t bad_position = no_position;  ///< first index not above its predecessor
};

// Gaps of a block: d[0] = idx[0] - base, d[j] = idx[j] - idx[j-1] - 1. Returns the OR of the
// gaps and sets `bad` when an index does not ascend strictly.
// `base` is 64-bit because the index after 2^32 - 1 does not fit a 32-bit index.
template <class I>
STELLATRAIN_FORCE_INLINE I block_gaps(const I* STELLATRAIN_RESTRICT idx, std::size_t count,
                                      std::uint64_t base, I* STELLATRAIN_RESTRICT d,
                                      bool& bad) noexcept {
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

// counts[i] = number of the `count` gaps wider than t[i] bits (d >> t[i] != 0), for k <= 8
// thresholds below the gap width. One pass; the counters stay in registers (a histogram in
// memory would serialise on store-to-load forwarding when neighbouring gaps share a width).
template <std::size_t K, class I, class Arch>
void count_wider_fixed(const I* d, std::size_t count, const unsigned* t,
                       std::uint32_t* counts) noexcept {
  std::size_t j = 0;
  for (std::size_t i = 0; i < K; ++i) counts[i] = 0;
  constexpr lane_isa isa = lane_isa_of<Arch>();
  // AVX-512 architectures take the 256-bit code: vertical_simd (bit_packing.hpp) leaves out
  // their 16-lane batches, which would get the scalar loop.
  if constexpr (sizeof(I) == 4 && (isa == lane_isa::avx2 || isa == lane_isa::avx512)) {
#if STELLATRAIN_X86_INTRINSICS
    // A compare gives -1 per wider gap: subtracting it counts (two instructions per threshold).
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    __m256i limit[K];
    __m256i acc[K];
    for (std::size_t i = 0; i < K; ++i) {
      limit[i] = _mm256_set1_epi32(static_cast<int>(low_mask32(t[i]) ^ 0x80000000u));
      acc[i] = _mm256_setzero_si256();
    }
    for (; j + 8 <= count; j += 8) {
      const __m256i v =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + j)), sign);
      for (std::size_t i = 0; i < K; ++i)
        acc[i] = _mm256_sub_epi32(acc[i], _mm256_cmpgt_epi32(v, limit[i]));
    }
    for (std::size_t i = 0; i < K; ++i) {
      const __m128i h =
          _mm_add_epi32(_mm256_castsi256_si128(acc[i]), _mm256_extracti128_si256(acc[i], 1));
      const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
      counts[i] = static_cast<std::uint32_t>(
          _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1))));
    }
#endif
  } else if constexpr (sizeof(I) == 4 && vertical_simd<Arch>) {
    using batch = xsimd::batch<std::uint32_t, Arch>;
    constexpr std::size_t width = batch::size;
    // d >> t != 0  <=>  d > 2^t - 1, unsigned; as a signed compare after flipping sign bits.
    using ibatch = xsimd::batch<std::int32_t, Arch>;
    const batch sign(0x80000000u);
    ibatch limit[K];
    ibatch acc[K];
    for (std::size_t i = 0; i < K; ++i) {
      limit[i] = ibatch(static_cast<std::int32_t>(low_mask32(t[i]) ^ 0x80000000u));
      acc[i] = ibatch(0);
    }
    for (; j + width <= count; j += width) {
      const auto v = bitcast_lanes<std::int32_t>(batch::load_unaligned(d + j) ^ sign);
      for (std::size_t i = 0; i < K; ++i)
        acc[i] = acc[i] + xsimd::select(v > limit[i], ibatch(1), ibatch(0));
    }
    for (std::size_t i = 0; i < K; ++i)
      counts[i] = static_cast<std::uint32_t>(detail::reduce_add(acc[i]));
  }
  for (; j < count; ++j) {
    for (std::size_t i = 0; i < K; ++i)
      counts[i] += (static_cast<std::uint64_t>(d[j]) >> t[i]) != 0 ? 1u : 0u;
  }
}

// counts[i] = number of the `count` gaps wider than t[i] bits (d >> t[i] != 0), for k <= 8
// thresholds below the gap width. One pass with the counters in registers (a histogram in
// memory would serialise on store-to-load forwarding when neighbouring gaps share a width).
template <class I, class Arch>
void count_wider(const I* d, std::size_t count, const unsigned* t, std::size_t k,
                 std::uint32_t* counts) noexcept {
  switch (k) {
    case 1:
      count_wider_fixed<1, I, Arch>(d, count, t, counts);
      return;
    case 2:
      count_wider_fixed<2, I, Arch>(d, count, t, counts);
      return;
    case 3:
      count_wider_fixed<3, I, Arch>(d, count, t, counts);
      return;
    case 4:
      count_wider_fixed<4, I, Arch>(d, count, t, counts);
      return;
    case 5:
      count_wider_fixed<5, I, Arch>(d, count, t, counts);
      return;
    case 6:
      count_wider_fixed<6, I, Arch>(d, count, t, counts);
      return;
    case 7:
      count_wider_fixed<7, I, Arch>(d, count, t, counts);
      return;
    case 8:
      count_wider_fixed<8, I, Arch>(d, count, t, counts);
      return;
    default:
      return;
  }
}

// Byte j of entry m: the position of the j-th set bit of the 8-bit mask m (0 past its
// popcount), so that the set bits of a compare mask become positions with one load.
struct set_bit_positions {
  std::uint64_t bytes[256];
};

constexpr set_bit_positions make_set_bit_positions() noexcept {
  set_bit_positions t{};
  for (unsigned m = 0; m < 256; ++m) {
    unsigned j = 0;
    for (unsigned bit = 0; bit < 8; ++bit) {
      if (m & (1u << bit)) t.bytes[m] |= std::uint64_t{bit} << (8 * j++);
    }
  }
  return t;
}

inline constexpr set_bit_positions set_bit_position_table = make_set_bit_positions();

// Writes the block-relative positions of the gaps wider than b bits to pos (ascending) and
// returns how many there are; pos needs 8 bytes of room past the last position. x86: a compare
// and a movemask per vector of 8 (or 4) gaps, whose positions come from a table and are stored
// 8 bytes at a time; elsewhere a branch-free scalar loop. (Branching per gap or per vector
// would mispredict whenever exceptions are scattered.)
template <class I, class Arch = xsimd::default_arch>
std::size_t exception_positions(const I* d, std::size_t count, unsigned b,
                                std::uint8_t* pos) noexcept {
  std::size_t q = 0;
  std::size_t j = 0;
  // Adds j to every byte of a table entry (j + 7 < 256: no carries between bytes).
  const auto store_positions = [&](unsigned m) {
    const std::uint64_t packed = set_bit_position_table.bytes[m] + j * 0x0101010101010101ull;
    store_le<std::uint64_t>(reinterpret_cast<std::byte*>(pos + q), packed);
    q += static_cast<std::size_t>(std::popcount(m));
  };
  constexpr lane_isa isa = lane_isa_of<Arch>();
  // Unsigned d > 2^b - 1, as a signed compare after flipping the sign bits.
  const std::uint32_t limit = low_mask32(b) ^ 0x80000000u;
  if constexpr (sizeof(I) == 4 && (isa == lane_isa::avx2 || isa == lane_isa::avx512)) {
#if STELLATRAIN_X86_INTRINSICS
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i lim = _mm256_set1_epi32(static_cast<int>(limit));
    for (; j + 8 <= count; j += 8) {
      const __m256i v =
          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + j)), sign);
      store_positions(static_cast<unsigned>(
          _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, lim)))));
    }
#endif
  } else if constexpr (sizeof(I) == 4 && (isa == lane_isa::sse2 || isa == lane_isa::avx)) {
#if STELLATRAIN_X86_INTRINSICS
    const __m128i sign = _mm_set1_epi32(static_cast<int>(0x80000000u));
    const __m128i lim = _mm_set1_epi32(static_cast<int>(limit));
    for (; j + 4 <= count; j += 4) {
      const __m128i v =
          _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + j)), sign);
      store_positions(
          static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(v, lim)))));
    }
#endif
  }
  (void)store_positions;
  (void)limit;
  for (; j < count; ++j) {
    pos[q] = static_cast<std::uint8_t>(j);
    q += (static_cast<std::uint64_t>(d[j]) >> b) != 0 ? 1 : 0;
  }
  return q;
}

// Encodes one block of count (1..256) gaps whose sum is `gap_sum`; returns its bytes and adds
// the bytes of the same gaps as varints to `varint_total`.
//
// Each gap costs b low bits; a gap wider than b also costs a position byte and the varint of
// its w - b high bits, that is #{m >= 0 : w > b + 7m} bytes; so the cost of b needs "how many
// gaps are wider than t" for t = b, b + 7, ... below the largest width w_max (and varint sizes
// the same at t = 7, 14, ...). The width is the cheapest of every b in 0..min(w_max, 32) for
// short blocks and when w_max <= 8; otherwise (full blocks of wide gaps) of the candidates that
// matter for geometric gaps of mean g, whose optimum lies near log2(g) + 1.85: the widths of
// about g/2, g, 2g and 4g, and w_max itself (no exceptions).
template <class I, class Arch>
std::size_t encode_block(const I* d, std::size_t count, I any, std::uint64_t gap_sum,
                         std::byte* out, std::uint64_t& varint_total) noexcept {
  constexpr unsigned gap_bits = sizeof(I) * 8;
  const unsigned wmax = static_cast<unsigned>(std::bit_width(any));
  const unsigned b_hi = std::min(wmax, wire::max_block_bits);
  unsigned candidates[wire::max_block_bits + 1];
  std::size_t n_candidates = 0;
  if (count < wire::block_elements || wmax <= 8) {
    // Widest first: ties go to the wider width (fewer exceptions).
    for (unsigned b = b_hi + 1; b-- > 0;) candidates[n_candidates++] = b;
  } else {
    const auto mean_bits = static_cast<unsigned>(std::bit_width(gap_sum / count));
    candidates[n_candidates++] = b_hi;
    for (unsigned b = mean_bits > 0 ? mean_bits - 1 : 0; b <= mean_bits + 2 && b < b_hi; ++b) {
      candidates[n_candidates++] = b;
    }
  }
  // Thresholds the costs need (bit t of `needed`), counted eight at a time.
  std::uint64_t needed = 0;
  for (unsigned t = 7; t < wmax; t += 7) needed |= std::uint64_t{1} << t;
  for (std::size_t c = 0; c < n_candidates; ++c) {
    for (unsigned t = candidates[c]; t < wmax; t += 7) needed |= std::uint64_t{1} << t;
  }
  std::uint32_t wider_than[64];  // valid where `needed` has the bit
  while (needed != 0) {
    unsigned t[8];
    std::uint32_t c[8];
    std::size_t k = 0;
    for (; k < 8 && needed != 0; ++k) {
      t[k] = static_cast<unsigned>(std::countr_zero(needed));
      needed &= needed - 1;
    }
    count_wider<I, Arch>(d, count, t, k, c);
    for (std::size_t i = 0; i < k; ++i) wider_than[t[i]] = c[i];
  }
  auto above = [&](unsigned t) -> std::uint32_t { return t < wmax ? wider_than[t] : 0; };
  std::uint64_t vb = count;
  for (unsigned t = 7; t < wmax; t += 7) vb += above(t);
  varint_total += vb;

  unsigned best_b = b_hi;
  std::size_t best_cost = std::numeric_limits<std::size_t>::max();
  for (std::size_t c = 0; c < n_candidates; ++c) {
    const unsigned b = candidates[c];
    std::size_t cost = block_low_bytes(count, b) + above(b);
    for (unsigned t = b; t < wmax; t += 7) cost += above(t);
    if (cost < best_cost) {
      best_cost = cost;
      best_b = b;
    }
  }
  const unsigned b = best_b;
  const std::size_t exceptions = above(b);

  out[0] = static_cast<std::byte>(b);
  store_le<std::uint16_t>(out + 1, static_cast<std::uint16_t>(exceptions));
  std::byte* p = out + wire::block_header_bytes;
  if constexpr (sizeof(I) == 4) {
    // Both packers keep only the low b bits.
    if (count == wire::block_elements) {
      pack_vertical<Arch>(d, b, p);
    } else {
      pack_horizontal(d, count, b, p);
    }
  } else {
    alignas(64) std::uint32_t low[wire::block_elements];
    const std::uint32_t mask = low_mask32(b);
    for (std::size_t i = 0; i < count; ++i) low[i] = static_cast<std::uint32_t>(d[i]) & mask;
    if (count == wire::block_elements) {
      pack_vertical<Arch>(low, b, p);
    } else {
      pack_horizontal(low, count, b, p);
    }
  }
  p += block_low_bytes(count, b);
  if (exceptions != 0 && b < gap_bits) {
    std::uint8_t positions[wire::block_elements + 8];
    const std::size_t found = exception_positions<I, Arch>(d, count, b, positions);
    STELLATRAIN_ASSERT(found == exceptions, "exception count");
    (void)found;
    std::memcpy(p, positions, exceptions);
    std::byte* high = p + exceptions;
    for (std::size_t q = 0; q < exceptions; ++q)
      high = write_varint(high, static_cast<std::uint64_t>(d[positions[q]]) >> b);
    p = high;
  }
  return static_cast<std::size_t>(p - out);
}

/// Encodes `count` indices (strictly ascending, the first >= base) as one delta_bitpacked
/// chunk at `out` (room for `bitpacked_chunk_bound<I>(count)` bytes).
template <class I, class Arch = xsimd::default_arch>
chunk_encoding encode_bitpacked_chunk(const I* idx, std::size_t count, std::uint64_t base,
                                      std::byte* out) noexcept {
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
    // The gaps add up to the distance from the base to the last index, less one per index.
    const std::uint64_t gap_sum = static_cast<std::uint64_t>(idx[begin + n - 1]) - b0 - (n - 1);
    p += encode_block<I, Arch>(d, n, any, gap_sum, p, r.varint_bytes);
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
chunk_encoding encode_varint_chunk(const I* idx, std::size_t count, std::uint64_t base,
                                   std::byte* out) noexcept {
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
[[nodiscard]] std::uint64_t first_not_ascending(const I* idx, std::size_t count,
                                                std::uint64_t base) noexcept {
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
bool decode_bitpacked_chunk(const std::byte*& p, const std::byte* end, std::uint64_t count,
                            std::uint64_t& base, Out* out, codec_failure& f) {
  alignas(64) std::uint32_t low[wire::block_elements];
  std::uint8_t pos[wire::block_elements];
  std::uint64_t high[wire::block_elements];
  const std::byte* const chunk_start = p;
  for (std::uint64_t begin = 0; begin < count; begin += wire::block_elements) {
    const auto n =
        static_cast<std::size_t>(std::min<std::uint64_t>(wire::block_elements, count - begin));
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
      return fail(f, errc::malformed_message,
                  where() + ": bit width " + std::to_string(b) + " > 32");
    }
    if (e > n) {
      return fail(
          f, errc::malformed_message,
          where() + ": " + std::to_string(e) + " exceptions for " + std::to_string(n) + " gaps");
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
        return fail(f, errc::malformed_message,
                    where() + ": exception positions not ascending within the block");
      }
    }
    p += e;
    for (std::size_t q = 0; q < e; ++q) {
      std::uint64_t hv = 0;
      const std::byte* next = read_varint(p, end, hv);
      if (next == nullptr)
        return fail(f, errc::malformed_message, where() + ": malformed exception varint");
      if (hv == 0 || (b > 0 && (hv >> (64 - b)) != 0)) {
        return fail(f, errc::malformed_message,
                    where() + ": exception high bits " + std::to_string(hv) +
                        " do not fit a 64-bit gap above " + std::to_string(b) + " bits");
      }
      high[q] = hv << b;
      p = next;
    }
    // The block's indices are base + j + (prefix sums of the gaps). Validation (Out = void)
    // checks only the last one (all others lie below it); decoding runs after validation and
    // stores them all.
    std::uint64_t next_base = 0;
    if constexpr (std::is_void_v<Out>) {
      std::uint64_t sum = n;
      for (std::size_t j = 0; j < n; ++j) sum += low[j];
      bool overflow = false;
      for (std::size_t q = 0; q < e; ++q) overflow |= __builtin_add_overflow(sum, high[q], &sum);
      overflow |= __builtin_add_overflow(base, sum, &next_base);
      if (overflow) return fail(f, errc::out_of_range, where() + ": indices pass 2^64");
    } else if constexpr (sizeof(Out) == 4) {
      // Valid data keeps every gap and index below 2^32 (the tensor fits 32-bit indices).
      for (std::size_t q = 0; q < e; ++q) low[pos[q]] += static_cast<std::uint32_t>(high[q]);
      Out* o = out + begin;
      store_indices_u32<Arch>(low, n, static_cast<std::uint32_t>(base), o);
      next_base = static_cast<std::uint64_t>(o[n - 1]) + 1;
    } else {
      Out* o = out + begin;
      std::uint64_t acc = base;
      std::size_t j = 0;
      for (std::size_t q = 0; q <= e; ++q) {
        const std::size_t stop = q < e ? pos[q] : n;
        for (; j < stop; ++j) {
          acc += low[j];
          o[j] = acc;
          ++acc;
        }
        if (q < e) acc += high[q];
      }
      next_base = acc;
    }
    base = next_base;
  }
  return true;
}

/// Decodes `count` varint gaps from [p, end) starting at `base` (as decode_bitpacked_chunk).
template <class Out>
bool decode_varint_chunk(const std::byte*& p, const std::byte* end, std::uint64_t count,
                         std::uint64_t& base, Out* out, codec_failure& f) {
  const std::byte* const chunk_start = p;
  for (std::uint64_t j = 0; j < count; ++j) {
    std::uint64_t d = 0;
    const std::byte* next = read_varint(p, end, d);
    if (next == nullptr) {
      return fail(f, errc::malformed_message,
                  "varint " + std::to_string(j) + " of its chunk at byte " +
                      std::to_string(p - chunk_start) +
                      " is truncated, longer than 64 bits or not canonical");
    }
    std::uint64_t x = 0;
    if (__builtin_add_overflow(base, d, &x) || x == std::numeric_limits<std::uint64_t>::max()) {
      return fail(f, errc::out_of_range,
                  "varint " + std::to_string(j) + " of its chunk: index passes 2^64");
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
    for (std::size_t j = 0; j < count; ++j)
      out[j] = static_cast<Out>(load_le<W>(p + j * sizeof(W)));
  }
}

template <class I, class W>
void encode_raw(const I* idx, std::size_t count, std::byte* out) noexcept {
  if constexpr (sizeof(W) == sizeof(I) && std::endian::native == std::endian::little) {
    std::memcpy(out, idx, count * sizeof(I));
  } else {
    for (std::size_t j = 0; j < count; ++j)
      store_le<W>(out + j * sizeof(W), static_cast<W>(idx[j]));
  }
}

/// Bytes of a bitmap payload that one task writes or reads: pieces of 64 KiB give the
/// executor enough tasks on large tensors and keep each one long against a hand-off.
inline constexpr std::uint64_t bitmap_piece_bytes = std::uint64_t{1} << 16;

/// Population count of bytes [p, p + bytes).
[[nodiscard]] inline std::uint64_t popcount_bytes(const std::byte* p, std::size_t bytes) noexcept {
  std::uint64_t c = 0;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8)
    c += static_cast<std::uint64_t>(std::popcount(load_le<std::uint64_t>(p + i)));
  for (; i < bytes; ++i)
    c += static_cast<std::uint64_t>(std::popcount(std::to_integer<std::uint8_t>(p[i])));
  return c;
}

/// Writes the indices of the set bits of bitmap bytes [first_byte, last_byte) to out (the
/// bitmap starts at `bitmap`); returns how many were written.
template <class Out>
std::uint64_t decode_bitmap_range(const std::byte* bitmap, std::uint64_t first_byte,
                                  std::uint64_t last_byte, Out* out) noexcept {
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
