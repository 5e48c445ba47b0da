// SPDX-License-Identifier: Apache-2.0
// Kernels of the GPU radix select: the scan, histogram and classify passes, the bitmap
// compaction and the header/threshold finaliser. The decisions they make come from
// radix_select_plan.hpp; here is only how the work is spread over warps and blocks.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/detail/radix_select_plan.hpp>
#include <stellatrain/select/selection_layout.hpp>
#include <stellatrain/select/topk_threshold_state.hpp>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace stellatrain::detail {

// Full passes: 512 threads, each warp streams 8 x 32 consecutive elements per iteration (8
// independent loads in flight per thread), so one warp iteration covers 8 whole bitmap words.
inline constexpr int radix_threads = 512;
inline constexpr int radix_warps = radix_threads / 32;
inline constexpr int radix_unroll = 8;
// Two blocks per SM (at most 64 registers per thread): 1024 threads x 8 loads in flight per SM
// cover the latency-bandwidth product of HBM3 (about 22 KB per SM on an H100/H200).
inline constexpr int radix_min_blocks = 2;
inline constexpr std::uint64_t radix_warp_chunk = 32u * radix_unroll;
inline constexpr unsigned full_warp = 0xffffffffu;

// ------------------------------------------------------------------ element sources

/// Reads magnitude keys of a plain tensor.
template <class T>
struct device_plain_source {
  struct raw {
    T v;
  };
  static constexpr bool writes = false;
  const T* x;
  __device__ raw load(std::uint64_t i) const { return {x[i]}; }
  __device__ std::uint32_t key(raw r) const { return magnitude_key(r.v); }
  __device__ void store(std::uint64_t, raw) const {}
};

/// Error feedback: the key of acc = g + residual; `store` writes acc into the residual, so
/// every later pass reads acc from there.
template <class G>
struct feedback_source {
  struct raw {
    G g;
    float r;
  };
  static constexpr bool writes = true;
  const G* grad;
  float* residual;
  __device__ raw load(std::uint64_t i) const { return {grad[i], residual[i]}; }
  __device__ static float acc(raw r) { return to_float(r.g) + r.r; }
  __device__ std::uint32_t key(raw r) const { return magnitude_key(acc(r)); }
  __device__ void store(std::uint64_t i, raw r) const { residual[i] = acc(r); }
};

// ------------------------------------------------------------------ arguments

/// Element indices of candidates: 4-byte entries when the tensor has at most 2^32 elements,
/// else 8 (a run-time choice, so that one kernel serves both).
struct candidate_buffer {
  void* data;
  std::uint64_t cap;
  bool wide;
  __device__ std::uint64_t get(std::uint64_t j) const {
    return wide ? static_cast<const std::uint64_t*>(data)[j]
                : static_cast<const std::uint32_t*>(data)[j];
  }
  __device__ void set(std::uint64_t j, std::uint64_t index) const {
    if (wide) {
      static_cast<std::uint64_t*>(data)[j] = index;
    } else {
      static_cast<std::uint32_t*>(data)[j] = static_cast<std::uint32_t>(index);
    }
  }
};

struct radix_args {
  std::uint64_t n;
  std::uint64_t k;
  radix_plan plan;
  radix_state* state;
  std::uint32_t* tickets;     // per step
  std::uint64_t* appended;    // per step
  std::uint64_t* histograms;  // [step][device_radix_bins]
  candidate_buffer buffer0;
  candidate_buffer buffer1;
  std::uint32_t* bitmap;
  const topk_threshold_state* threshold;  // null: exact selection
};

// ------------------------------------------------------------------ warp and block helpers

/// Adds the candidates of a warp to a shared histogram; a warp whose candidates share one digit
/// (constant or all-zero stretches of a tensor) makes one atomic instead of 32 on one address.
__device__ inline void warp_histogram(std::uint32_t* hist, std::uint32_t digit, bool candidate) {
  const unsigned mask = __ballot_sync(full_warp, candidate);
  if (mask == 0) return;
  const std::uint32_t first = __shfl_sync(full_warp, digit, 0);
  if (__all_sync(full_warp, !candidate || digit == first)) {
    if ((threadIdx.x & 31u) == 0) atomicAdd(&hist[first], static_cast<std::uint32_t>(__popc(mask)));
  } else if (candidate) {
    atomicAdd(&hist[digit], 1u);
  }
}

