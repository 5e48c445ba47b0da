// SPDX-License-Identifier: Apache-2.0
// The candidate pass of the magnitude selectors, in three phases over one store: collect
// (candidate_collect.hpp: one streaming pass keeps every element whose key reaches a lower
// bound), the k-th search (candidate_kth.hpp: radix narrowing on the few candidates) and emit
// (candidate_emit.hpp: the chosen candidates in index order). Here: the store, its tuning and
// what the phases hand each other.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/executor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

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

/// The k-th largest key and how many keys are strictly larger.
struct kth_key {
  std::uint32_t key = 0;
  std::uint64_t greater = 0;
};

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

}  // namespace stellatrain::detail
