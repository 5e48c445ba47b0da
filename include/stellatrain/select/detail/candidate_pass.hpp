// SPDX-License-Identifier: Apache-2.0
// The candidate pass shared by the magnitude selectors: one streaming pass that keeps every
// element whose key reaches a lower bound (SIMD compare + compress into a small per-chunk
// staging buffer, flushed into a shared store), then radix narrowing on the few candidates to
// find the exact k-th key, then emission in index order.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>

namespace stellatrain::detail {

// Elements per chunk of a pass: 128 KiB of fp32, so that a chunk's working set stays in L2
// and the executor gets enough chunks to balance uneven progress.
inline constexpr std::uint64_t select_grain = 32768;
// Candidates a chunk stages on its stack before it copies them to the shared store (8 KiB per
// array), and the room past the end that a full-width compress may write.
inline constexpr std::uint32_t staging_entries = 1024;
inline constexpr std::uint32_t staging_slack = 16;
// Bins of one radix level (2048 x 8 bytes: stays in L1).
inline constexpr std::uint32_t radix_bits = 11;
inline constexpr std::uint32_t radix_bins = 1u << radix_bits;

[[nodiscard]] constexpr std::uint64_t chunk_count(std::uint64_t n, std::uint64_t grain) noexcept {
  return n == 0 ? 0 : (n - 1) / grain + 1;
}

/// Candidates flushed by one chunk at one time: `count` entries of the store from `offset`,
/// all from the chunk that starts at element `chunk_begin`, in ascending order.
struct candidate_segment {
  std::uint64_t chunk_begin = 0;
  std::uint64_t offset = 0;
  std::uint64_t count = 0;
};

/// A run of consecutive segments emitted by one task: its counts above and at the k-th key,
/// where its output starts and how many of its ties it may take.
struct emit_group {
  std::uint64_t seg_begin = 0;
  std::uint64_t seg_end = 0;
  std::uint64_t greater = 0;
  std::uint64_t equal = 0;
  std::uint64_t out = 0;
  std::uint64_t quota = 0;
};

/// Storage of the candidate pass. Grows on `reserve` only, so a selector that saw its largest
/// tensor once never allocates again.
struct candidate_workspace {
  aligned_buffer<std::uint32_t> local;  // offset of each candidate inside its chunk
  aligned_buffer<std::uint32_t> bits;   // raw bits of each candidate
  aligned_buffer<std::uint32_t> keys;   // scratch: samples, narrowed keys
  aligned_buffer<candidate_segment> segments;
  aligned_buffer<emit_group> groups;
  aligned_buffer<std::uint64_t> piece_hist;  // per-piece histograms of the k-th search
  std::uint64_t count = 0;                   // candidates in the store after a pass
  std::uint64_t segment_count = 0;           // segments after a pass (sorted by position)
  std::uint32_t low_key = 0;                 // every stored key is >= this (the pass's bound)
  std::uint32_t max_key = 0;                 // the largest stored key

  [[nodiscard]] std::uint64_t capacity() const noexcept { return local.size(); }

  /// At most this many pieces split the scans of the k-th search (256 KiB of histograms).
  static constexpr std::uint64_t max_pieces = 16;

  /// Room for `capacity` candidates of a tensor of `n` elements and `scratch` scratch keys.
  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t capacity, std::uint64_t n, std::uint64_t scratch) {
    const buffer_options opts{.prefault = true};
    if (capacity > local.size()) {
      local = aligned_buffer<std::uint32_t>(capacity, opts, ex);
      bits = aligned_buffer<std::uint32_t>(capacity, opts, ex);
    }
    scratch = std::max(scratch, capacity);
    if (scratch > keys.size()) keys = aligned_buffer<std::uint32_t>(scratch, opts, ex);
    const std::uint64_t segs =
        chunk_count(n, select_grain) + local.size() / (staging_entries - staging_slack) + 2;
    if (segs > segments.size()) {
      segments = aligned_buffer<candidate_segment>(segs, opts, ex);
      groups = aligned_buffer<emit_group>(segs, opts, ex);
    }
    if (max_pieces * radix_bins > piece_hist.size()) {
      piece_hist = aligned_buffer<std::uint64_t>(max_pieces * radix_bins, opts, ex);
    }
  }
};

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