/// Appends the indices of a warp's candidates to `buffer` (one atomic per warp); positions at
/// or past its capacity are counted but not written.
__device__ inline void warp_append(const candidate_buffer& buffer, std::uint64_t* cursor,
                                   std::uint64_t index, bool candidate) {
  const unsigned mask = __ballot_sync(full_warp, candidate);
  if (mask == 0) return;
  const unsigned lane = threadIdx.x & 31u;
  unsigned long long base = 0;
  if (lane == 0)
    base = atomicAdd(reinterpret_cast<unsigned long long*>(cursor),
                     static_cast<unsigned long long>(__popc(mask)));
  base = __shfl_sync(full_warp, base, 0);
  if (candidate) {
    const std::uint64_t pos = base + static_cast<std::uint64_t>(__popc(mask & ((1u << lane) - 1u)));
    if (pos < buffer.cap) buffer.set(pos, index);
  }
}

__device__ inline void clear_histogram(std::uint32_t* hist) {
  for (unsigned b = threadIdx.x; b < device_radix_bins; b += blockDim.x) hist[b] = 0;
}

__device__ inline void flush_histogram(const std::uint32_t* hist, std::uint64_t* global) {
  for (unsigned b = threadIdx.x; b < device_radix_bins; b += blockDim.x) {
    const std::uint32_t c = hist[b];
    if (c != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(&global[b]),
                static_cast<unsigned long long>(c));
  }
}

/// True in every thread of the last block to arrive. Each block's global writes (histogram
/// atomics, bitmap words, buffer entries) are fenced before it takes a ticket, so the last block
/// sees all of them; it then reads them through L2 (`__ldcg`).
__device__ inline bool arrive_last(std::uint32_t* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

/// The bucket choice by the whole (last) block: each thread scans 4 rank positions with the
/// exclusive prefix of the threads before it. Returns the same as radix_choose.
__device__ inline radix_step_result block_choose(const std::uint64_t* hist, const radix_plan& p,
                                                 std::uint32_t level, std::uint64_t k) {
  constexpr int per = device_radix_bins / radix_threads;
  static_assert(per * radix_threads == static_cast<int>(device_radix_bins),
                "positions must split evenly");
  using scan_t = cub::BlockScan<unsigned long long, radix_threads>;
  __shared__ typename scan_t::TempStorage scan_storage;
  __shared__ radix_crossing found;
  const std::uint32_t bins = 1u << p.digit(level).bits;
  std::uint64_t counts[per];
  unsigned long long sum = 0;
  for (int j = 0; j < per; ++j) {
    const std::uint32_t pos = threadIdx.x * per + static_cast<std::uint32_t>(j);
    counts[j] = pos < bins ? __ldcg(reinterpret_cast<const unsigned long long*>(
                                 hist + radix_position_digit(p, level, pos)))
                           : 0u;
    sum += counts[j];
  }
  unsigned long long before = 0;
  unsigned long long total = 0;
  scan_t(scan_storage).ExclusiveSum(sum, before, total);
  if (threadIdx.x == 0) found = {0, 0, 0, false};
  __syncthreads();
  radix_crossing mine{0, 0, 0, false};
  radix_find_crossing(counts, per, threadIdx.x * per, before, k, mine);
  if (mine.found) found = mine;
  __syncthreads();
  return {total, found, 0};
}

// ------------------------------------------------------------------ block-wide append

/// Shared state of `block_append`; `count` must be 0 before the first call.
struct block_append_storage {
  unsigned long long count;
  unsigned long long base;
};

/// Appends the candidates of one block iteration (every warp, `radix_unroll` rounds) to
/// `buffer` with one global atomic per block iteration: per-warp atomics on one counter would
/// serialise in L2 when a large fraction of warps holds candidates. Call from every thread of
/// the block. Positions at or past the capacity are counted but not written.
__device__ inline void block_append(block_append_storage& shared, const candidate_buffer& buffer,
                                    std::uint64_t* cursor, const bool (&candidate)[radix_unroll],
                                    const std::uint64_t (&index)[radix_unroll]) {
  const unsigned lane = threadIdx.x & 31u;
  unsigned masks[radix_unroll];
  unsigned total = 0;
#pragma unroll
  for (int u = 0; u < radix_unroll; ++u) {
    masks[u] = __ballot_sync(full_warp, candidate[u]);
    total += static_cast<unsigned>(__popc(masks[u]));
  }
  unsigned long long offset = 0;
  if (lane == 0 && total != 0)
    offset = atomicAdd(&shared.count, static_cast<unsigned long long>(total));
  offset = __shfl_sync(full_warp, offset, 0);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long count = shared.count;
    shared.base =
        count != 0 ? atomicAdd(reinterpret_cast<unsigned long long*>(cursor), count) : 0ull;
    shared.count = 0;
  }
  __syncthreads();
  unsigned long long pos = shared.base + offset;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int u = 0; u < radix_unroll; ++u) {
    if (candidate[u]) {
      const std::uint64_t p = pos + static_cast<unsigned>(__popc(masks[u] & below));
      if (p < buffer.cap) buffer.set(p, index[u]);
    }
    pos += static_cast<unsigned>(__popc(masks[u]));
  }
}

