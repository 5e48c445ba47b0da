// SPDX-License-Identifier: Apache-2.0
// A sequential emulation of the GPU radix select (select/detail/radix_select_kernels.cuh): the
// same steps in the same order, calling the same decision functions of radix_select_plan.hpp,
// with the candidate buffers shuffled after every append step (the device appends in an
// arbitrary order). The host tests compare it with the scalar oracle, so every decision the
// device makes is checked without a GPU; what is left to the device tests is the CUDA
// mechanics (warp votes, atomics, the last-block hand-over).
#pragma once

#include <stellatrain/select/detail/radix_select_plan.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace stellatrain::test {

struct emulator_options {
  std::uint64_t cap0 = 0;  // 0: as the workspace plan sizes it (with the fractions below)
  std::uint64_t cap1 = 0;
  double candidate_fraction = 1.0 / 32;
  double threshold_factor = 2.0;
  std::uint32_t threshold_key = 0;  // 0: exact selection; else threshold mode with this key
  bool threshold_mode = false;      // run the histogram step (as the threshold entry points do)
  std::uint64_t shuffle_seed = 1;
  unsigned block_threads = 512;  // pieces of the parallel bucket choice
};

struct emulated_selection {
  std::vector<std::uint64_t> indices;  // ascending, as the compaction writes them
  detail::radix_state state{};
  std::uint32_t full_reads = 0;    // passes that read every element
  std::uint32_t buffer_reads = 0;  // passes that read a candidate buffer
  std::uint64_t cap0 = 0;
  std::uint64_t cap1 = 0;
};

/// The device's bucket choice: the rank positions cut into `threads` pieces of equal length,
/// each scanned from the exclusive prefix of the pieces before it.
inline detail::radix_step_result parallel_choose(const std::vector<std::uint64_t>& hist,
                                                 const detail::radix_plan& p, std::uint32_t level,
                                                 std::uint64_t k, unsigned threads) {
  const unsigned per = detail::device_radix_bins / threads;
  const std::uint32_t bins = 1u << p.digit(level).bits;
  std::vector<std::uint64_t> by_position(detail::device_radix_bins, 0);
  for (std::uint32_t pos = 0; pos < detail::device_radix_bins; ++pos) {
    by_position[pos] = pos < bins ? hist[detail::radix_position_digit(p, level, pos)] : 0;
  }
  detail::radix_step_result r{0, {0, 0, 0, false}, 0};
  std::uint64_t before = 0;
  int found = 0;
  for (unsigned t = 0; t < threads; ++t) {
    detail::radix_crossing mine{0, 0, 0, false};
    detail::radix_find_crossing(by_position.data() + t * per, per, t * per, before, k, mine);
    if (mine.found) {
      r.crossing = mine;
      ++found;
    }
    for (unsigned j = 0; j < per; ++j) before += by_position[t * per + j];
  }
  r.total = before;
  if (found > 1) r.crossing.found = false;  // the device would race: make the test fail
  return r;
}

