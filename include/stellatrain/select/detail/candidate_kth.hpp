// SPDX-License-Identifier: Apache-2.0
// The k-th search of the candidate pass: the exact k-th largest key among the stored
// candidates by radix narrowing with 11-bit digits over the range of the keys present.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

namespace stellatrain::detail {

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

}  // namespace stellatrain::detail