// Every pass walks its items in block iterations of radix_block_chunk consecutive items: warp w
// takes radix_unroll rounds of 32 consecutive items at offset w * radix_warp_chunk. The loop
// condition is the same for the whole block, so block-wide synchronisation inside is safe.
inline constexpr std::uint64_t radix_block_chunk =
    static_cast<std::uint64_t>(radix_warps) * radix_warp_chunk;

// ------------------------------------------------------------------ scan and histogram steps

/// Step 0 (scan) or step 1 (histogram after a threshold miss) over every element: histogram of
/// key digit 0. The scan also applies the threshold, appends candidates to buffer 0, clears the
/// bitmap and (with a feedback source) writes acc back; the histogram step does only its name.
template <class Source>
__global__ void __launch_bounds__(radix_threads, radix_min_blocks)
    radix_scan_kernel(radix_args a, Source src, std::uint32_t step) {
  __shared__ std::uint32_t hist[device_radix_bins];
  __shared__ block_append_storage appender;
  const bool scan = step == radix_step_scan;
  if (!scan && a.state->phase != radix_need_histogram) return;  // the scan's choice stands
  const std::uint32_t threshold = scan && a.threshold != nullptr ? a.threshold->key : 0u;
  const bool append = scan && (threshold != 0 || a.n <= a.buffer0.cap);
  const radix_digit d0 = a.plan.digit(0);
  std::uint64_t* cursor = a.appended + step;
  clear_histogram(hist);
  if (threadIdx.x == 0) appender.count = 0;
  __syncthreads();

  const unsigned lane = threadIdx.x & 31u;
  const std::uint64_t warp_offset = static_cast<std::uint64_t>(threadIdx.x >> 5) * radix_warp_chunk;
  for (std::uint64_t chunk = blockIdx.x; chunk * radix_block_chunk < a.n; chunk += gridDim.x) {
    const std::uint64_t base = chunk * radix_block_chunk + warp_offset;
    typename Source::raw raw[radix_unroll] = {};
#pragma unroll
    for (int u = 0; u < radix_unroll; ++u) {
      const std::uint64_t i = base + static_cast<std::uint64_t>(u) * 32u + lane;
      if (i < a.n) raw[u] = src.load(i);
    }
    bool candidate[radix_unroll];
    std::uint64_t index[radix_unroll];
#pragma unroll
    for (int u = 0; u < radix_unroll; ++u) {
      const std::uint64_t i = base + static_cast<std::uint64_t>(u) * 32u + lane;
      std::uint32_t key = 0;
      candidate[u] = false;
      index[u] = i;
      if (i < a.n) {
        key = src.key(raw[u]);
        if (scan) src.store(i, raw[u]);
        candidate[u] = key >= threshold;
      }
      warp_histogram(hist, d0.of(key), candidate[u]);
      if (scan && lane == 0 && base + static_cast<std::uint64_t>(u) * 32u < a.n) {
        a.bitmap[(base >> 5) + static_cast<std::uint64_t>(u)] = 0u;
      }
    }
    if (append) block_append(appender, a.buffer0, cursor, candidate, index);
  }
  __syncthreads();
  flush_histogram(hist, a.histograms + static_cast<std::uint64_t>(step) * device_radix_bins);
  if (!arrive_last(a.tickets + step)) return;

  radix_step_result r = block_choose(
      a.histograms + static_cast<std::uint64_t>(step) * device_radix_bins, a.plan, 0, a.k);
  if (threadIdx.x == 0) {
    r.appended = __ldcg(reinterpret_cast<const unsigned long long*>(cursor));
    radix_state s = *a.state;
    if (scan) {
      radix_finish_scan(s, a.plan, a.k, threshold, a.buffer0.cap, r);
    } else {
      radix_finish_histogram(s, a.plan, a.k, r);
    }
    *a.state = s;
  }
}