/// The k-th largest key and how many keys are strictly larger.
struct kth_key {
  std::uint32_t key = 0;
  std::uint64_t greater = 0;
};

/// The first radix level over the stored candidates, shared by several rank queries: the
/// range [lo, hi] of the keys present and a histogram of an 11-bit digit of key - lo.
struct kth_search {
  std::uint32_t lo = 0;
  std::uint32_t hi = 0;
  int shift = 0;
  std::uint32_t bins = 0;
  std::array<std::uint64_t, radix_bins> hist;
};

[[nodiscard]] inline int radix_shift(std::uint32_t range) noexcept {
  return std::max(0, static_cast<int>(std::bit_width(range)) - static_cast<int>(radix_bits));
}

// Histogram of (key - lo) >> shift over `count` keys (masked with `mask`), with four
// interleaved sub-histograms so that runs of equal digits do not serialise on one counter.
inline void histogram_keys(const std::uint32_t* keys, std::uint64_t count, std::uint32_t mask,
                           std::uint32_t lo, int shift, std::uint32_t bins, std::uint64_t* hist) {
  std::array<std::array<std::uint32_t, radix_bins>, 4> sub;
  for (auto& h : sub) std::fill_n(h.begin(), bins, 0u);
  std::uint64_t j = 0;
  // Flush before a 32-bit sub-counter could wrap.
  while (j < count) {
    const std::uint64_t stop = std::min(count, j + (std::uint64_t{1} << 31));
    for (; j + 4 <= stop; j += 4) {
      ++sub[0][((keys[j] & mask) - lo) >> shift];
      ++sub[1][((keys[j + 1] & mask) - lo) >> shift];
      ++sub[2][((keys[j + 2] & mask) - lo) >> shift];
      ++sub[3][((keys[j + 3] & mask) - lo) >> shift];
    }
    for (; j < stop; ++j) ++sub[0][((keys[j] & mask) - lo) >> shift];
    for (std::uint32_t d = 0; d < bins; ++d) {
      hist[d] += std::uint64_t{sub[0][d]} + sub[1][d] + sub[2][d] + sub[3][d];
      sub[0][d] = sub[1][d] = sub[2][d] = sub[3][d] = 0;
    }
  }
}

// How many pieces the scans over the stored candidates are cut into: one per 64K candidates,
// at most 4 per thread (a single piece runs on the calling thread).
template <executor Ex>
[[nodiscard]] std::uint64_t candidate_pieces(Ex& ex, std::uint64_t count) noexcept {
  const std::uint64_t by_size = count / 65536;
  const std::uint64_t by_threads =
      4 * static_cast<std::uint64_t>(std::max<std::size_t>(ex.concurrency(), 1));
  return std::clamp<std::uint64_t>(std::min(by_size, by_threads), 1,
                                   candidate_workspace::max_pieces);
}

// Calls fn(piece, begin, end) for `pieces` near-equal pieces of [0, count).
template <executor Ex, class Fn>
void for_each_piece(Ex& ex, std::uint64_t count, std::uint64_t pieces, Fn&& fn) {
  auto run = [&](std::size_t p) {
    fn(static_cast<std::uint64_t>(p), count * p / pieces, count * (p + 1) / pieces);
  };
  if (pieces == 1) {
    run(0);
  } else {
    ex.bulk(static_cast<std::size_t>(pieces), run);
  }
}

