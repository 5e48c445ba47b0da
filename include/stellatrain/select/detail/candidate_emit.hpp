// SPDX-License-Identifier: Apache-2.0
// The emit phase of the candidate pass: the stored candidates above the k-th key, and as many
// of its ties as the selection takes (lowest index first), handed to the sink in index order.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace stellatrain::detail {

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

}  // namespace stellatrain::detail