// ------------------------------------------------------------------ classify step

/// Classifies the candidates by the bucket chosen at the state's level: winners are marked in
/// the bitmap; the tied bucket is histogrammed by the next digit and appended to the other
/// buffer when it fits. Reads the whole tensor or only a buffer of candidates.
template <class K>
__global__ void __launch_bounds__(radix_threads, radix_min_blocks)
    radix_classify_kernel(radix_args a, const K* x, std::uint32_t step) {
  __shared__ std::uint32_t hist[device_radix_bins];
  __shared__ radix_state shared_state;
  __shared__ block_append_storage appender;
  if (threadIdx.x == 0) {
    shared_state = *a.state;
    appender.count = 0;
  }
  __syncthreads();
  const radix_state& s =
      shared_state;  // read from shared memory: keeps registers for loads in flight
  if (s.phase != radix_running && s.phase != radix_all_in) return;
  const bool all_in = s.phase == radix_all_in;
  const radix_io io = radix_classify_io(s, a.buffer0.cap, a.buffer1.cap);
  const bool append = io.write != radix_no_buffer;
  const candidate_buffer dst = io.write == radix_from_buffer0 ? a.buffer0 : a.buffer1;
  const bool from_input = io.read == radix_from_input;
  const candidate_buffer src = io.read == radix_from_buffer0 ? a.buffer0 : a.buffer1;
  const std::uint64_t items = from_input ? a.n : s.source_count;
  std::uint64_t* cursor = a.appended + step;
  if (!all_in) clear_histogram(hist);
  __syncthreads();

  const unsigned lane = threadIdx.x & 31u;
  const std::uint64_t warp_offset = static_cast<std::uint64_t>(threadIdx.x >> 5) * radix_warp_chunk;
  for (std::uint64_t chunk = blockIdx.x; chunk * radix_block_chunk < items; chunk += gridDim.x) {
    const std::uint64_t base = chunk * radix_block_chunk + warp_offset;
    std::uint64_t index[radix_unroll];
    K v[radix_unroll] = {};
#pragma unroll
    for (int u = 0; u < radix_unroll; ++u) {
      const std::uint64_t j = base + static_cast<std::uint64_t>(u) * 32u + lane;
      index[u] = from_input ? j : (j < items ? src.get(j) : 0u);
    }
#pragma unroll
    for (int u = 0; u < radix_unroll; ++u) {
      const std::uint64_t j = base + static_cast<std::uint64_t>(u) * 32u + lane;
      if (j < items) v[u] = x[index[u]];
    }
    bool candidate[radix_unroll];
#pragma unroll
    for (int u = 0; u < radix_unroll; ++u) {
      const std::uint64_t j = base + static_cast<std::uint64_t>(u) * 32u + lane;
      bool mark = false;
      candidate[u] = false;
      std::uint32_t digit = 0;
      if (j < items) {
        const std::uint32_t key = magnitude_key(v[u]);
        const radix_class c = radix_classify(s, a.plan, key, index[u]);
        mark = c == radix_class::winner || (all_in && c == radix_class::candidate);
        candidate[u] = !all_in && c == radix_class::candidate;
        if (candidate[u]) digit = radix_next_digit(s, a.plan, key, index[u]);
      }
      if (from_input) {  // the warp's 32 items are one bitmap word
        const unsigned word = __ballot_sync(full_warp, mark);
        if (lane == 0 && word != 0)
          atomicOr(&a.bitmap[(base >> 5) + static_cast<std::uint64_t>(u)], word);
      } else if (mark) {
        atomicOr(&a.bitmap[index[u] >> 5], 1u << (index[u] & 31u));
      }
      if (!all_in) warp_histogram(hist, digit, candidate[u]);
    }
    if (append) block_append(appender, dst, cursor, candidate, index);
  }
  __syncthreads();
  const std::uint64_t* step_hist =
      a.histograms + static_cast<std::uint64_t>(step) * device_radix_bins;
  if (!all_in)
    flush_histogram(hist, a.histograms + static_cast<std::uint64_t>(step) * device_radix_bins);
  if (!arrive_last(a.tickets + step)) return;

  radix_step_result r{0, {0, 0, 0, false}, 0};
  if (!all_in) r = block_choose(step_hist, a.plan, s.level + 1, s.k_remaining);
  if (threadIdx.x == 0) {
    r.appended = __ldcg(reinterpret_cast<const unsigned long long*>(cursor));
    radix_state next = s;
    radix_finish_classify(next, a.plan, io, dst.cap, r);
    *a.state = next;
  }
}

