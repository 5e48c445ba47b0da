// SPDX-License-Identifier: Apache-2.0
// The collect phase of the candidate pass: one streaming pass that keeps every element whose
// key reaches a lower bound (SIMD compare + compress into a small per-chunk staging buffer,
// flushed into the shared store), and the sampled estimate of such a bound.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace stellatrain::detail {

/// Outcome of a candidate pass.
struct collect_result {
  std::uint64_t count = 0;  // elements whose key reached the bound (also when not all fit)
  bool overflow = false;    // the store was too small: candidates were dropped, store unusable
  // Estimated number of elements whose key reaches each extra count key: 4x the count over
  // the first 32 of every 128 elements of each chunk (a fixed pattern, the same on every
  // architecture, a quarter of the compares).
  std::uint64_t at_or_above[2] = {0, 0};
};

// Vectors per block of the two-phase pass: 64 masks fit one 64-bit map.
inline constexpr std::uint64_t pass_block_vectors = 64;
// How far ahead the pass prefetches, in bytes: enough lines in flight to stream from DRAM
// while the loop spends more instructions per line than a plain read.
inline constexpr std::uint64_t prefetch_bytes = 2048;

/// One pass over `n` elements of `src`: stores every element whose magnitude key is at least
/// `low_key` (offset in chunk and raw bits), grouped in segments sorted by position; with
/// `Counters` > 0 also estimates how many elements reach `count_keys[j]`.
///
/// The SIMD loop works in blocks of 64 vectors: phase 1 streams the block (prefetching ahead,
/// applying the source's transformation) and keeps one comparison mask per vector; phase 2
/// revisits, from L1, only the vectors whose mask is non-zero and compresses their selected
/// lanes. Phase 1 has no data-dependent branch, so the stream never stalls on a
/// misprediction and costs a handful of instructions per vector.
template <class Arch, int Counters = 0, class Source, executor Ex>
collect_result collect_candidates(Ex& ex, const Source& src, std::uint64_t n, std::uint32_t low_key,
                                  const std::array<std::uint32_t, 2>& count_keys,
                                  candidate_workspace& ws) {
  static_assert(Counters >= 0 && Counters <= 2);
  constexpr std::uint32_t key_mask = Source::key_mask;
  std::atomic<std::uint64_t> used{0};
  std::atomic<std::uint64_t> seen{0};
  std::atomic<std::uint64_t> nseg{0};
  std::atomic<bool> overflow{false};
  std::atomic<std::uint64_t> above0{0};
  std::atomic<std::uint64_t> above1{0};
  std::atomic<std::uint32_t> max_key{0};
  const std::uint64_t cap = ws.capacity();
  const std::uint64_t seg_cap = ws.segments.size();
  std::uint32_t* const store_local = ws.local.data();
  std::uint32_t* const store_bits = ws.bits.data();
  candidate_segment* const segs = ws.segments.data();
  const auto rd = src.reread();

  for_each_chunk(ex, n, select_grain, [&](std::uint64_t b, std::uint64_t e) {
    alignas(64) std::uint32_t st_local[staging_entries + staging_slack];
    alignas(64) std::uint32_t st_bits[staging_entries + staging_slack];
    std::uint32_t c = 0;
    auto flush = [&] {
      if (c == 0) return;
      seen.fetch_add(c, std::memory_order_relaxed);
      const std::uint64_t off = used.fetch_add(c, std::memory_order_relaxed);
      if (off + c <= cap) {
        const std::uint64_t s = nseg.fetch_add(1, std::memory_order_relaxed);
        if (s < seg_cap) {
          std::memcpy(store_local + off, st_local, c * sizeof(std::uint32_t));
          std::memcpy(store_bits + off, st_bits, c * sizeof(std::uint32_t));
          segs[s] = {b, off, c};
        } else {
          overflow.store(true, std::memory_order_relaxed);
        }
      } else {
        overflow.store(true, std::memory_order_relaxed);
      }
      c = 0;
    };
    std::uint64_t cnt0 = 0;
    std::uint64_t cnt1 = 0;
    std::uint32_t chunk_max = 0;
    std::uint64_t i = b;
    if constexpr (!is_scalar_arch<Arch>) {
      using ops = lane_ops<Arch>;
      using ibatch = typename ops::ibatch;
      using mask_type = std::conditional_t<(ops::width > 8), std::uint16_t, std::uint8_t>;
      constexpr std::uint64_t w = ops::width;
      constexpr std::uint64_t line = cache_line_bytes / sizeof(typename Source::value_type);
      constexpr std::uint64_t ahead = prefetch_bytes / sizeof(typename Source::value_type);
      constexpr std::uint64_t vectors_per_line = line >= w ? line / w : 1;
      constexpr std::uint64_t group_vectors = 128 / w;   // vectors per 128 elements
      constexpr std::uint64_t counted_vectors = 32 / w;  // of which the counters see the first
      static_assert(128 % w == 0 && 32 % w == 0 && pass_block_vectors % group_vectors == 0);
      const ibatch kmask(static_cast<std::int32_t>(key_mask));
      // key >= low_key  <=>  key > low_key - 1 (low_key <= 2^31 - 1, so this is -1 for 0).
      const ibatch low(static_cast<std::int32_t>(low_key) - 1);
      const ibatch edge0(static_cast<std::int32_t>(count_keys[0]) - 1);
      const ibatch edge1(static_cast<std::int32_t>(count_keys[1]) - 1);
      ibatch acc0(0);
      ibatch acc1(0);
      ibatch top(0);
      alignas(64) mask_type masks[pass_block_vectors];
      // Bit j: masks[j] is not zero. Kept in a register as the masks are made: reading the
      // stored masks back as wider words would wait for the narrow stores to reach the cache.
      std::uint64_t map = 0;
      // Phase 1 for vector j of the block: its comparison with the bound, a prefetch once per
      // line, and the counters on the first 32 of every 128 elements. With `Known`, `Q` is the
      // vector's place in its 128 elements at compile time (full blocks, unrolled: no branch
      // left); otherwise both checks run per vector (the last, partial block of a chunk).
      auto compare = [&]<bool Known, std::uint64_t Q>(std::uint64_t j)
          __attribute__((always_inline)) {
        const std::uint64_t p = i + j * w;
        if constexpr (Known) {
          if constexpr (Q % vectors_per_line == 0) src.prefetch(p + ahead);
        } else if (p % line == 0) {
          src.prefetch(p + ahead);
        }
        const ibatch key = src.template load<Arch>(p) & kmask;
        if constexpr (Counters > 0) {
          if (Known ? Q < counted_vectors : (p - b) % 128 < 32) {
            ops::count_into(acc0, key > edge0);
            if constexpr (Counters > 1) ops::count_into(acc1, key > edge1);
          }
        }
        return key > low;
      };
      // ... and its mask, one vector at a time.
      auto scan = [&]<bool Known, std::uint64_t Q>(std::uint64_t j) __attribute__((always_inline)) {
        const auto lanes = ops::mask_bits(compare.template operator()<Known, Q>(j));
        masks[j] = static_cast<mask_type>(lanes);
        map |= static_cast<std::uint64_t>(lanes != 0) << j;
      };
      // ... eight vectors at a time where the masks pack (vector j0 + q at place Q0 + q).
      // (The check inside: the call to mask_bytes8 does not depend on Q0, so it is compiled
      // with the enclosing function even where scan8 is never called.)
      auto scan8 = [&]<std::uint64_t Q0>(std::uint64_t j0) __attribute__((always_inline)) {
        if constexpr (ops::packs_masks8) {
          static_assert(sizeof(mask_type) == 1 && group_vectors % 8 == 0);
          std::array<typename ops::ibool, 8> cmp;
          [&]<std::uint64_t... Q>(std::integer_sequence<std::uint64_t, Q...>)
              __attribute__((always_inline)) {
            ((cmp[Q] = compare.template operator()<true, Q0 + Q>(j0 + Q)), ...);
          }
          (std::make_integer_sequence<std::uint64_t, 8>{});
          std::uint32_t nonempty = 0;
          const std::uint64_t word = ops::mask_bytes8(cmp, nonempty);
          std::memcpy(masks + j0, &word, sizeof word);
          map |= std::uint64_t{nonempty} << j0;
        }
      };
      while (i + w <= e) {
        const std::uint64_t nv = std::min(pass_block_vectors, (e - i) / w);
        map = 0;
        if (nv == pass_block_vectors) {
          // A full block, unrolled 128 elements at a time: no per-vector branch (prefetch
          // once per line, the counters on the first quarter of each 128). Blocks start a
          // multiple of 64 w (so of 128, static_asserted above) elements past the chunk's
          // start, so these are the elements the per-vector checks would pick.
          for (std::uint64_t g0 = 0; g0 < pass_block_vectors; g0 += group_vectors) {
            if constexpr (ops::packs_masks8) {
              [&]<std::uint64_t... H>(std::integer_sequence<std::uint64_t, H...>)
                  __attribute__((always_inline)) {
                (scan8.template operator()<8 * H>(g0 + 8 * H), ...);
              }
              (std::make_integer_sequence<std::uint64_t, group_vectors / 8>{});
            } else {
              [&]<std::uint64_t... Q>(std::integer_sequence<std::uint64_t, Q...>)
                  __attribute__((always_inline)) {
                (scan.template operator()<true, Q>(g0 + Q), ...);
              }
              (std::make_integer_sequence<std::uint64_t, group_vectors>{});
            }
          }
        } else {
          for (std::uint64_t j = 0; j < nv; ++j) scan.template operator()<false, 0>(j);
        }
        for (; map != 0; map &= map - 1) {
          const auto j = static_cast<std::uint64_t>(std::countr_zero(map));
          const std::uint64_t p = i + j * w;
          const ibatch lane = ops::iota() + ibatch(static_cast<std::int32_t>(p - b));
          const ibatch v = rd.template load<Arch>(p);
          top = ops::max(top, v & kmask);  // (only candidates reach the bound: the max is one)
          c += ops::compress2(masks[j], lane, v, st_local + c, st_bits + c);
          if (c > staging_entries - w) flush();
        }
        i += nv * w;
      }
      chunk_max = static_cast<std::uint32_t>(ops::max_lane(top));
      if constexpr (Counters > 0) cnt0 += static_cast<std::uint64_t>(ops::sum_lanes(acc0));
      if constexpr (Counters > 1) cnt1 += static_cast<std::uint64_t>(ops::sum_lanes(acc1));
    }
    for (; i < e; ++i) {
      const std::uint32_t v = src.load_scalar(i);
      const std::uint32_t key = v & key_mask;
      if (key >= low_key) {
        chunk_max = std::max(chunk_max, key);
        st_local[c] = static_cast<std::uint32_t>(i - b);
        st_bits[c] = v;
        if (++c == staging_entries) flush();
      }
      if constexpr (Counters > 0) {
        if ((i - b) % 128 < 32) {
          cnt0 += key >= count_keys[0] ? 1u : 0u;
          if constexpr (Counters > 1) cnt1 += key >= count_keys[1] ? 1u : 0u;
        }
      }
    }
    flush();
    for (std::uint32_t m = max_key.load(std::memory_order_relaxed);
         chunk_max > m &&
         !max_key.compare_exchange_weak(m, chunk_max, std::memory_order_relaxed);) {
    }
    if constexpr (Counters > 0) above0.fetch_add(cnt0, std::memory_order_relaxed);
    if constexpr (Counters > 1) above1.fetch_add(cnt1, std::memory_order_relaxed);
  });

  collect_result r;
  r.count = seen.load();
  r.overflow = overflow.load();
  r.at_or_above[0] = 4 * above0.load();
  r.at_or_above[1] = 4 * above1.load();
  // After an overflow the store has holes: callers fall back to passes that do not use it.
  ws.segment_count = r.overflow ? 0 : nseg.load();
  ws.count = r.overflow ? 0 : r.count;
  ws.low_key = low_key;
  ws.max_key = max_key.load();
  std::sort(
      segs, segs + ws.segment_count, [](const candidate_segment& a, const candidate_segment& b) {
        return a.chunk_begin != b.chunk_begin ? a.chunk_begin < b.chunk_begin : a.offset < b.offset;
      });
  return r;
}