/// Range and first-level histogram of the stored candidates (ws.count >= 1), the histogram
/// split across the executor for large stores.
template <executor Ex>
void kth_first_level(Ex& ex, candidate_workspace& ws, std::uint32_t key_mask, kth_search& s) {
  const std::uint32_t* const bits = ws.bits.data();
  // The pass's bound and the largest key it met enclose every stored key.
  const std::uint32_t lo = std::min(ws.low_key, ws.max_key);
  const std::uint32_t hi = ws.max_key;
  s.lo = lo;
  s.hi = hi;
  s.shift = radix_shift(hi - lo);
  s.bins = ((hi - lo) >> s.shift) + 1;
  std::fill_n(s.hist.begin(), s.bins, std::uint64_t{0});
  const std::uint64_t pieces = candidate_pieces(ex, ws.count);
  if (pieces == 1) {
    histogram_keys(bits, ws.count, key_mask, lo, s.shift, s.bins, s.hist.data());
    return;
  }
  std::uint64_t* const part = ws.piece_hist.data();
  for_each_piece(ex, ws.count, pieces, [&](std::uint64_t p, std::uint64_t b, std::uint64_t e) {
    std::uint64_t* h = part + p * radix_bins;
    std::fill_n(h, s.bins, std::uint64_t{0});
    histogram_keys(bits + b, e - b, key_mask, lo, s.shift, s.bins, h);
  });
  for (std::uint64_t p = 0; p < pieces; ++p) {
    for (std::uint32_t d = 0; d < s.bins; ++d) s.hist[d] += part[p * radix_bins + d];
  }
}

// Copies the keys of [b, e) of `src` (masked) that lie in [bin_lo, bin_hi] to `dst` from its
// start; returns how many, and widens [lo, hi] to them. Branch-free. `dst` may be `src + b`
// (in place); up to a vector's width of entries past those kept may be written, never past
// dst + (e - b). Masked keys are below 2^31 (key masks clear the top bit).
template <class Arch>
std::uint64_t keep_bin(const std::uint32_t* src, std::uint64_t b, std::uint64_t e,
                       std::uint32_t mask, std::uint32_t bin_lo, std::uint32_t bin_hi,
                       std::uint32_t* dst, std::uint32_t& lo, std::uint32_t& hi) noexcept {
  std::uint64_t kept = 0;
  std::uint64_t j = b;
  if constexpr (has_branchless_compress<Arch>()) {
    using ops = lane_ops<Arch>;
    using ibatch = typename ops::ibatch;
    constexpr std::uint64_t w = ops::width;
    const ibatch kmask(static_cast<std::int32_t>(mask));
    // Signed compares: keys and bin_lo are below 2^31, bin_hi is clamped to it.
    const ibatch below(static_cast<std::int32_t>(bin_lo) - 1);
    const ibatch top(static_cast<std::int32_t>(std::min<std::uint32_t>(bin_hi, 0x7fffffffu)));
    ibatch vlo(std::numeric_limits<std::int32_t>::max());
    ibatch vhi(-1);
    for (; j + w <= e; j += w) {
      const ibatch key = ops::load_words(src + j) & kmask;
      const auto in = (key > below) & !(key > top);
      vlo = xsimd::select(in, ops::min(vlo, key), vlo);
      vhi = xsimd::select(in, ops::max(vhi, key), vhi);
      kept += ops::compress(ops::mask_bits(in), key, dst + kept);
    }
    alignas(64) std::int32_t lanes_lo[w];
    alignas(64) std::int32_t lanes_hi[w];
    vlo.store_aligned(lanes_lo);
    vhi.store_aligned(lanes_hi);
    for (std::uint64_t l = 0; l < w; ++l) {
      if (lanes_hi[l] >= 0) {  // the lane kept a key
        lo = std::min(lo, static_cast<std::uint32_t>(lanes_lo[l]));
        hi = std::max(hi, static_cast<std::uint32_t>(lanes_hi[l]));
      }
    }
  }
  for (; j < e; ++j) {
    const std::uint32_t key = src[j] & mask;
    dst[kept] = key;
    const bool in = key - bin_lo <= bin_hi - bin_lo;  // bin_lo <= key <= bin_hi
    kept += in ? 1u : 0u;
    lo = in ? std::min(lo, key) : lo;
    hi = in ? std::max(hi, key) : hi;
  }
  return kept;
}

