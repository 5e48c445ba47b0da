// SPDX-License-Identifier: Apache-2.0
// Host side of the GPU selectors: argument checks, the workspace carve-up and the launch
// sequence (all asynchronous on the caller's stream; no allocation, no synchronisation).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/detail/cub_compat.cuh>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/select/detail/radix_select_kernels.cuh>
#include <stellatrain/select/detail/radix_select_plan.hpp>
#include <stellatrain/select/selection_layout.hpp>
#include <stellatrain/select/topk_cuda_options.hpp>
#include <stellatrain/select/topk_threshold_state.hpp>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

namespace stellatrain::detail {

inline void check_topk_options(const topk_cuda_options& o, const char* fn) {
  auto fail = [&](const std::string& why) {
    throw_error(errc::invalid_argument, std::string(fn) + ": " + why);
  };
  if (!(o.candidate_fraction > 0.0 && o.candidate_fraction <= 1.0))
    fail("candidate_fraction must be in (0, 1]");
  if (!(o.threshold_candidate_factor >= 0.0)) fail("threshold_candidate_factor must be >= 0");
  if (!(o.threshold_min_slack >= 0.0f && o.threshold_min_slack <= o.threshold_max_slack &&
        o.threshold_max_slack < 1.0f && o.threshold_initial_slack >= 0.0f &&
        o.threshold_initial_slack < 1.0f)) {
    fail("threshold slacks must satisfy 0 <= min <= max < 1 and 0 <= initial < 1");
  }
  if (!(o.sample_oversample >= 1.0)) fail("sample_oversample must be >= 1");
  if (o.sample_size > static_cast<std::uint64_t>(INT_MAX)) fail("sample_size must be below 2^31");
  if (o.backend == topk_backend::cub_device_topk && !cub_device_topk_available) {
    throw_error(errc::unsupported,
                std::string(fn) +
                    ": cub::DeviceTopK needs CCCL 3.4.3 or newer; this build has CUB " +
                    std::to_string(CUB_VERSION));
  }
}

/// The magnitude key of a value (the functor the cub::DeviceTopK backend composes keys with).
struct magnitude_key_fn {
  template <class T>
  __host__ __device__ std::uint32_t operator()(T v) const {
    return magnitude_key(v);
  }
};

/// The workspace layout of a selection over `n` elements of key type `K`.
template <class K>
radix_workspace_layout topk_workspace_layout(std::uint64_t n, std::uint64_t k,
                                             const topk_cuda_options& o, const char* fn) {
  check_topk_options(o, fn);
  const std::uint64_t kk = k < n ? k : n;
  const radix_plan plan = make_radix_plan(magnitude_key_bits<K>, n);
  const std::uint64_t tiles = compaction_tiles(n);
  if (tiles > static_cast<std::uint64_t>(INT_MAX)) {
    throw_error(errc::unsupported,
                std::string(fn) + ": " + std::to_string(n) + " elements exceed the 2^47 supported");
  }
  std::size_t scan_bytes = 0;
  if (tiles != 0) {
    check_cuda(cub::DeviceScan::ExclusiveSum(
                   nullptr, scan_bytes, static_cast<const std::uint64_t*>(nullptr),
                   static_cast<std::uint64_t*>(nullptr), static_cast<int>(tiles)),
               "cub::DeviceScan::ExclusiveSum (size query)");
  }
  const std::uint64_t samples = o.sample_size < n ? o.sample_size : n;
  std::size_t sort_bytes = 0;
  if (samples != 0) {
    check_cuda(cub::DeviceRadixSort::SortKeysDescending(
                   nullptr, sort_bytes, static_cast<const std::uint32_t*>(nullptr),
                   static_cast<std::uint32_t*>(nullptr), static_cast<int>(samples), 0,
                   static_cast<int>(magnitude_key_bits<K>)),
               "cub::DeviceRadixSort::SortKeysDescending (size query)");
  }
  std::uint64_t cub_keys = 0;
  std::size_t cub_bytes = 0;
#if STELLATRAIN_HAS_CUB_DEVICE_TOPK
  if (o.backend == topk_backend::cub_device_topk && kk != 0) {
    cub_keys = kk;
    check_cuda(cub_topk_composite_keys(nullptr, cub_bytes, static_cast<const K*>(nullptr),
                                       magnitude_key_fn{}, n, kk, nullptr, nullptr),
               "cub::DeviceTopK::MaxKeys (size query)");
  }
#endif
  return plan_radix_workspace(n, kk, plan, o.candidate_fraction, o.threshold_candidate_factor,
                              scan_bytes, samples, sort_bytes, cub_keys, cub_bytes);
}

/// Everything a launch sequence needs, checked and carved up.
struct topk_call {
  cudaStream_t stream;
  std::uint64_t n;
  std::uint64_t k;  // min(k, n)
  std::byte* out;
  std::byte* ws;  // aligned to workspace_alignment
  radix_workspace_layout w;
  radix_plan plan;
  topk_threshold_state* threshold;
  threshold_update_options update;
  topk_backend backend;
};

/// Checks the arguments of a selection and lays out its workspace; throws `error` naming `fn`.
template <class K, class Index, class Out>
topk_call prepare_topk_call(const char* fn, cuda_stream ctx, const void* input, std::uint64_t n,
                            std::uint64_t k, std::span<std::byte> out,
                            std::span<std::byte> workspace, topk_threshold_state* threshold,
                            const topk_cuda_options& o) {
  static_assert(index_type<Index> && value_type<Out>, "Index must be u32/u64, Out float/fp16/bf16");
  auto fail = [&](const std::string& why) {
    throw_error(errc::invalid_argument, std::string(fn) + ": " + why);
  };
  const std::uint64_t kk = k < n ? k : n;
  if (n != 0 && input == nullptr) fail("null input for " + std::to_string(n) + " elements");
  if (std::is_same_v<Index, std::uint32_t> && n > (std::uint64_t{1} << 32)) {
    fail("u32 indices cannot address " + std::to_string(n) + " elements; use std::uint64_t");
  }
  const std::size_t out_need = selection_bytes<Out, Index>(kk);
  if (out.data() == nullptr || out.size() < out_need) {
    fail("output buffer of " + std::to_string(out.size()) + " bytes, needs " +
         std::to_string(out_need) + " (selection_bytes)");
  }
  if (reinterpret_cast<std::uintptr_t>(out.data()) % selection_alignment != 0) {
    fail("output buffer is not aligned to " + std::to_string(selection_alignment) + " bytes");
  }
  topk_call c{};
  c.stream = ctx.stream;
  c.n = n;
  c.k = kk;
  c.out = out.data();
  c.w = topk_workspace_layout<K>(n, k, o, fn);
  c.plan = make_radix_plan(magnitude_key_bits<K>, n);
  c.threshold = threshold;
  c.update = {o.threshold_initial_slack, o.threshold_min_slack, o.threshold_max_slack};
  c.backend = o.backend;
  if (o.backend == topk_backend::cub_device_topk && n > (std::uint64_t{1} << 32)) {
    throw_error(errc::unsupported,
                std::string(fn) + ": the cub::DeviceTopK backend handles at most 2^32 elements");
  }
  if (workspace.data() == nullptr || workspace.size() < c.w.total) {
    fail("workspace of " + std::to_string(workspace.size()) + " bytes, needs " +
         std::to_string(c.w.total) + " (topk_workspace_bytes with the same n, k and options)");
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
  c.ws =
      workspace.data() + (workspace_alignment - addr % workspace_alignment) % workspace_alignment;
  return c;
}

/// A grid for the passes over `n` elements: enough blocks to fill the device (the kernels'
/// launch bounds give radix_min_blocks resident blocks per SM), no more than the work needs,
/// and few enough elements per block for 32-bit shared histogram counts.
inline int full_pass_grid(std::uint64_t n) {
  int device = 0;
  int sms = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  const std::uint64_t resident = static_cast<std::uint64_t>(sms > 0 ? sms : 1) * radix_min_blocks;
  const std::uint64_t work = (n + radix_block_chunk - 1) / radix_block_chunk;
  const std::uint64_t min_blocks = (n >> 31) + 1;  // < 2^31 elements per block
  std::uint64_t grid = work < resident ? work : resident;
  if (grid < min_blocks) grid = min_blocks;
  if (grid < 1) grid = 1;
  return static_cast<int>(grid);
}

template <class T>
T* ws_at(const topk_call& c, std::size_t offset) {
  return reinterpret_cast<T*>(c.ws + offset);
}

inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

/// Compaction of the bitmap into the output and the header (shared by both backends).
template <class K, class Index, class Out, class Emitter>
void compact_and_finalize(const topk_call& c, Emitter emitter, bool radix_ran) {
  auto* bitmap = ws_at<std::uint32_t>(c, c.w.bitmap);
  auto* tile_counts = ws_at<std::uint64_t>(c, c.w.tile_counts);
  auto* tile_offsets = ws_at<std::uint64_t>(c, c.w.tile_offsets);
  const auto tiles = static_cast<unsigned>(c.w.tiles);
  compaction_count_kernel<<<tiles, compaction_threads, 0, c.stream>>>(bitmap, c.w.words,
                                                                      tile_counts);
  check_launch("compaction count kernel launch");
  std::size_t scan_bytes = c.w.scan_temp_bytes;
  check_cuda(cub::DeviceScan::ExclusiveSum(ws_at<void>(c, c.w.scan_temp), scan_bytes, tile_counts,
                                           tile_offsets, static_cast<int>(tiles), c.stream),
             "cub::DeviceScan::ExclusiveSum");
  compaction_write_kernel<<<tiles, compaction_threads, 0, c.stream>>>(bitmap, c.w.words,
                                                                      tile_offsets, emitter);
  check_launch("compaction write kernel launch");

  finalize_args f{};
  f.header = make_selection_header<Out, Index>(c.k, c.n);
  f.state = radix_ran ? ws_at<radix_state>(c, c.w.state) : nullptr;
  f.check_total = true;
  f.tile_counts = tile_counts;
  f.tile_offsets = tile_offsets;
  f.tiles = c.w.tiles;
  f.threshold = c.threshold;
  f.update = c.update;
  f.out = reinterpret_cast<selection_header*>(c.out);
  selection_finalize_kernel<K><<<1, 1, 0, c.stream>>>(f);
  check_launch("selection finalize kernel launch");
}

/// Nothing to select (k == 0 or n == 0): only the header.
template <class K, class Index, class Out>
void finalize_empty(const topk_call& c) {
  finalize_args f{};
  f.header = make_selection_header<Out, Index>(0, c.n);
  f.out = reinterpret_cast<selection_header*>(c.out);
  selection_finalize_kernel<K><<<1, 1, 0, c.stream>>>(f);
  check_launch("selection finalize kernel launch");
}

template <class K, class ScanSource>
void run_radix_passes(const topk_call& c, ScanSource scan_source, const K* keys_after_scan) {
  radix_args a{};
  a.n = c.n;
  a.k = c.k;
  a.plan = c.plan;
  a.state = ws_at<radix_state>(c, c.w.state);
  a.tickets = ws_at<std::uint32_t>(c, c.w.tickets);
  a.appended = ws_at<std::uint64_t>(c, c.w.appended);
  a.histograms = ws_at<std::uint64_t>(c, c.w.histograms);
  a.buffer0 = {ws_at<void>(c, c.w.buffer0), c.w.cap0, c.w.entry_bytes == 8};
  a.buffer1 = {ws_at<void>(c, c.w.buffer1), c.w.cap1, c.w.entry_bytes == 8};
  a.bitmap = ws_at<std::uint32_t>(c, c.w.bitmap);
  a.threshold = c.threshold;

  check_cuda(cudaMemsetAsync(c.ws + c.w.state, 0, c.w.control_bytes, c.stream),
             "cudaMemsetAsync (selection state)");
  const int grid = full_pass_grid(c.n);
  radix_scan_kernel<<<grid, radix_threads, 0, c.stream>>>(a, scan_source, radix_step_scan);
  check_launch("radix scan kernel launch");
  if (c.threshold != nullptr) {
    radix_scan_kernel<<<grid, radix_threads, 0, c.stream>>>(
        a, device_plain_source<K>{keys_after_scan}, radix_step_histogram);
    check_launch("radix histogram kernel launch");
  }
  for (std::uint32_t level = 0; level < c.plan.levels(); ++level) {
    radix_classify_kernel<<<grid, radix_threads, 0, c.stream>>>(a, keys_after_scan,
                                                                radix_first_classify_step + level);
    check_launch("radix classify kernel launch");
  }
}

/// The whole selection: radix passes (or cub::DeviceTopK) into the bitmap, then compaction.
///   scan_source: what the first pass reads (the tensor, or g + residual for error feedback);
///   keys_after_scan: what later passes read (the tensor, or the residual holding acc);
///   emitter: writes one selected element to the output.
template <class K, class Index, class Out, class ScanSource, class Emitter>
void run_selection(const topk_call& c, ScanSource scan_source, const K* keys_after_scan,
                   Emitter emitter) {
  if (c.k == 0) {
    finalize_empty<K, Index, Out>(c);
    return;
  }
  if (c.backend == topk_backend::cub_device_topk && c.threshold == nullptr) {
#if STELLATRAIN_HAS_CUB_DEVICE_TOPK
    if constexpr (ScanSource::writes) {  // error feedback: acc = g + residual first
      accumulate_kernel<<<static_cast<unsigned>((c.n + 255) / 256 < 65536 ? (c.n + 255) / 256
                                                                          : 65536),
                          256, 0, c.stream>>>(scan_source, c.n);
      check_launch("accumulate kernel launch");
    }
    auto* keys = ws_at<std::uint64_t>(c, c.w.cub_keys);
    std::size_t bytes = c.w.cub_temp_bytes;
    check_cuda(cub_topk_composite_keys(ws_at<void>(c, c.w.cub_temp), bytes, keys_after_scan,
                                       magnitude_key_fn{}, c.n, c.k, keys, c.stream),
               "cub::DeviceTopK::MaxKeys");
    check_cuda(
        cudaMemsetAsync(ws_at<void>(c, c.w.bitmap), 0, c.w.words * sizeof(std::uint32_t), c.stream),
        "cudaMemsetAsync (bitmap)");
    mark_composite_keys_kernel<<<static_cast<unsigned>((c.k + 255) / 256 < 4096 ? (c.k + 255) / 256
                                                                                : 4096),
                                 256, 0, c.stream>>>(keys, c.k,
                                                     ws_at<std::uint32_t>(c, c.w.bitmap));
    check_launch("mark kernel launch");
    compact_and_finalize<K, Index, Out>(c, emitter, false);
    return;
#endif
  }
  run_radix_passes(c, scan_source, keys_after_scan);
  compact_and_finalize<K, Index, Out>(c, emitter, true);
}

/// Sampled threshold: sorts the keys of a strided, jittered sample and stores the one at the
/// sample's share of k (widened by the oversampling factor) as the tensor's threshold.
template <class K, class Source>
void run_sampled_threshold(cudaStream_t stream, Source source, std::uint64_t n, std::uint64_t k,
                           topk_threshold_state* state, std::span<std::byte> workspace,
                           const topk_cuda_options& o, const char* fn) {
  if (state == nullptr)
    throw_error(errc::invalid_argument, std::string(fn) + ": null threshold state");
  const radix_workspace_layout w = topk_workspace_layout<K>(n, k, o, fn);
  if (workspace.data() == nullptr || workspace.size() < w.total) {
    throw_error(errc::invalid_argument, std::string(fn) + ": workspace of " +
                                            std::to_string(workspace.size()) + " bytes, needs " +
                                            std::to_string(w.total));
  }
  const std::uint64_t kk = k < n ? k : n;
  if (w.samples == 0 || kk == 0) {
    check_cuda(cudaMemsetAsync(state, 0, sizeof(std::uint32_t), stream),
               "cudaMemsetAsync (threshold key)");
    return;
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(workspace.data());
  std::byte* base =
      workspace.data() + (workspace_alignment - addr % workspace_alignment) % workspace_alignment;
  auto* keys = reinterpret_cast<std::uint32_t*>(base + w.sample_keys);
  auto* sorted = reinterpret_cast<std::uint32_t*>(base + w.sample_sorted);
  const std::uint64_t stride = n / w.samples;
  const auto blocks = static_cast<unsigned>((w.samples + 255) / 256);
  sample_keys_kernel<<<blocks, 256, 0, stream>>>(source, w.samples, stride, o.sample_seed, keys);
  check_launch("sample kernel launch");
  std::size_t bytes = w.sort_temp_bytes;
  check_cuda(cub::DeviceRadixSort::SortKeysDescending(
                 base + w.sort_temp, bytes, keys, sorted, static_cast<int>(w.samples), 0,
                 static_cast<int>(magnitude_key_bits<K>), stream),
             "cub::DeviceRadixSort::SortKeysDescending");
  const std::uint64_t rank = sample_threshold_rank(n, kk, w.samples, o.sample_oversample);
  pick_threshold_kernel<<<1, 1, 0, stream>>>(sorted, rank, state);
  check_launch("threshold pick kernel launch");
}

}  // namespace stellatrain::detail