/// A mix of the bits of `x` (splitmix64's finaliser): spreads sample positions in a stratum.
[[nodiscard]] constexpr std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// A lower bound for the key of rank `target` (from the top) of `n` elements, estimated from
/// `samples` elements (one per stratum of n / samples; at a pseudo-random place inside it when
/// `jitter`, else at its start: a strided sample): the key of sample rank
/// target / n * samples + z * sqrt(that) + 1, so that with high probability at least `target`
/// elements reach it. Never 0 (0 would keep every zero; 1 keeps every non-zero). `scratch`
/// holds `samples` keys. Reads through `peek` (no side effects), split across the executor.
template <executor Ex, class Source>
std::uint32_t sample_low_key(Ex& ex, const Source& src, std::uint64_t n, std::uint64_t target,
                             std::uint64_t samples, double z, bool jitter, std::uint32_t* scratch) {
  samples = std::clamp<std::uint64_t>(samples, 1, n);
  const std::uint64_t stride = n / samples;
  const std::uint64_t pieces =
      std::clamp<std::uint64_t>(samples / 4096, 1, std::max<std::size_t>(ex.concurrency(), 1));
  for_each_piece(ex, samples, pieces, [&](std::uint64_t, std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t j = b; j < e; ++j) {
      const std::uint64_t pos = j * stride + (jitter ? mix64(j) % stride : 0);
      scratch[j] = src.peek(pos) & Source::key_mask;
    }
  });
  const double expected =
      static_cast<double>(target) / static_cast<double>(n) * static_cast<double>(samples);
  const double want = std::ceil(expected + z * std::sqrt(expected) + 1.0);
  const auto rank = static_cast<std::uint64_t>(std::clamp(want, 1.0, static_cast<double>(samples)));
  // The rank-th largest sample key: the 11-bit bin of the top bits that holds it, then an
  // nth_element among the few keys of that bin.
  constexpr int shift = std::bit_width(Source::key_mask) - static_cast<int>(radix_bits);
  std::array<std::uint32_t, radix_bins> hist{};
  for (std::uint64_t j = 0; j < samples; ++j) ++hist[scratch[j] >> shift];
  std::uint32_t d = radix_bins - 1;
  std::uint64_t above = 0;
  while (above + hist[d] < rank) above += hist[d--];
  std::uint64_t m = 0;
  for (std::uint64_t j = 0; j < samples; ++j) {
    if ((scratch[j] >> shift) == d) scratch[m++] = scratch[j];
  }
  const std::uint64_t r = rank - above;  // 1 <= r <= m
  std::nth_element(scratch, scratch + (r - 1), scratch + m,
                   [](std::uint32_t a, std::uint32_t b) { return a > b; });
  return std::max<std::uint32_t>(scratch[r - 1], 1);
}

}  // namespace stellatrain::detail
