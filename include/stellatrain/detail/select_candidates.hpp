// SPDX-License-Identifier: Apache-2.0
// The candidate pass shared by the magnitude selectors: one streaming pass that keeps every
// element whose key reaches a lower bound (SIMD compare + compress into a small per-chunk
// staging buffer, flushed into a shared store), then radix narrowing on the few candidates to
// find the exact k-th key, then emission in index order.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/detail/select_sources.hpp>
#include <stellatrain/detail/simd_lanes.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

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
  std::uint64_t count = 0;          // candidates in the store after a pass
  std::uint64_t segment_count = 0;  // segments after a pass (sorted by position)

  [[nodiscard]] std::uint64_t capacity() const noexcept { return local.size(); }

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
  }
};

/// Outcome of a candidate pass.
struct collect_result {
  std::uint64_t count = 0;     // elements whose key reached the bound (also when not all fit)
  bool overflow = false;       // the store was too small: candidates were dropped, store unusable
  std::uint64_t at_or_above[2] = {0, 0};  // elements whose key reached each extra count key
};

/// One pass over `n` elements of `src`: stores every element whose magnitude key is at least
/// `low_key` (offset in chunk and raw bits), grouped in segments sorted by position; with
/// `Counters` > 0 also counts the elements whose key reaches `count_keys[j]`.
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
  const std::uint64_t cap = ws.capacity();
  const std::uint64_t seg_cap = ws.segments.size();
  std::uint32_t* const store_local = ws.local.data();
  std::uint32_t* const store_bits = ws.bits.data();
  candidate_segment* const segs = ws.segments.data();

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
    std::uint64_t i = b;
    if constexpr (!is_scalar_arch<Arch>) {
      using ops = lane_ops<Arch>;
      using ibatch = typename ops::ibatch;
      constexpr std::uint32_t w = static_cast<std::uint32_t>(ops::width);
      const ibatch kmask(static_cast<std::int32_t>(key_mask));
      // key >= low_key  <=>  key > low_key - 1 (low_key <= 2^31 - 1, so this is -1 for 0).
      const ibatch low(static_cast<std::int32_t>(low_key) - 1);
      const ibatch edge0(static_cast<std::int32_t>(count_keys[0]) - 1);
      const ibatch edge1(static_cast<std::int32_t>(count_keys[1]) - 1);
      const ibatch step(static_cast<std::int32_t>(w));
      ibatch lane = ops::iota();
      ibatch acc0(0);
      ibatch acc1(0);
      for (; i + w <= e; i += w) {
        const ibatch v = src.template load<Arch>(i);
        const ibatch key = v & kmask;
        const std::uint32_t m = ops::mask_bits(key > low);
        if constexpr (ops::branchless_compress) {
          c += ops::compress2(m, lane, v, st_local + c, st_bits + c);
          if (c > staging_entries - w) [[unlikely]] flush();
        } else {
          if (m != 0) [[unlikely]] {
            c += ops::compress2(m, lane, v, st_local + c, st_bits + c);
            if (c > staging_entries - w) flush();
          }
        }
        if constexpr (Counters > 0) ops::count_into(acc0, key > edge0);
        if constexpr (Counters > 1) ops::count_into(acc1, key > edge1);
        lane += step;
      }
      if constexpr (Counters > 0) cnt0 += static_cast<std::uint64_t>(ops::sum_lanes(acc0));
      if constexpr (Counters > 1) cnt1 += static_cast<std::uint64_t>(ops::sum_lanes(acc1));
    }
    for (; i < e; ++i) {
      const std::uint32_t v = src.load_scalar(i);
      const std::uint32_t key = v & key_mask;
      if (key >= low_key) {
        st_local[c] = static_cast<std::uint32_t>(i - b);
        st_bits[c] = v;
        if (++c == staging_entries) flush();
      }
      if constexpr (Counters > 0) cnt0 += key >= count_keys[0] ? 1u : 0u;
      if constexpr (Counters > 1) cnt1 += key >= count_keys[1] ? 1u : 0u;
    }
    flush();
    if constexpr (Counters > 0) above0.fetch_add(cnt0, std::memory_order_relaxed);
    if constexpr (Counters > 1) above1.fetch_add(cnt1, std::memory_order_relaxed);
  });

  collect_result r;
  r.count = seen.load();
  r.overflow = overflow.load();
  r.at_or_above[0] = above0.load();
  r.at_or_above[1] = above1.load();
  // After an overflow the store has holes: callers fall back to passes that do not use it.
  ws.segment_count = r.overflow ? 0 : nseg.load();
  ws.count = r.overflow ? 0 : r.count;
  std::sort(segs, segs + ws.segment_count, [](const candidate_segment& a, const candidate_segment& b) {
    return a.chunk_begin != b.chunk_begin ? a.chunk_begin < b.chunk_begin : a.offset < b.offset;
  });
  return r;
}