/// The k-th largest stored key (1 <= k <= ws.count) from a first level: each further level
/// keeps only the bin that holds the k-th key (so it touches few keys), in `ws.keys`.
template <class Arch, executor Ex>
kth_key kth_resolve(Ex& ex, candidate_workspace& ws, std::uint32_t key_mask, const kth_search& s,
                    std::uint64_t k) {
  STELLATRAIN_ASSERT(k >= 1 && k <= ws.count, "kth_resolve: k out of range");
  const std::uint32_t* const bits = ws.bits.data();
  std::uint32_t* const keys = ws.keys.data();
  std::uint64_t count = ws.count;
  std::uint32_t lo = s.lo;
  std::uint32_t hi = s.hi;
  std::uint64_t above = 0;
  std::array<std::uint64_t, radix_bins> level;
  const std::uint64_t* hist = s.hist.data();
  int shift = s.shift;
  std::uint32_t bins = s.bins;
  bool first = true;
  for (;;) {
    if (lo == hi) return {lo, above};
    if (!first) {
      shift = radix_shift(hi - lo);
      bins = ((hi - lo) >> shift) + 1;
      std::fill_n(level.begin(), bins, std::uint64_t{0});
      histogram_keys(keys, count, 0xffffffffu, lo, shift, bins, level.data());
      hist = level.data();
    }
    std::uint32_t d = bins - 1;
    std::uint64_t cum = 0;
    while (above + cum + hist[d] < k) cum += hist[d--];
    above += cum;
    const std::uint32_t bin_lo = lo + (d << shift);
    if (shift == 0) return {bin_lo, above};
    const std::uint32_t bin_hi = bin_lo + ((1u << shift) - 1u);
    // Keep the keys of bin d, tightening [lo, hi] to what they span. The first level reads
    // the whole store: in pieces, each writing at its own place, then packed together.
    std::uint32_t new_lo = bin_hi;
    std::uint32_t new_hi = bin_lo;
    const std::uint64_t pieces = first ? candidate_pieces(ex, count) : 1;
    if (pieces == 1) {
      count = keep_bin<Arch>(first ? bits : keys, 0, count, first ? key_mask : 0xffffffffu, bin_lo,
                             bin_hi, keys, new_lo, new_hi);
    } else {
      std::uint64_t* const info = ws.piece_hist.data();  // per piece: kept, lo, hi
      for_each_piece(ex, count, pieces, [&](std::uint64_t p, std::uint64_t b, std::uint64_t e) {
        std::uint32_t plo = bin_hi;
        std::uint32_t phi = bin_lo;
        info[3 * p] = keep_bin<Arch>(bits, b, e, key_mask, bin_lo, bin_hi, keys + b, plo, phi);
        info[3 * p + 1] = plo;
        info[3 * p + 2] = phi;
      });
      std::uint64_t kept = 0;
      for (std::uint64_t p = 0; p < pieces; ++p) {
        const std::uint64_t b = count * p / pieces;
        std::memmove(keys + kept, keys + b, info[3 * p] * sizeof(std::uint32_t));
        kept += info[3 * p];
        if (info[3 * p] > 0) {
          new_lo = std::min(new_lo, static_cast<std::uint32_t>(info[3 * p + 1]));
          new_hi = std::max(new_hi, static_cast<std::uint32_t>(info[3 * p + 2]));
        }
      }
      count = kept;
    }
    first = false;
    lo = new_lo;
    hi = new_hi;
  }
}

/// The k-th largest magnitude key among the stored candidates (1 <= k <= ws.count): radix
/// narrowing with 11-bit digits over the range of the keys actually present.
template <class Arch, executor Ex>
kth_key find_kth_candidate(Ex& ex, candidate_workspace& ws, std::uint64_t k,
                           std::uint32_t key_mask) {
  kth_search s;
  kth_first_level(ex, ws, key_mask, s);
  return kth_resolve<Arch>(ex, ws, key_mask, s, k);
}

/// A lower bound of the k-th largest stored key (1 <= k <= ws.count) from the first level
/// alone: the lowest key of the bin that holds it (within (hi - lo) / 2048 of it).
[[nodiscard]] inline std::uint32_t kth_floor(const kth_search& s, std::uint64_t k) noexcept {
  std::uint32_t d = s.bins - 1;
  std::uint64_t cum = 0;
  while (d > 0 && cum + s.hist[d] < k) cum += s.hist[d--];
  return s.lo + (d << s.shift);
}