// ------------------------------------------------------------------ compaction
// A tile is compaction_tile_words bitmap words; in round r thread t owns word r * 256 + t of
// the tile, so loads are coalesced and each warp's outputs land close together. Positions
// follow word order: a block scan per round plus the running total of earlier rounds.

/// Selected elements per tile.
template <int = 0>
__global__ void __launch_bounds__(compaction_threads)
    compaction_count_kernel(const std::uint32_t* bitmap, std::uint64_t words,
                            std::uint64_t* tile_counts) {
  using reduce_t = cub::BlockReduce<std::uint32_t, compaction_threads>;
  __shared__ typename reduce_t::TempStorage storage;
  const std::uint64_t first =
      static_cast<std::uint64_t>(blockIdx.x) * compaction_tile_words + threadIdx.x;
  std::uint32_t count = 0;
#pragma unroll
  for (std::uint32_t r = 0; r < compaction_words_per_thread; ++r) {
    const std::uint64_t w = first + static_cast<std::uint64_t>(r) * compaction_threads;
    if (w < words) count += static_cast<std::uint32_t>(__popc(bitmap[w]));
  }
  const std::uint32_t total = reduce_t(storage).Sum(count);
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = total;
}

/// Writes the selected elements of each tile at their place in the ascending output:
/// `emit(position, index)` for every set bit, in index order.
template <class Emit>
__global__ void __launch_bounds__(compaction_threads)
    compaction_write_kernel(const std::uint32_t* bitmap, std::uint64_t words,
                            const std::uint64_t* tile_offsets, Emit emit) {
  using scan_t = cub::BlockScan<std::uint32_t, compaction_threads>;
  __shared__ typename scan_t::TempStorage storage;
  const std::uint64_t first =
      static_cast<std::uint64_t>(blockIdx.x) * compaction_tile_words + threadIdx.x;
  std::uint32_t w[compaction_words_per_thread];
#pragma unroll
  for (std::uint32_t r = 0; r < compaction_words_per_thread; ++r) {
    const std::uint64_t at = first + static_cast<std::uint64_t>(r) * compaction_threads;
    w[r] = at < words ? bitmap[at] : 0u;
  }
  std::uint64_t running = tile_offsets[blockIdx.x];
#pragma unroll
  for (std::uint32_t r = 0; r < compaction_words_per_thread; ++r) {
    std::uint32_t before = 0;
    std::uint32_t round_total = 0;
    scan_t(storage).ExclusiveSum(static_cast<std::uint32_t>(__popc(w[r])), before, round_total);
    __syncthreads();  // the scan storage is reused next round
    std::uint64_t pos = running + before;
    for_each_set_bit(w[r], first + static_cast<std::uint64_t>(r) * compaction_threads,
                     [&](std::uint64_t i) { emit(pos++, i); });
    running += round_total;
  }
}