/// Emulates one selection of the top min(k, n) of `keys` (magnitude keys of `key_bits` bits).
inline emulated_selection emulate_radix_select(std::span<const std::uint32_t> keys,
                                               std::uint32_t key_bits, std::uint64_t k,
                                               const emulator_options& o = {}) {
  using namespace stellatrain::detail;
  emulated_selection out;
  const std::uint64_t n = keys.size();
  const std::uint64_t kk = std::min<std::uint64_t>(k, n);
  candidate_capacities(n, kk, o.candidate_fraction, o.threshold_factor, out.cap0, out.cap1);
  if (o.cap0 != 0) out.cap0 = o.cap0;
  if (o.cap1 != 0) out.cap1 = o.cap1;
  const std::uint64_t cap0 = out.cap0;
  const std::uint64_t cap1 = out.cap1;
  if (kk == 0) return out;

  const radix_plan plan = make_radix_plan(key_bits, n);
  std::mt19937_64 rng(o.shuffle_seed);
  radix_state& s = out.state;
  s = {};
  std::vector<std::uint32_t> bitmap(bitmap_words(n), 0xdeadbeefu);  // the scan must clear it
  std::array<std::vector<std::uint64_t>, 2> buffers{std::vector<std::uint64_t>(cap0),
                                                    std::vector<std::uint64_t>(cap1)};
  std::vector<std::uint64_t> hist(device_radix_bins);

  // Step 0: scan.
  {
    std::fill(hist.begin(), hist.end(), 0);
    const std::uint32_t threshold = o.threshold_key;
    const bool append = threshold != 0 || n <= cap0;
    std::uint64_t appended = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      if (i % 32 == 0) bitmap[i / 32] = 0;
      const std::uint32_t key = keys[i];
      if (key < threshold) continue;
      ++hist[plan.digit(0).of(key)];
      if (append) {
        const std::uint64_t pos = appended++;
        if (pos < cap0) buffers[0][pos] = i;
      }
    }
    std::shuffle(buffers[0].begin(),
                 buffers[0].begin() + static_cast<std::ptrdiff_t>(std::min(appended, cap0)), rng);
    ++out.full_reads;
    radix_step_result r = parallel_choose(hist, plan, 0, kk, o.block_threads);
    r.appended = appended;
    radix_finish_scan(s, plan, kk, threshold, cap0, r);
  }
  // Step 1: histogram after a threshold miss.
  if (o.threshold_mode && s.phase == radix_need_histogram) {
    std::fill(hist.begin(), hist.end(), 0);
    for (std::uint64_t i = 0; i < n; ++i) ++hist[plan.digit(0).of(keys[i])];
    ++out.full_reads;
    const radix_step_result r = parallel_choose(hist, plan, 0, kk, o.block_threads);
    radix_finish_histogram(s, plan, kk, r);
  }
  // Steps 2 + l: classify, one launch per level.
  for (std::uint32_t launch = 0; launch < plan.levels(); ++launch) {
    if (s.phase != radix_running && s.phase != radix_all_in) continue;
    const radix_state before = s;
    const bool all_in = before.phase == radix_all_in;
    const radix_io io = radix_classify_io(before, cap0, cap1);
    std::vector<std::uint64_t>* dst =
        io.write == radix_from_buffer0 ? &buffers[0]
                                       : (io.write == radix_from_buffer1 ? &buffers[1] : nullptr);
    const std::uint64_t dst_cap = io.write == radix_from_buffer0 ? cap0 : cap1;
    std::vector<std::uint64_t> dst_content;
    std::fill(hist.begin(), hist.end(), 0);
    std::uint64_t appended = 0;
    auto visit = [&](std::uint64_t i) {
      const std::uint32_t key = keys[i];
      const radix_class c = radix_classify(before, plan, key, i);
      if (c == radix_class::winner || (all_in && c == radix_class::candidate))
        bitmap[i / 32] |= 1u << (i % 32);
      if (!all_in && c == radix_class::candidate) {
        ++hist[radix_next_digit(before, plan, key, i)];
        if (dst != nullptr) {
          const std::uint64_t pos = appended++;
          if (pos < dst_cap) dst_content.push_back(i);
        }
      }
    };
    if (io.read == radix_from_input) {
      for (std::uint64_t i = 0; i < n; ++i) visit(i);
      ++out.full_reads;
    } else {
      const auto& src = buffers[io.read == radix_from_buffer0 ? 0 : 1];
      for (std::uint64_t j = 0; j < before.source_count; ++j)
        visit(src.at(j));  // .at: a claim past the capacity throws
      ++out.buffer_reads;
    }
    if (dst != nullptr) {
      std::shuffle(dst_content.begin(), dst_content.end(), rng);
      std::copy(dst_content.begin(), dst_content.end(), dst->begin());
    }
    radix_step_result r{0, {0, 0, 0, false}, 0};
    if (!all_in)
      r = parallel_choose(hist, plan, before.level + 1, before.k_remaining, o.block_threads);
    r.appended = appended;
    radix_finish_classify(s, plan, io, dst_cap, r);
  }

  // Compaction: tile counts, exclusive scan over tiles, then per-thread words in order.
  const std::uint64_t tiles = compaction_tiles(n);
  std::vector<std::uint64_t> tile_offset(tiles + 1, 0);
  for (std::uint64_t t = 0; t < tiles; ++t) {
    std::uint64_t c = 0;
    for (std::uint64_t w = t * compaction_tile_words;
         w < std::min<std::uint64_t>((t + 1) * compaction_tile_words, bitmap.size()); ++w) {
      c += static_cast<std::uint64_t>(std::popcount(bitmap[w]));
    }
    tile_offset[t + 1] = tile_offset[t] + c;
  }
  out.indices.assign(tile_offset[tiles], ~std::uint64_t{0});
  for (std::uint64_t t = 0; t < tiles; ++t) {
    std::uint64_t pos = tile_offset[t];
    for (std::uint64_t w = t * compaction_tile_words;
         w < std::min<std::uint64_t>((t + 1) * compaction_tile_words, bitmap.size()); ++w) {
      for_each_set_bit(bitmap[w], w, [&](std::uint64_t i) { out.indices[pos++] = i; });
    }
  }
  return out;
}

}  // namespace stellatrain::test
