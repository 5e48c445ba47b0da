// SPDX-License-Identifier: Apache-2.0
// Exact selection of the k largest magnitudes: a sampled lower bound lets the histogram pass
// of radix select skip (SIMD compare) every element that cannot be in the top k and keep the
// rest as candidates; the candidates are then narrowed exactly. When the bound turns out
// wrong (too high, or too many candidates), full radix passes over the data take over.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/select/detail/candidate_collect.hpp>
#include <stellatrain/select/detail/candidate_emit.hpp>
#include <stellatrain/select/detail/candidate_kth.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

namespace stellatrain::detail {

/// Per-chunk histograms of the full radix passes, allocated on first use only (the path runs
/// only when the sampled bound fails).
struct radix_workspace {
  aligned_buffer<std::uint32_t> hist;  // chunks x radix_bins
  aligned_buffer<std::uint64_t> above;
  aligned_buffer<std::uint64_t> out;
  aligned_buffer<std::uint64_t> quota;

  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t chunks) {
    if (chunks <= above.size()) return;
    const buffer_options opts{.prefault = true};
    hist = aligned_buffer<std::uint32_t>(chunks * radix_bins, opts, ex);
    above = aligned_buffer<std::uint64_t>(chunks, opts, ex);
    out = aligned_buffer<std::uint64_t>(chunks, opts, ex);
    quota = aligned_buffer<std::uint64_t>(chunks, opts, ex);
  }
};

/// The scratch of the selectors built on the candidate pass: its store, and the histograms
/// of the full radix passes.
struct candidate_select_workspace {
  candidate_workspace candidates;
  radix_workspace radix;
};

/// Chunk length of the full radix passes: at most 1024 chunks, so that their per-chunk
/// histograms stay within 8 MiB; a multiple of 64.
[[nodiscard]] constexpr std::uint64_t fallback_grain(std::uint64_t n) noexcept {
  const std::uint64_t g = std::max<std::uint64_t>(select_grain, (n + 1023) / 1024);
  return (g + 63) / 64 * 64;
}

/// How a selection went.
struct select_outcome {
  std::uint32_t kth_key = 0;      ///< key of the k-th selected element (the smallest selected key)
  std::uint64_t count = 0;        ///< elements emitted
  bool candidates_valid = false;  ///< the store holds every element whose key reaches some bound
  bool exact = true;              ///< the selection is the exact top k
  bool fallback = false;          ///< full radix passes ran
  bool deficit = false;           ///< fewer than k candidates: lowest-index elements filled in
  int passes = 0;                 ///< passes over the data
};

[[nodiscard]] inline selection_stats stats_of(const select_outcome& o) noexcept {
  return {.count = o.count,
          .exact = o.exact,
          .passes = o.passes,
          .fallback = o.fallback,
          .deficit = o.deficit};
}

/// Exact top-k by full radix passes over the data (no sampled bound): per level, a histogram
/// of an 11-bit digit of the keys inside the current range, per chunk; the bin holding the
/// k-th key becomes the next range. As soon as the elements at or above the bin fit the
/// candidate store, one candidate pass finishes the job; otherwise, at the last level, the
/// per-chunk counts give each chunk its output offset and its share of the ties, and one more
/// pass emits. Precondition: 0 < k < n. `rd` must read without side effects.
template <class Arch, class Reader, executor Ex, class Emit>
select_outcome radix_select_full(Ex& ex, const Reader& rd, std::uint64_t n, std::uint64_t k,
                                 candidate_workspace& ws, radix_workspace& rw, Emit&& emit) {
  constexpr std::uint32_t key_mask = Reader::key_mask;
  const std::uint64_t grain = fallback_grain(n);
  const std::uint64_t chunks = chunk_count(n, grain);
  rw.reserve(ex, chunks);
  std::uint32_t* const hist = rw.hist.data();
  std::uint64_t* const chunk_above = rw.above.data();
  select_outcome outcome;
  outcome.fallback = true;
  std::uint32_t lo = 0;
  std::uint32_t hi = key_mask;
  std::uint64_t above = 0;
  std::array<std::uint64_t, radix_bins> total;
  for (;;) {
    const std::uint32_t range = hi - lo;
    const int shift =
        std::max(0, static_cast<int>(std::bit_width(range)) - static_cast<int>(radix_bits));
    const std::uint32_t bins = (range >> shift) + 1;
    for_each_chunk(ex, n, grain, [&](std::uint64_t b, std::uint64_t e) {
      std::uint32_t* h = hist + (b / grain) * radix_bins;
      std::fill_n(h, bins, 0u);
      std::uint64_t a = 0;
      for (std::uint64_t i = b; i < e; ++i) {
        const std::uint32_t key = rd.load_scalar(i) & key_mask;
        if (key > hi) {
          ++a;
        } else if (key >= lo) {
          ++h[(key - lo) >> shift];
        }
      }
      chunk_above[b / grain] = a;
    });
    ++outcome.passes;
    std::fill_n(total.begin(), bins, std::uint64_t{0});
    for (std::uint64_t c = 0; c < chunks; ++c) {
      const std::uint32_t* h = hist + c * radix_bins;
      for (std::uint32_t d = 0; d < bins; ++d) total[d] += h[d];
    }
    std::uint32_t d = bins - 1;
    std::uint64_t cum = 0;
    while (above + cum + total[d] < k) cum += total[d--];
    above += cum;
    const std::uint32_t bin_lo = lo + (d << shift);
    const std::uint32_t bin_hi = std::min(hi, bin_lo + ((1u << shift) - 1u));
    const std::uint64_t at_or_above = above + total[d];
    if (at_or_above <= ws.capacity()) {
      [[maybe_unused]] const collect_result r =
          collect_candidates<Arch>(ex, rd, n, bin_lo, {0, 0}, ws);
      ++outcome.passes;
      STELLATRAIN_ASSERT(!r.overflow && r.count == at_or_above,
                         "radix_select_full: recount differs");
      const kth_key kth = find_kth_candidate<Arch>(ex, ws, k, key_mask);
      emit_candidates<Arch>(ex, ws, key_mask, kth, k, emit);
      outcome.kth_key = kth.key;
      outcome.count = k;
      outcome.candidates_valid = true;
      return outcome;
    }
    if (shift == 0) {
      // bin_lo is the k-th key. Per chunk: greater = above the range + bins above d.
      const std::uint32_t t = bin_lo;
      std::uint64_t out = 0;
      std::uint64_t ties_left = k - above;
      for (std::uint64_t c = 0; c < chunks; ++c) {
        const std::uint32_t* h = hist + c * radix_bins;
        std::uint64_t gt = chunk_above[c];
        for (std::uint32_t dd = d + 1; dd < bins; ++dd) gt += h[dd];
        const std::uint64_t q = std::min<std::uint64_t>(h[d], ties_left);
        ties_left -= q;
        rw.out[c] = out;
        rw.quota[c] = q;
        out += gt + q;
      }
      for_each_chunk(ex, n, grain, [&](std::uint64_t b, std::uint64_t e) {
        std::uint64_t pos = rw.out[b / grain];
        std::uint64_t q = rw.quota[b / grain];
        for (std::uint64_t i = b; i < e; ++i) {
          const std::uint32_t v = rd.load_scalar(i);
          const std::uint32_t key = v & key_mask;
          if (key > t || (key == t && q > 0)) {
            if (key == t) --q;
            emit(pos++, i, v);
          }
        }
      });
      ++outcome.passes;
      outcome.kth_key = t;
      outcome.count = k;
      return outcome;
    }
    lo = bin_lo;
    hi = bin_hi;
  }
}