// Counts the stored keys of [first, last) above `t` (into gt) and equal to it (into eq).
template <class Arch>
void count_around(const std::uint32_t* bits, std::uint64_t first, std::uint64_t last,
                  std::uint32_t key_mask, std::uint32_t t, std::uint64_t& gt,
                  std::uint64_t& eq) noexcept {
  std::uint64_t j = first;
  if constexpr (!is_scalar_arch<Arch>) {
    using ops = lane_ops<Arch>;
    using ibatch = typename ops::ibatch;
    constexpr std::uint64_t w = ops::width;
    const ibatch kmask(static_cast<std::int32_t>(key_mask));
    const ibatch tv(static_cast<std::int32_t>(t));
    ibatch above(0);
    ibatch at(0);
    for (; j + w <= last; j += w) {
      const ibatch key = ops::load_words(bits + j) & kmask;
      ops::count_into(above, key > tv);
      ops::count_into(at, key == tv);
    }
    gt += static_cast<std::uint64_t>(ops::sum_lanes(above));
    eq += static_cast<std::uint64_t>(ops::sum_lanes(at));
  }
  for (; j < last; ++j) {
    const std::uint32_t key = bits[j] & key_mask;
    gt += key > t ? 1u : 0u;
    eq += key == t ? 1u : 0u;
  }
}

// Copies the stored entries of [first, last) (offsets in `local`, raw bits in `bits`) whose
// key is above `t`, or equal to it while `quota` lasts (lowest position first), to the front
// of `out_local` and `out_bits`, in order; returns how many. The outputs need room for
// last - first entries plus a vector's width.
template <class Arch>
std::uint64_t choose_segment(const std::uint32_t* local, const std::uint32_t* bits,
                             std::uint64_t first, std::uint64_t last, std::uint32_t key_mask,
                             std::uint32_t t, std::uint64_t& quota,
                             std::uint32_t* STELLATRAIN_RESTRICT out_local,
                             std::uint32_t* STELLATRAIN_RESTRICT out_bits) noexcept {
  std::uint64_t chosen = 0;
  std::uint64_t j = first;
  if constexpr (has_branchless_compress<Arch>()) {
    using ops = lane_ops<Arch>;
    using ibatch = typename ops::ibatch;
    constexpr std::uint64_t w = ops::width;
    const ibatch kmask(static_cast<std::int32_t>(key_mask));
    const ibatch tv(static_cast<std::int32_t>(t));
    for (; j + w <= last; j += w) {
      const ibatch raw = ops::load_words(bits + j);
      const ibatch key = raw & kmask;
      std::uint32_t keep = ops::mask_bits(key > tv);
      // Keys equal to the k-th are rare (one per call for continuous values).
      for (std::uint32_t tie = ops::mask_bits(key == tv); tie != 0 && quota > 0;
           tie &= tie - 1, --quota) {
        keep |= tie & (0u - tie);
      }
      chosen += ops::compress2(keep, ops::load_words(local + j), raw, out_local + chosen,
                               out_bits + chosen);
    }
  }
  for (; j < last; ++j) {
    const std::uint32_t key = bits[j] & key_mask;
    const bool tie = key == t && quota > 0;
    quota -= tie ? 1u : 0u;
    out_local[chosen] = local[j];
    out_bits[chosen] = bits[j];
    chosen += (key > t || tie) ? 1u : 0u;
  }
  return chosen;
}

