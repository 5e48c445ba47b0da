// SPDX-License-Identifier: Apache-2.0
// GPU top-k selection and fused error feedback, timed with CUDA events (UseManualTime), next
// to a device-to-device copy of the same bytes in the same run, so that times read as passes
// over the input:
//   passes = time x copy bandwidth / 4N bytes, copy bandwidth = (read + write) 8N / copy time
//          = 2 x time / copy time   (a copy moves the input twice: one read, one write).
// N = 1e6, 1e7, 1e8 fp32 elements (bf16 variants: 2N bytes); k = 0.1%, 1%, 10% (permille 1,
// 10, 100). Workspaces and inputs are allocated and filled outside the timed loops.
#include <stellatrain/compress/error_feedback_cuda.cuh>
#include <stellatrain/select/topk_cuda.cuh>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

namespace {

using namespace stellatrain;

bool device_present() { return cuda_device_count() > 0; }

template <class T>
struct device_array {
  explicit device_array(std::size_t n) : size(n) {
    STELLATRAIN_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  std::span<std::byte> bytes() const {
    return {reinterpret_cast<std::byte*>(ptr), size * sizeof(T)};
  }
  T* ptr = nullptr;
  std::size_t size;
};

/// Approximately N(0, scale^2) values from a counter-based hash (fills 1e8 floats in a few ms).
template <class T>
__global__ void fill_normal(T* x, std::uint64_t n, std::uint64_t seed, float scale) {
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t h = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = static_cast<float>((h >> 16) & 0xffffffu) * (1.0f / 16777216.0f);
    x[i] = from_float<T>(scale * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}

/// The error-feedback baseline: read g and residual, write residual once.
__global__ void accumulate_baseline(const float* g, float* r, std::uint64_t n) {
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    r[i] += g[i];
  }
}

/// One gradient per (type, N), made once and kept for the process.
template <class T>
const device_array<T>& gradient(std::uint64_t n, std::uint64_t seed = 1) {
  static std::map<std::pair<std::uint64_t, std::uint64_t>, std::unique_ptr<device_array<T>>> cache;
  auto& slot = cache[{n, seed}];
  if (!slot) {
    slot = std::make_unique<device_array<T>>(n);
    fill_normal<<<1024, 256>>>(slot->ptr, n, seed, 1.0f);
    STELLATRAIN_CUDA_CHECK(cudaGetLastError());
    STELLATRAIN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return *slot;
}

struct event_timer {
  event_timer() {
    STELLATRAIN_CUDA_CHECK(cudaEventCreate(&start));
    STELLATRAIN_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~event_timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  /// Seconds that `fn` (enqueued on `s`) took on the device.
  template <class Fn>
  double time(cudaStream_t s, Fn&& fn) {
    STELLATRAIN_CUDA_CHECK(cudaEventRecord(start, s));
    fn();
    STELLATRAIN_CUDA_CHECK(cudaEventRecord(stop, s));
    STELLATRAIN_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    STELLATRAIN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
  cudaEvent_t start{};
  cudaEvent_t stop{};
};

/// Median seconds of a device-to-device copy of `bytes` (measured in the benchmark's own setup).
double copy_seconds(std::size_t bytes, cudaStream_t s) {
  device_array<std::byte> a(bytes), b(bytes);
  event_timer t;
  std::vector<double> runs;
  for (int i = 0; i < 7; ++i) {
    runs.push_back(t.time(s, [&] {
      STELLATRAIN_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, s));
    }));
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

struct bench_stream {
  bench_stream() { STELLATRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~bench_stream() { cudaStreamDestroy(s); }
  cudaStream_t s{};
};

std::uint64_t k_of(const benchmark::State& state) {
  return static_cast<std::uint64_t>(state.range(0)) * static_cast<std::uint64_t>(state.range(1)) /
         1000;
}

/// Times `fn` per iteration (manual time), sets items/bytes and "passes" = 2 x time / copy
/// time; returns the mean seconds.
template <class Fn>
double run_timed(benchmark::State& state, cudaStream_t s, double copy_s, std::size_t bytes_per_item,
                 Fn&& fn) {
  event_timer timer;
  fn();  // warm-up (first launch of each kernel, threshold bootstrap)
  STELLATRAIN_CUDA_CHECK(cudaStreamSynchronize(s));
  double total = 0;
  for (auto _ : state) {
    const double sec = timer.time(s, fn);
    total += sec;
    state.SetIterationTime(sec);
  }
  const auto n = static_cast<std::int64_t>(state.range(0));
  state.SetItemsProcessed(state.iterations() * n);
  state.SetBytesProcessed(state.iterations() * n * static_cast<std::int64_t>(bytes_per_item));
  const double mean =
      total / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
  state.counters["copy_us"] = copy_s * 1e6;
  state.counters["passes"] = 2.0 * mean / copy_s;
  return mean;
}

void BM_select_cuda_copy(benchmark::State& state) {
  if (!device_present()) return state.SkipWithError("no CUDA device");
  bench_stream s;
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient<float>(n);
  device_array<float> y(n);
  event_timer timer;
  for (auto _ : state) {
    state.SetIterationTime(timer.time(s.s, [&] {
      STELLATRAIN_CUDA_CHECK(
          cudaMemcpyAsync(y.ptr, x.ptr, n * sizeof(float), cudaMemcpyDeviceToDevice, s.s));
    }));
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(n * sizeof(float)));
}

template <class T>
void BM_select_cuda_topk_impl(benchmark::State& state, bool threshold) {
  if (!device_present()) return state.SkipWithError("no CUDA device");
  bench_stream s;
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t k = k_of(state);
  const auto& x = gradient<T>(n);
  device_array<std::byte> out(topk_output_bytes<T>(n, k));
  device_array<std::byte> ws(topk_workspace_bytes<T>(n, k));
  device_array<topk_threshold_state> st(1);
  const cuda_stream ctx{s.s};
  reset_threshold_state(ctx, st.ptr);
  const double copy_s = copy_seconds(n * sizeof(T), s.s);
  run_timed(state, s.s, copy_s, sizeof(T), [&] {
    if (threshold) {
      select_topk_threshold(ctx, x.ptr, n, k, st.ptr, out.bytes(), ws.bytes());
    } else {
      select_topk(ctx, x.ptr, n, k, out.bytes(), ws.bytes());
    }
  });
}

void BM_select_cuda_topk(benchmark::State& state) { BM_select_cuda_topk_impl<float>(state, false); }
void BM_select_cuda_topk_bf16(benchmark::State& state) {
  BM_select_cuda_topk_impl<bf16>(state, false);
}
void BM_select_cuda_threshold(benchmark::State& state) {
  BM_select_cuda_topk_impl<float>(state, true);
}

void BM_select_cuda_feedback_impl(benchmark::State& state, bool threshold) {
  if (!device_present()) return state.SkipWithError("no CUDA device");
  bench_stream s;
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t k = k_of(state);
  const auto& g = gradient<float>(n);
  device_array<float> residual(n);
  STELLATRAIN_CUDA_CHECK(cudaMemsetAsync(residual.ptr, 0, n * sizeof(float), s.s));
  device_array<std::byte> out(topk_output_bytes<float>(n, k));
  device_array<std::byte> ws(error_feedback_workspace_bytes(n, k));
  device_array<topk_threshold_state> st(1);
  const cuda_stream ctx{s.s};
  reset_threshold_state(ctx, st.ptr);
  const double copy_s = copy_seconds(n * sizeof(float), s.s);
  // The bound: one kernel that reads g and the residual and writes the residual.
  event_timer t;
  std::vector<double> base;
  for (int i = 0; i < 7; ++i) {
    base.push_back(
        t.time(s.s, [&] { accumulate_baseline<<<4096, 256, 0, s.s>>>(g.ptr, residual.ptr, n); }));
  }
  std::sort(base.begin(), base.end());
  STELLATRAIN_CUDA_CHECK(cudaMemsetAsync(residual.ptr, 0, n * sizeof(float), s.s));
  const double mean = run_timed(state, s.s, copy_s, 3 * sizeof(float), [&] {
    if (threshold) {
      error_feedback_topk_threshold(ctx, g.ptr, residual.ptr, n, k, st.ptr, out.bytes(),
                                    ws.bytes());
    } else {
      error_feedback_topk(ctx, g.ptr, residual.ptr, n, k, out.bytes(), ws.bytes());
    }
  });
  state.counters["baseline_us"] = base[base.size() / 2] * 1e6;
  state.counters["x_baseline"] = mean / base[base.size() / 2];
}

void BM_select_cuda_feedback(benchmark::State& state) {
  BM_select_cuda_feedback_impl(state, false);
}
void BM_select_cuda_feedback_threshold(benchmark::State& state) {
  BM_select_cuda_feedback_impl(state, true);
}

void BM_select_cuda_feedback_baseline(benchmark::State& state) {
  if (!device_present()) return state.SkipWithError("no CUDA device");
  bench_stream s;
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const auto& g = gradient<float>(n);
  device_array<float> residual(n);
  STELLATRAIN_CUDA_CHECK(cudaMemsetAsync(residual.ptr, 0, n * sizeof(float), s.s));
  const double copy_s = copy_seconds(n * sizeof(float), s.s);
  run_timed(state, s.s, copy_s, 3 * sizeof(float),
            [&] { accumulate_baseline<<<4096, 256, 0, s.s>>>(g.ptr, residual.ptr, n); });
}

void sizes_and_densities(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "permille"});
  for (std::int64_t n : {1'000'000, 10'000'000, 100'000'000}) {
    for (std::int64_t permille : {1, 10, 100}) b->Args({n, permille});
  }
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n"});
  for (std::int64_t n : {1'000'000, 10'000'000, 100'000'000}) b->Args({n});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

}  // namespace

BENCHMARK(BM_select_cuda_copy)->Apply(sizes);
BENCHMARK(BM_select_cuda_topk)->Apply(sizes_and_densities);
BENCHMARK(BM_select_cuda_topk_bf16)->Apply(sizes_and_densities);
BENCHMARK(BM_select_cuda_threshold)->Apply(sizes_and_densities);
BENCHMARK(BM_select_cuda_feedback_baseline)->Apply(sizes);
BENCHMARK(BM_select_cuda_feedback)->Apply(sizes_and_densities);
BENCHMARK(BM_select_cuda_feedback_threshold)->Apply(sizes_and_densities);