/// The k-th largest key and how many keys are strictly larger.
struct kth_key {
  std::uint32_t key = 0;
  std::uint64_t greater = 0;
};

/// The k-th largest magnitude key among the stored candidates (1 <= k <= ws.count): radix
/// narrowing with 11-bit digits over the range of the keys actually present, each level
/// keeping only the bin that holds the k-th key (so later levels touch few keys).
inline kth_key find_kth_candidate(candidate_workspace& ws, std::uint64_t k, std::uint32_t key_mask) {
  STELLATRAIN_ASSERT(k >= 1 && k <= ws.count, "find_kth_candidate: k out of range");
  const std::uint32_t* const bits = ws.bits.data();
  std::uint32_t* const keys = ws.keys.data();
  std::uint64_t count = ws.count;
  std::uint32_t lo = key_mask;
  std::uint32_t hi = 0;
  for (std::uint64_t j = 0; j < count; ++j) {
    const std::uint32_t key = bits[j] & key_mask;
    lo = std::min(lo, key);
    hi = std::max(hi, key);
  }
  std::uint64_t above = 0;
  std::array<std::uint64_t, radix_bins> hist;
  bool first = true;
  for (;;) {
    if (lo == hi) return {lo, above};
    const std::uint32_t range = hi - lo;
    const int shift = std::max(0, static_cast<int>(std::bit_width(range)) - static_cast<int>(radix_bits));
    const std::uint32_t bins = (range >> shift) + 1;
    std::fill_n(hist.begin(), bins, std::uint64_t{0});
    if (first) {
      for (std::uint64_t j = 0; j < count; ++j) ++hist[((bits[j] & key_mask) - lo) >> shift];
    } else {
      for (std::uint64_t j = 0; j < count; ++j) ++hist[(keys[j] - lo) >> shift];
    }
    std::uint32_t d = bins - 1;
    std::uint64_t cum = 0;
    while (above + cum + hist[d] < k) cum += hist[d--];
    above += cum;
    const std::uint32_t bin_lo = lo + (d << shift);
    if (shift == 0) return {bin_lo, above};
    const std::uint32_t bin_hi = bin_lo + ((1u << shift) - 1u);
    // Keep the keys of bin d, tightening [lo, hi] to what they span.
    std::uint64_t s = 0;
    std::uint32_t new_lo = bin_hi;
    std::uint32_t new_hi = bin_lo;
    for (std::uint64_t j = 0; j < count; ++j) {
      const std::uint32_t key = first ? (bits[j] & key_mask) : keys[j];
      if (key >= bin_lo && key <= bin_hi) {
        keys[s++] = key;
        new_lo = std::min(new_lo, key);
        new_hi = std::max(new_hi, key);
      }
    }
    first = false;
    count = s;
    lo = new_lo;
    hi = new_hi;
  }
}