/// Calls `emit(out, index, bits)` for the selected candidates, in ascending index order with
/// `out` counting from 0: every candidate whose key is above `kth.key`, then of those equal
/// to it the (k - kth.greater) of lowest index. Groups of segments run in parallel; `emit` is
/// called concurrently for different `out`.
template <class Arch, executor Ex, class Emit>
void emit_candidates(Ex& ex, candidate_workspace& ws, std::uint32_t key_mask, kth_key kth,
                     std::uint64_t k, Emit&& emit) {
  const candidate_segment* const segs = ws.segments.data();
  const std::uint32_t* const local = ws.local.data();
  const std::uint32_t* const bits = ws.bits.data();
  emit_group* const groups = ws.groups.data();
  const std::size_t concurrency = std::max<std::size_t>(ex.concurrency(), 1);
  const std::uint64_t target =
      concurrency == 1 ? ws.count : std::max<std::uint64_t>(8192, ws.count / (4 * concurrency));
  std::uint64_t ngroups = 0;
  for (std::uint64_t s = 0; s < ws.segment_count;) {
    emit_group g;
    g.seg_begin = s;
    std::uint64_t in_group = 0;
    while (s < ws.segment_count && in_group < target) {
      // A chunk flushes at most a staging buffer at a time: what `emit_group_fn` stages.
      STELLATRAIN_ASSERT(segs[s].count <= staging_entries,
                         "emit_candidates: segment over a staging buffer");
      in_group += segs[s++].count;
    }
    g.seg_end = s;
    groups[ngroups++] = g;
  }
  const std::uint32_t t = kth.key;
  if (ngroups > 1) {
    ex.bulk(static_cast<std::size_t>(ngroups), [&](std::size_t gi) {
      emit_group& g = groups[gi];
      std::uint64_t gt = 0;
      std::uint64_t eq = 0;
      for (std::uint64_t s = g.seg_begin; s < g.seg_end; ++s) {
        count_around<Arch>(bits, segs[s].offset, segs[s].offset + segs[s].count, key_mask, t, gt,
                           eq);
      }
      g.greater = gt;
      g.equal = eq;
    });
  }
  std::uint64_t out = 0;
  std::uint64_t ties_left = k - kth.greater;
  for (std::uint64_t gi = 0; gi < ngroups; ++gi) {
    groups[gi].out = out;
    groups[gi].quota = ngroups == 1 ? ties_left : std::min(groups[gi].equal, ties_left);
    ties_left -= groups[gi].quota;
    out += groups[gi].greater + groups[gi].quota;
  }
  auto emit_group_fn = [&](std::size_t gi) {
    const emit_group& g = groups[gi];
    std::uint64_t pos = g.out;
    std::uint64_t quota = g.quota;
    // The chosen entries of a segment, staged (a compress per vector), then emitted in order.
    alignas(64) std::uint32_t chosen_local[staging_entries + staging_slack];
    alignas(64) std::uint32_t chosen_bits[staging_entries + staging_slack];
    for (std::uint64_t s = g.seg_begin; s < g.seg_end; ++s) {
      const std::uint64_t first = segs[s].offset;
      const std::uint64_t chosen = choose_segment<Arch>(
          local, bits, first, first + segs[s].count, key_mask, t, quota, chosen_local, chosen_bits);
      const std::uint64_t base = segs[s].chunk_begin;
      for (std::uint64_t c = 0; c < chosen; ++c)
        emit(pos++, base + chosen_local[c], chosen_bits[c]);
    }
  };
  if (ngroups == 1) {
    emit_group_fn(0);
  } else {
    ex.bulk(static_cast<std::size_t>(ngroups), emit_group_fn);
  }
}

/// Calls `emit(out, index, bits)` for every stored candidate and for the `fill` lowest-index
/// elements that are not candidates (read through `reader`), all in ascending index order.
/// Precondition: the pass did not overflow and ws.count + fill <= n.
template <class Reader, class Emit>
void emit_all_with_fill(const candidate_workspace& ws, std::uint64_t fill, std::uint64_t n,
                        const Reader& reader, Emit&& emit) {
  const candidate_segment* const segs = ws.segments.data();
  std::uint64_t pos = 0;
  std::uint64_t next = 0;
  for (std::uint64_t s = 0; s < ws.segment_count; ++s) {
    for (std::uint64_t j = segs[s].offset; j < segs[s].offset + segs[s].count; ++j) {
      const std::uint64_t index = segs[s].chunk_begin + ws.local[j];
      for (; fill > 0 && next < index; ++next, --fill) emit(pos++, next, reader.load_scalar(next));
      emit(pos++, index, ws.bits[j]);
      next = index + 1;
    }
  }
  for (; fill > 0 && next < n; ++next, --fill) emit(pos++, next, reader.load_scalar(next));
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