/// Candidate store of the exact selector: the sampled bound keeps about k (1 + a few %).
[[nodiscard]] constexpr std::uint64_t exact_capacity(std::uint64_t n, std::uint64_t k,
                                                     std::uint64_t min_capacity) noexcept {
  return std::min(n, 2 * k + min_capacity);
}

/// Candidate store of the threshold selectors: room for bands that drifted upwards.
[[nodiscard]] constexpr std::uint64_t threshold_capacity(std::uint64_t n, std::uint64_t k,
                                                         std::uint64_t min_capacity) noexcept {
  return std::min(n, 3 * k + min_capacity);
}

/// Tuning of the sampled bound of `select_exact`.
struct exact_tuning {
  std::uint64_t samples = 16384;  ///< elements sampled (one per stratum, jittered)
  double z = 4.0;                 ///< safety margin in standard deviations of the sample count
  bool jitter = true;             ///< false: strided sample (stratum starts)
};

/// Exact top-k of `src` (0 < k < n), emitted through `emit(out, index, bits)` in ascending
/// index order. `sample_target` (>= k) is the rank the sampled bound aims to include (a larger
/// target leaves more candidates for a caller that wants a quantile below the k-th).
/// The first pass over `src` is its only transforming pass; later passes use `src.reread()`.
template <class Arch, class Source, executor Ex, class Emit>
select_outcome select_exact(Ex& ex, const Source& src, std::uint64_t n, std::uint64_t k,
                            std::uint64_t sample_target, const exact_tuning& tuning,
                            candidate_workspace& ws, radix_workspace& rw, Emit&& emit) {
  constexpr std::uint32_t key_mask = Source::key_mask;
  STELLATRAIN_ASSERT(k > 0 && k < n, "select_exact: needs 0 < k < n");
  [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
  select_outcome outcome;
  std::uint32_t low = 0;
  if (n > ws.capacity()) {
    low = sample_low_key(ex, src, n, std::max(sample_target, k), tuning.samples, tuning.z,
                         tuning.jitter, ws.keys.data());
  }
  const collect_result r = collect_candidates<Arch>(ex, src, n, low, {0, 0}, ws);
  outcome.passes = 1;
  if (!r.overflow && r.count >= k) {
    const kth_key kth = find_kth_candidate<Arch>(ex, ws, k, key_mask);
    emit_candidates<Arch>(ex, ws, key_mask, kth, k, emit);
    outcome.kth_key = kth.key;
    outcome.count = k;
    outcome.candidates_valid = true;
    return outcome;
  }
  if (!r.overflow && low == 1) {
    // Every element left out is a zero: the lowest-index zeros are exactly the ties to take.
    emit_all_with_fill(ws, k - r.count, n, src.reread(), emit);
    outcome.kth_key = 0;
    outcome.count = k;
    outcome.candidates_valid = true;
    return outcome;
  }
  select_outcome full = radix_select_full<Arch>(ex, src.reread(), n, k, ws, rw, emit);
  full.passes += 1;
  return full;
}

}  // namespace stellatrain::detail