/// Calls `emit(out, index, bits)` for the selected candidates, in ascending index order with
/// `out` counting from 0: every candidate whose key is above `kth.key`, then of those equal
/// to it the (k - kth.greater) of lowest index. Groups of segments run in parallel; `emit` is
/// called concurrently for different `out`.
template <executor Ex, class Emit>
void emit_candidates(Ex& ex, candidate_workspace& ws, std::uint32_t key_mask, kth_key kth,
                     std::uint64_t k, Emit&& emit) {
  const candidate_segment* const segs = ws.segments.data();
  const std::uint32_t* const local = ws.local.data();
  const std::uint32_t* const bits = ws.bits.data();
  emit_group* const groups = ws.groups.data();
  const std::uint64_t target =
      std::max<std::uint64_t>(8192, ws.count / (4 * std::max<std::size_t>(ex.concurrency(), 1)));
  std::uint64_t ngroups = 0;
  for (std::uint64_t s = 0; s < ws.segment_count;) {
    emit_group g;
    g.seg_begin = s;
    std::uint64_t in_group = 0;
    while (s < ws.segment_count && in_group < target) in_group += segs[s++].count;
    g.seg_end = s;
    groups[ngroups++] = g;
  }
  const std::uint32_t t = kth.key;
  auto count_group = [&](std::size_t gi) {
    emit_group& g = groups[gi];
    std::uint64_t gt = 0;
    std::uint64_t eq = 0;
    for (std::uint64_t s = g.seg_begin; s < g.seg_end; ++s) {
      for (std::uint64_t j = segs[s].offset; j < segs[s].offset + segs[s].count; ++j) {
        const std::uint32_t key = bits[j] & key_mask;
        gt += key > t ? 1u : 0u;
        eq += key == t ? 1u : 0u;
      }
    }
    g.greater = gt;
    g.equal = eq;
  };
  if (ngroups == 1) {
    count_group(0);
  } else {
    ex.bulk(static_cast<std::size_t>(ngroups), count_group);
  }
  std::uint64_t out = 0;
  std::uint64_t ties_left = k - kth.greater;
  for (std::uint64_t gi = 0; gi < ngroups; ++gi) {
    groups[gi].out = out;
    groups[gi].quota = std::min(groups[gi].equal, ties_left);
    ties_left -= groups[gi].quota;
    out += groups[gi].greater + groups[gi].quota;
  }
  auto emit_group_fn = [&](std::size_t gi) {
    const emit_group& g = groups[gi];
    std::uint64_t pos = g.out;
    std::uint64_t quota = g.quota;
    for (std::uint64_t s = g.seg_begin; s < g.seg_end; ++s) {
      const std::uint64_t base = segs[s].chunk_begin;
      for (std::uint64_t j = segs[s].offset; j < segs[s].offset + segs[s].count; ++j) {
        const std::uint32_t key = bits[j] & key_mask;
        if (key > t || (key == t && quota > 0)) {
          if (key == t) --quota;
          emit(pos++, base + local[j], bits[j]);
        }
      }
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
/// holds `samples` keys. Reads through `peek`: no side effects.
template <class Source>
std::uint32_t sample_low_key(const Source& src, std::uint64_t n, std::uint64_t target,
                             std::uint64_t samples, double z, bool jitter, std::uint32_t* scratch) {
  samples = std::clamp<std::uint64_t>(samples, 1, n);
  const std::uint64_t stride = n / samples;
  for (std::uint64_t j = 0; j < samples; ++j) {
    const std::uint64_t pos = j * stride + (jitter ? mix64(j) % stride : 0);
    scratch[j] = src.peek(pos) & Source::key_mask;
  }
  const double expected = static_cast<double>(target) / static_cast<double>(n) * static_cast<double>(samples);
  const double want = std::ceil(expected + z * std::sqrt(expected) + 1.0);
  const auto rank = static_cast<std::uint64_t>(std::clamp(want, 1.0, static_cast<double>(samples)));
  std::nth_element(scratch, scratch + (rank - 1), scratch + samples,
                   [](std::uint32_t a, std::uint32_t b) { return a > b; });
  return std::max<std::uint32_t>(scratch[rank - 1], 1);
}

}  // namespace stellatrain::detail
