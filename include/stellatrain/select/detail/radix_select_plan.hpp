// SPDX-License-Identifier: Apache-2.0
// The logic of the GPU radix select that does not depend on CUDA (keys: keys.hpp): digit plans,
// the per-element classification, the bucket choice, the state machine between passes, the
// threshold update and the workspace layout. Kernels and the host emulator in the tests call
// the same functions, so the CPU tests check what the device runs.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/topk_threshold_state.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace stellatrain::detail {

// ------------------------------------------------------------------ digits and levels
// Keys are resolved in 11-bit digits from the top (31 = 11 + 11 + 9 bits, 15 = 11 + 4); ties
// in the key are then resolved by the index, again in 11-bit digits from the top, choosing the
// lowest indices. A "level" is one digit of this composite (key, index) order.

inline constexpr std::uint32_t radix_digit_bits = 11;
inline constexpr std::uint32_t device_radix_bins = 1u << radix_digit_bits;

struct radix_digit {
  std::uint32_t shift;
  std::uint32_t bits;
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint32_t of(std::uint64_t v) const noexcept {
    return static_cast<std::uint32_t>((v >> shift) & ((std::uint64_t{1} << bits) - 1u));
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint64_t mask() const noexcept {
    return ((std::uint64_t{1} << bits) - 1u) << shift;
  }
};

/// Number of digits of a field of `bits` bits.
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t radix_levels_of(std::uint32_t bits) noexcept {
  return (bits + radix_digit_bits - 1) / radix_digit_bits;
}

/// Digit `j` (0 = most significant) of a field of `bits` bits; the last digit takes the rest.
STELLATRAIN_HOST_DEVICE constexpr radix_digit radix_field_digit(std::uint32_t bits,
                                                                std::uint32_t j) noexcept {
  const std::uint32_t top = bits - radix_digit_bits * j;
  const std::uint32_t width = top < radix_digit_bits ? top : radix_digit_bits;
  return {top - width, width};
}

/// Bits needed for indices below `n` (0 for n <= 1).
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t index_bits_of(std::uint64_t n) noexcept {
  std::uint32_t bits = 0;
  for (std::uint64_t v = n > 0 ? n - 1 : 0; v != 0; v >>= 1) ++bits;
  return bits;
}

struct radix_plan {
  std::uint32_t key_bits;
  std::uint32_t key_levels;
  std::uint32_t index_bits;
  std::uint32_t index_levels;

  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint32_t levels() const noexcept {
    return key_levels + index_levels;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr bool is_key_level(
      std::uint32_t level) const noexcept {
    return level < key_levels;
  }
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr radix_digit digit(
      std::uint32_t level) const noexcept {
    return level < key_levels ? radix_field_digit(key_bits, level)
                              : radix_field_digit(index_bits, level - key_levels);
  }
  /// Mask of all key bits.
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint32_t key_mask() const noexcept {
    return static_cast<std::uint32_t>((std::uint64_t{1} << key_bits) - 1u);
  }
};

STELLATRAIN_HOST_DEVICE constexpr radix_plan make_radix_plan(std::uint32_t key_bits,
                                                             std::uint64_t n) noexcept {
  const std::uint32_t index_bits = index_bits_of(n);
  return {key_bits, radix_levels_of(key_bits), index_bits, radix_levels_of(index_bits)};
}

// Steps of one selection, each one kernel launch (a step with nothing to do returns at once):
//   step 0            scan: every element; histogram of key digit 0 of the candidates (key >=
//                     threshold; all elements when there is none); candidates into buffer 0
//   step 1            histogram: every element, key digit 0 (runs only after a threshold miss)
//   step 2 + l        classify by the bucket chosen at level l: winners marked in the bitmap,
//                     the tied bucket histogrammed by digit l + 1 and buffered when it fits
inline constexpr std::uint32_t radix_step_scan = 0;
inline constexpr std::uint32_t radix_step_histogram = 1;
inline constexpr std::uint32_t radix_first_classify_step = 2;

STELLATRAIN_HOST_DEVICE constexpr std::uint32_t radix_steps(const radix_plan& p) noexcept {
  return radix_first_classify_step + p.levels();
}

// ------------------------------------------------------------------ state between passes

enum radix_phase : std::uint32_t {
  radix_need_histogram = 0,  ///< no bucket chosen yet (also the zeroed state)
  radix_running = 1,         ///< a bucket is chosen at `level`; its elements are still tied
  radix_all_in = 2,          ///< every element of the chosen bucket is selected
  radix_done = 3,            ///< the bitmap holds exactly the selection
};

enum radix_source : std::uint32_t {
  radix_from_input = 0,
  radix_from_buffer0 = 1,
  radix_from_buffer1 = 2
};
inline constexpr std::uint32_t radix_no_buffer = 0;

/// Device-resident state of one selection; zero bytes are the initial state.
struct radix_state {
  std::uint32_t phase;         // radix_phase
  std::uint32_t level;         // the level whose bucket was chosen last
  std::uint32_t key_prefix;    // key bits decided so far (in place)
  std::uint32_t key_mask;      // which key bits are decided
  std::uint64_t index_prefix;  // index bits decided so far (in place)
  std::uint64_t index_mask;
  std::uint64_t k_remaining;   // how many of the candidates are still to be selected
  std::uint64_t candidates;    // elements in the chosen bucket (the tied ones)
  std::uint64_t source_count;  // entries in the buffer the candidates are read from
  std::uint32_t chosen;        // digit chosen at `level`
  std::uint32_t source;        // radix_source: where the candidates are read from
  std::uint32_t status;        // selection_status bits
  std::uint32_t flags;         // selection_flag_* bits
  std::uint64_t scan_total;    // candidates found by the scan step (threshold statistics)
};

/// Where a step reads candidates from and which buffer (if any) it appends the new ones to.
struct radix_io {
  std::uint32_t read;   // radix_source
  std::uint32_t write;  // radix_from_buffer0/1, or radix_no_buffer
};

/// The classify step's input and output given the state before it: read where the
/// candidates are; append the tied bucket to the other buffer when it fits there.
STELLATRAIN_HOST_DEVICE constexpr radix_io radix_classify_io(const radix_state& s,
                                                             std::uint64_t cap0,
                                                             std::uint64_t cap1) noexcept {
  if (s.phase != radix_running) return {s.source, radix_no_buffer};
  const std::uint32_t dst =
      s.source == radix_from_buffer0 ? radix_from_buffer1 : radix_from_buffer0;
  const std::uint64_t cap = dst == radix_from_buffer0 ? cap0 : cap1;
  return {s.source, s.candidates <= cap ? dst : radix_no_buffer};
}

enum class radix_class : std::uint32_t { skip, loser, winner, candidate };

/// How a classify step treats an element with magnitude key `key` at `index`: `skip` if it was
/// not a candidate before this level, else by its digit at `s.level` against the chosen one
/// (key levels: larger wins; index levels: smaller wins).
STELLATRAIN_HOST_DEVICE constexpr radix_class radix_classify(const radix_state& s,
                                                             const radix_plan& p, std::uint32_t key,
                                                             std::uint64_t index) noexcept {
  const radix_digit d = p.digit(s.level);
  if (p.is_key_level(s.level)) {
    const std::uint32_t before = s.key_mask & ~static_cast<std::uint32_t>(d.mask());
    if ((key & before) != (s.key_prefix & before)) return radix_class::skip;
    const std::uint32_t digit = d.of(key);
    if (digit > s.chosen) return radix_class::winner;
    return digit == s.chosen ? radix_class::candidate : radix_class::loser;
  }
  if (key != s.key_prefix) return radix_class::skip;
  const std::uint64_t before = s.index_mask & ~d.mask();
  if ((index & before) != (s.index_prefix & before)) return radix_class::skip;
  const std::uint32_t digit = d.of(index);
  if (digit < s.chosen) return radix_class::winner;
  return digit == s.chosen ? radix_class::candidate : radix_class::loser;
}

/// The digit a candidate is histogrammed by in a classify step (the next level).
/// Precondition: s.level + 1 < p.levels().
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t radix_next_digit(const radix_state& s,
                                                                 const radix_plan& p,
                                                                 std::uint32_t key,
                                                                 std::uint64_t index) noexcept {
  const std::uint32_t level = s.level + 1;
  return p.is_key_level(level) ? p.digit(level).of(key) : p.digit(level).of(index);
}

// ------------------------------------------------------------------ bucket choice

/// Histogram positions are visited in rank order: descending digits for key levels (larger
/// keys first), ascending for index levels (lower indices first).
STELLATRAIN_HOST_DEVICE constexpr std::uint32_t radix_position_digit(
    const radix_plan& p, std::uint32_t level, std::uint32_t position) noexcept {
  const std::uint32_t bins = 1u << p.digit(level).bits;
  return p.is_key_level(level) ? bins - 1u - position : position;
}

struct radix_crossing {
  std::uint32_t position;  // rank-order position of the bucket that holds the k-th element
  std::uint64_t before;    // elements in positions before it (all selected)
  std::uint64_t count;     // elements in it
  bool found;
};

/// Scans `num` counts that start at rank position `first` and follow `cum` earlier elements;
/// records the position where the running total first reaches `k`. Exactly one position of a
/// histogram satisfies `cum < k <= cum + count` when 1 <= k <= total, so the counts can be cut
/// into pieces, each scanned with its own exclusive prefix (one piece per GPU thread).
STELLATRAIN_HOST_DEVICE constexpr void radix_find_crossing(const std::uint64_t* counts,
                                                           std::uint32_t num, std::uint32_t first,
                                                           std::uint64_t cum, std::uint64_t k,
                                                           radix_crossing& out) noexcept {
  for (std::uint32_t j = 0; j < num; ++j) {
    const std::uint64_t c = counts[j];
    if (cum < k && k <= cum + c) out = {first + j, cum, c, true};
    cum += c;
  }
}

/// Serial bucket choice over a histogram indexed by digit (the host emulator's; the device
/// does the same with one piece per thread).
STELLATRAIN_HOST_DEVICE constexpr radix_crossing radix_choose(const std::uint64_t* hist_by_digit,
                                                              const radix_plan& p,
                                                              std::uint32_t level,
                                                              std::uint64_t k) noexcept {
  radix_crossing c{0, 0, 0, false};
  const std::uint32_t bins = 1u << p.digit(level).bits;
  std::uint64_t cum = 0;
  for (std::uint32_t pos = 0; pos < bins; ++pos) {
    const std::uint64_t h = hist_by_digit[radix_position_digit(p, level, pos)];
    radix_find_crossing(&h, 1, pos, cum, k, c);
    cum += h;
  }
  return c;
}

/// Records the bucket chosen at `level` (its rank position, the elements before it and in it).
STELLATRAIN_HOST_DEVICE constexpr void radix_apply_choice(radix_state& s, const radix_plan& p,
                                                          std::uint32_t level,
                                                          const radix_crossing& c) noexcept {
  const radix_digit d = p.digit(level);
  const std::uint32_t digit = radix_position_digit(p, level, c.position);
  if (p.is_key_level(level)) {
    s.key_prefix |= digit << d.shift;
    s.key_mask |= static_cast<std::uint32_t>(d.mask());
  } else {
    s.index_prefix |= static_cast<std::uint64_t>(digit) << d.shift;
    s.index_mask |= d.mask();
  }
  s.level = level;
  s.chosen = digit;
  s.k_remaining -= c.before;
  s.candidates = c.count;
  if (c.count == s.k_remaining) {
    s.phase = radix_all_in;
  } else if (level + 1 == p.levels()) {
    // At the last level a bucket is one (key, index) pair: it must be taken whole.
    s.phase = radix_all_in;
    s.status |= 1u;  // selection_status::inconsistent_counts
  } else {
    s.phase = radix_running;
  }
}

/// What the last block of a step does once the step's histogram is complete.
///   total: sum of the histogram; crossing: the bucket choice for `k` over it;
///   appended: entries appended to the buffer this step wrote (if any).
struct radix_step_result {
  std::uint64_t total;
  radix_crossing crossing;
  std::uint64_t appended;
};

/// Scan step. `threshold_key` > 0 restricts the candidates to keys >= it; the scan then
/// succeeds if it found at least `k` candidates and buffer 0 held them all, and otherwise hands
/// over to the full histogram step (a "threshold miss"). Without a threshold the histogram
/// covers every element, so the choice stands whether or not the elements fit in buffer 0.
STELLATRAIN_HOST_DEVICE constexpr void radix_finish_scan(radix_state& s, const radix_plan& p,
                                                         std::uint64_t k,
                                                         std::uint32_t threshold_key,
                                                         std::uint64_t cap0,
                                                         const radix_step_result& r) noexcept {
  s.scan_total = r.total;
  const bool buffered = r.total <= cap0;
  if (threshold_key != 0) {
    s.flags |= 2u;  // selection_flag_threshold_used
    if (r.total < k || !buffered) {
      s.flags |= 1u;  // selection_flag_threshold_fallback
      s.phase = radix_need_histogram;
      return;
    }
  }
  if (buffered && r.appended != r.total) s.status |= 2u;  // selection_status::buffer_overflow
  if (!r.crossing.found) {  // only if the counts are broken: end rather than loop
    s.status |= 1u;
    s.phase = radix_done;
    return;
  }
  s.k_remaining = k;
  s.source = buffered ? radix_from_buffer0 : radix_from_input;
  s.source_count = buffered ? r.total : 0;
  radix_apply_choice(s, p, 0, r.crossing);
}

/// Histogram step (after a threshold miss): the choice over every element.
STELLATRAIN_HOST_DEVICE constexpr void radix_finish_histogram(radix_state& s, const radix_plan& p,
                                                              std::uint64_t k,
                                                              const radix_step_result& r) noexcept {
  if (!r.crossing.found) {
    s.status |= 1u;
    s.phase = radix_done;
    return;
  }
  s.k_remaining = k;
  s.source = radix_from_input;
  s.source_count = 0;
  radix_apply_choice(s, p, 0, r.crossing);
}

/// Classify step; `io` is what `radix_classify_io` said before the step, `write_cap` the
/// capacity of the buffer it wrote.
STELLATRAIN_HOST_DEVICE constexpr void radix_finish_classify(radix_state& s, const radix_plan& p,
                                                             radix_io io, std::uint64_t write_cap,
                                                             const radix_step_result& r) noexcept {
  if (s.phase == radix_all_in) {
    s.phase = radix_done;
    return;
  }
  if (r.total != s.candidates || !r.crossing.found) s.status |= 1u;  // inconsistent_counts
  if (io.write != radix_no_buffer) {
    if (r.appended != s.candidates || r.appended > write_cap) s.status |= 2u;  // buffer_overflow
    s.source = io.write;
    s.source_count = s.candidates;
  }
  if (!r.crossing.found) {  // cannot happen when the counts agree; end rather than loop
    s.phase = radix_done;
    return;
  }
  radix_apply_choice(s, p, s.level + 1, r.crossing);
}

// ------------------------------------------------------------------ persistent threshold

struct threshold_update_options {
  float initial_slack;
  float min_slack;
  float max_slack;
};

/// The state after a selection whose k-th element has magnitude key at least `kth_key`:
/// the slack widens after a miss with too few candidates, narrows after one with too many, and
/// decays slowly towards `min_slack` while the threshold holds (an AIMD rule on the margin).
template <class T>
STELLATRAIN_HOST_DEVICE constexpr void update_threshold_state(
    topk_threshold_state& t, std::uint32_t kth_key, std::uint32_t flags, std::uint64_t scan_total,
    std::uint64_t k, const threshold_update_options& o) noexcept {
  float slack = t.slack > 0.0f ? t.slack : o.initial_slack;
  const bool used = (flags & 2u) != 0;
  const bool missed = (flags & 1u) != 0;
  if (used) {
    t.candidates = scan_total;
    if (missed) {
      ++t.misses;
      slack = scan_total < k ? slack * 2.0f + 0.01f : slack * 0.5f;
    } else {
      slack *= 0.95f;
    }
  }
  slack = slack < o.min_slack ? o.min_slack : (slack > o.max_slack ? o.max_slack : slack);
  t.slack = slack;
  ++t.calls;
  if (kth_key == 0 || kth_key >= infinity_key<T>) {
    t.key = 0;  // nothing useful to carry: the next selection runs exact
    return;
  }
  const float lowered = key_value<T>(kth_key) * (1.0f - slack);
  t.key = magnitude_key(from_float<T>(lowered));
}

// ------------------------------------------------------------------ compaction and values

/// Words of the selection bitmap (one bit per element) and tiles of the compaction.
inline constexpr std::uint32_t compaction_threads = 256;
inline constexpr std::uint32_t compaction_words_per_thread = 8;
inline constexpr std::uint32_t compaction_tile_words =
    compaction_threads * compaction_words_per_thread;

STELLATRAIN_HOST_DEVICE constexpr std::uint64_t bitmap_words(std::uint64_t n) noexcept {
  return (n + 31) / 32;
}
STELLATRAIN_HOST_DEVICE constexpr std::uint64_t compaction_tiles(std::uint64_t n) noexcept {
  return (bitmap_words(n) + compaction_tile_words - 1) / compaction_tile_words;
}

/// Calls `emit(index)` for each set bit of `word` (bitmap word `w`), lowest index first.
template <class Emit>
STELLATRAIN_HOST_DEVICE void for_each_set_bit(std::uint32_t word, std::uint64_t w, Emit&& emit) {
  while (word != 0) {
#if STELLATRAIN_DEVICE_PASS
    const auto bit = static_cast<std::uint32_t>(__ffs(static_cast<int>(word)) - 1);
#else
    const auto bit = static_cast<std::uint32_t>(std::countr_zero(word));
#endif
    emit(w * 32 + bit);
    word &= word - 1u;
  }
}

/// Error feedback for one selected element: the value sent is `acc` rounded to `Out`; what
/// rounding lost stays in the residual. A non-finite difference (a NaN or infinite `acc`, or a
/// finite one that overflowed `Out`) is not fed back: the residual becomes 0 and the
/// non-finite value goes downstream, where the optimizer's policy for it applies.
template <class Out>
STELLATRAIN_HOST_DEVICE constexpr float quantize_with_feedback(float acc, Out& sent) noexcept {
  sent = from_float<Out>(acc);
  const float err = acc - to_float(sent);
  // err - err is 0 for finite err and NaN otherwise (no <cmath> needed on either side).
  return (err - err) == 0.0f ? err : 0.0f;
}

/// Converts a selected input value to the output type; the same type is copied bit for bit.
template <class Out, class In>
STELLATRAIN_HOST_DEVICE constexpr Out convert_value(In v) noexcept {
  if constexpr (std::is_same_v<Out, In>) {
    return v;
  } else {
    return from_float<Out>(to_float(v));
  }
}

// ------------------------------------------------------------------ workspace layout

inline constexpr std::size_t workspace_alignment = 256;

STELLATRAIN_HOST_DEVICE constexpr std::size_t align_workspace(std::size_t bytes) noexcept {
  return (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
}

/// Capacities of the two candidate buffers.
///   fraction: buffer 1 holds fraction x n candidates (at least min(n, 65536));
///   threshold_factor: buffer 0 also holds threshold_factor x k (a threshold scan's candidates).
STELLATRAIN_HOST_DEVICE constexpr void candidate_capacities(std::uint64_t n, std::uint64_t k,
                                                            double fraction,
                                                            double threshold_factor,
                                                            std::uint64_t& cap0,
                                                            std::uint64_t& cap1) noexcept {
  const std::uint64_t floor_cap = n < 65536 ? n : 65536;
  auto scaled = [&](double f, std::uint64_t base) {
    const double v = f * static_cast<double>(base);
    return v >= static_cast<double>(n) ? n : static_cast<std::uint64_t>(v) + 1u;
  };
  std::uint64_t c1 = scaled(fraction, n);
  c1 = c1 < floor_cap ? floor_cap : (c1 > n ? n : c1);
  std::uint64_t c0 = threshold_factor > 0.0 ? scaled(threshold_factor, k) : 0;
  c0 = c0 < c1 ? c1 : (c0 > n ? n : c0);
  cap0 = c0;
  cap1 = c1;
}

/// Where each part of a selection's workspace lives (byte offsets from a 256-byte aligned base).
/// The control block [0, control_bytes) is cleared at the start of every selection.
struct radix_workspace_layout {
  std::size_t state;       // radix_state
  std::size_t tickets;     // u32 per step: blocks that finished the step
  std::size_t appended;    // u64 per step: buffer append cursor
  std::size_t histograms;  // u64[steps][device_radix_bins]
  std::size_t control_bytes;
  std::size_t buffer0;        // cap0 entries of entry_bytes
  std::size_t buffer1;        // cap1 entries
  std::size_t bitmap;         // u32 per 32 elements
  std::size_t tile_counts;    // u64 per compaction tile
  std::size_t tile_offsets;   // u64 per compaction tile
  std::size_t scan_temp;      // CUB scan temporary storage
  std::size_t sample_keys;    // u32 per sample (sampled threshold)
  std::size_t sample_sorted;  // u32 per sample
  std::size_t sort_temp;      // CUB sort temporary storage
  std::size_t cub_keys;       // u64 per selected element (cub::DeviceTopK backend)
  std::size_t cub_temp;       // cub::DeviceTopK temporary storage
  std::size_t scan_temp_bytes;
  std::size_t sort_temp_bytes;
  std::size_t cub_temp_bytes;
  std::size_t total;  // bytes, plus workspace_alignment slack for an unaligned base
  std::uint64_t cap0;
  std::uint64_t cap1;
  std::uint32_t entry_bytes;  // 4 when n <= 2^32, else 8
  std::uint32_t steps;
  std::uint64_t tiles;
  std::uint64_t words;
  std::uint64_t samples;
};

inline constexpr radix_workspace_layout plan_radix_workspace(
    std::uint64_t n, std::uint64_t k, const radix_plan& p, double fraction, double threshold_factor,
    std::size_t scan_temp_bytes, std::uint64_t samples, std::size_t sort_temp_bytes,
    std::uint64_t cub_keys, std::size_t cub_temp_bytes) noexcept {
  radix_workspace_layout w{};
  w.steps = radix_steps(p);
  w.entry_bytes = n <= (std::uint64_t{1} << 32) ? 4u : 8u;
  candidate_capacities(n, k, fraction, threshold_factor, w.cap0, w.cap1);
  w.words = bitmap_words(n);
  w.tiles = compaction_tiles(n);
  w.samples = samples;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t here = at;
    at = align_workspace(at + bytes);
    return here;
  };
  w.state = take(sizeof(radix_state));
  w.tickets = take(sizeof(std::uint32_t) * w.steps);
  w.appended = take(sizeof(std::uint64_t) * w.steps);
  w.histograms = take(sizeof(std::uint64_t) * device_radix_bins * w.steps);
  w.control_bytes = at;
  w.buffer0 = take(static_cast<std::size_t>(w.cap0) * w.entry_bytes);
  w.buffer1 = take(static_cast<std::size_t>(w.cap1) * w.entry_bytes);
  w.bitmap = take(static_cast<std::size_t>(w.words) * sizeof(std::uint32_t));
  w.tile_counts = take(static_cast<std::size_t>(w.tiles) * sizeof(std::uint64_t));
  w.tile_offsets = take(static_cast<std::size_t>(w.tiles) * sizeof(std::uint64_t));
  w.scan_temp = take(scan_temp_bytes);
  w.sample_keys = take(static_cast<std::size_t>(samples) * sizeof(std::uint32_t));
  w.sample_sorted = take(static_cast<std::size_t>(samples) * sizeof(std::uint32_t));
  w.sort_temp = take(sort_temp_bytes);
  w.cub_keys = take(static_cast<std::size_t>(cub_keys) * sizeof(std::uint64_t));
  w.cub_temp = take(cub_temp_bytes);
  w.scan_temp_bytes = scan_temp_bytes;
  w.sort_temp_bytes = sort_temp_bytes;
  w.cub_temp_bytes = cub_temp_bytes;
  w.total = at + workspace_alignment;
  return w;
}

/// Sample positions of the sampled threshold: one per stride of n / samples, jittered inside
/// its stride by a hash of (j, seed) so that a periodic pattern in the tensor does not alias.
STELLATRAIN_HOST_DEVICE constexpr std::uint64_t sample_position(std::uint64_t j,
                                                                std::uint64_t stride,
                                                                std::uint64_t seed) noexcept {
  std::uint64_t h = (j + 1) * 0x9e3779b97f4a7c15ull ^ seed;  // splitmix64 finaliser
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
  h ^= h >> 31;
  return j * stride + h % stride;
}

/// Rank (0-based, in descending key order) of the sample whose key becomes the threshold:
/// the sample's share of k, widened by `oversample`, clamped to the sample.
STELLATRAIN_HOST_DEVICE constexpr std::uint64_t sample_threshold_rank(std::uint64_t n,
                                                                      std::uint64_t k,
                                                                      std::uint64_t samples,
                                                                      double oversample) noexcept {
  if (samples == 0 || n == 0) return 0;
  const double want =
      static_cast<double>(k) / static_cast<double>(n) * static_cast<double>(samples) * oversample;
  if (want >= static_cast<double>(samples)) return samples - 1u;
  std::uint64_t r = static_cast<std::uint64_t>(want);  // ceil(want), at least 1
  if (static_cast<double>(r) < want) ++r;
  return r < 1u ? 0u : r - 1u;
}

}  // namespace stellatrain::detail
