// SPDX-License-Identifier: Apache-2.0
// Memory-traffic baselines that the kernels' benchmarks compare against, in the same run:
//   BM_baseline_stream_read/N/T    sum N floats (one read pass), T threads
//   BM_baseline_memcpy/N/T         copy N floats (one read + one write pass)
//   BM_baseline_read2_write1/N/T   c[i] = a[i] + b[i] (the traffic of error feedback)
// Buffers are pre-faulted outside the timed loop; bytes processed count what the code reads
// and writes.
#include <stellatrain/core/detail/xsimd_compat.hpp>

#include "bench_support.hpp"

#include <xsimd/xsimd.hpp>

#include <cstring>

namespace sb = stellatrain::bench;
using batch = xsimd::batch<float>;

namespace {

float sum_range(const float* p, std::size_t n) {
  constexpr std::size_t w = batch::size;
  batch a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  std::size_t i = 0;
  for (; i + 4 * w <= n; i += 4 * w) {
    a0 += batch::load_unaligned(p + i);
    a1 += batch::load_unaligned(p + i + w);
    a2 += batch::load_unaligned(p + i + 2 * w);
    a3 += batch::load_unaligned(p + i + 3 * w);
  }
  float s = stellatrain::detail::reduce_add((a0 + a1) + (a2 + a3));
  for (; i < n; ++i) s += p[i];
  return s;
}

void BM_baseline_stream_read(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto x = sb::gaussian(n);
  std::vector<float> partial(threads);
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t b, std::size_t e) {
      partial[b * threads / n] = sum_range(x.data() + b, e - b);
    });
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * sizeof(float)));
}

void BM_baseline_memcpy(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto src = sb::gaussian(n);
  auto dst = sb::prefaulted<float>(n);
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t b, std::size_t e) {
      std::memcpy(dst.data() + b, src.data() + b, (e - b) * sizeof(float));
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 2 * sizeof(float)));
}

void BM_baseline_read2_write1(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto a = sb::gaussian(n, 1);
  auto b = sb::gaussian(n, 2);
  auto c = sb::prefaulted<float>(n);
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t begin, std::size_t end) {
      std::size_t i = begin;
      for (; i + batch::size <= end; i += batch::size) {
        (batch::load_unaligned(a.data() + i) + batch::load_unaligned(b.data() + i))
            .store_unaligned(c.data() + i);
      }
      for (; i < end; ++i) c[i] = a[i] + b[i];
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 3 * sizeof(float)));
}

void thread_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"});
  for (std::int64_t threads : {1, 2}) b->Args({sb::n25m, threads});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_baseline_stream_read)->Apply(thread_args);
BENCHMARK(BM_baseline_memcpy)->Apply(thread_args);
BENCHMARK(BM_baseline_read2_write1)->Apply(thread_args);