/// Output of a plain selection: the index and the input value, converted to `Out`. A position
/// at or past `count` (a broken invariant, reported by the finaliser) is never written.
template <class T, class Out, class Index>
struct plain_emitter {
  const T* x;
  Index* indices;
  Out* values;
  std::uint64_t count;
  __device__ void operator()(std::uint64_t pos, std::uint64_t i) const {
    if (pos >= count) return;
    indices[pos] = static_cast<Index>(i);
    values[pos] = convert_value<Out>(x[i]);
  }
};

/// Output of error feedback: acc rounded to `Out` is sent, what rounding lost stays behind.
template <class Out, class Index>
struct feedback_emitter {
  float* residual;  // holds acc since the scan
  Index* indices;
  Out* values;
  std::uint64_t count;
  __device__ void operator()(std::uint64_t pos, std::uint64_t i) const {
    if (pos >= count) return;
    Out sent{};
    residual[i] = quantize_with_feedback(residual[i], sent);
    indices[pos] = static_cast<Index>(i);
    values[pos] = sent;
  }
};

// ------------------------------------------------------------------ finaliser

struct finalize_args {
  selection_header header;   // everything but status, flags and kth_key
  const radix_state* state;  // null: no radix select ran (k == 0, or another backend)
  bool check_total;          // the compaction ran: compare its total with the count
  const std::uint64_t* tile_counts;
  const std::uint64_t* tile_offsets;
  std::uint64_t tiles;
  topk_threshold_state* threshold;  // null: no threshold to update
  threshold_update_options update;
  selection_header* out;
};

/// Writes the header; checks that the compaction found exactly `count` elements; moves the
/// per-tensor threshold on. One thread.
template <class K>
__global__ void selection_finalize_kernel(finalize_args a) {
  selection_header h = a.header;
  if (a.check_total) {
    const std::uint64_t total = a.tile_offsets[a.tiles - 1] + a.tile_counts[a.tiles - 1];
    if (total != h.count) h.status |= static_cast<std::uint32_t>(selection_status::wrong_total);
  }
  if (a.state != nullptr) {
    const radix_state s = *a.state;
    h.status |= s.status | (s.phase != radix_done
                                ? static_cast<std::uint32_t>(selection_status::inconsistent_counts)
                                : 0u);
    h.flags = s.flags;
    h.kth_key = s.key_prefix;
    if (a.threshold != nullptr) {
      topk_threshold_state t = *a.threshold;
      update_threshold_state<K>(t, s.key_prefix, s.flags, s.scan_total, h.count, a.update);
      *a.threshold = t;
    }
  }
  *a.out = h;
}

// ------------------------------------------------------------------ cub::DeviceTopK backend

/// Applies a source's write-back to every element (error feedback: residual = g + residual).
template <class Source>
__global__ void accumulate_kernel(Source src, std::uint64_t n) {
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    src.store(i, src.load(i));
  }
}

/// Marks the elements behind composite keys (magnitude key << 32 | ~index) in the bitmap.
template <int = 0>
__global__ void mark_composite_keys_kernel(const std::uint64_t* keys, std::uint64_t count,
                                           std::uint32_t* bitmap) {
  for (std::uint64_t j = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < count; j += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t i = 0xffffffffu - static_cast<std::uint32_t>(keys[j] & 0xffffffffu);
    atomicOr(&bitmap[i >> 5], 1u << (i & 31u));
  }
}

// ------------------------------------------------------------------ sampled threshold

template <class Source>
__global__ void sample_keys_kernel(Source src, std::uint64_t samples, std::uint64_t stride,
                                   std::uint64_t seed, std::uint32_t* keys) {
  for (std::uint64_t j = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < samples; j += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    keys[j] = src.key(src.load(sample_position(j, stride, seed)));
  }
}

template <int = 0>
__global__ void pick_threshold_kernel(const std::uint32_t* sorted_descending, std::uint64_t rank,
                                      topk_threshold_state* state) {
  state->key = sorted_descending[rank];
}

}  // namespace stellatrain::detail
