// SPDX-License-Identifier: Apache-2.0
// Core utilities:
//   BM_core_first_touch/MiB/huge    allocate an aligned_buffer and pre-fault it, with small
//                                    (huge=0) or transparent huge pages (huge=1): what a
//                                    buffer allocated per step would cost every step
//   BM_core_bulk_overhead/threads   an empty bulk of `threads` calls: the fixed cost of
//                                    splitting work across the pool
//   BM_core_bulk_sequence/awake     8 bulk calls of 2 x 32 KiB of work, each after a short
//                                    serial step (as in a kernel's phases), on 2 threads; with
//                                    awake=1 a stay_awake guard is held around the 8
#include <stellatrain/core/random_indices.hpp>

#include "bench_support.hpp"

#include <vector>

namespace sb = stellatrain::bench;

namespace {

void BM_core_first_touch(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0)) << 20;
  const bool huge = state.range(1) != 0;
  for (auto _ : state) {
    stellatrain::aligned_buffer<std::byte> b(bytes, {.prefault = true, .huge_pages = huge});
    benchmark::DoNotOptimize(b.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_core_first_touch)
    ->ArgNames({"MiB", "huge"})
    ->Args({64, 0})
    ->Args({64, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_core_bulk_overhead(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  auto& pool = sb::pool(threads);
  std::atomic<std::size_t> sink{0};
  for (auto _ : state) {
    pool.bulk(threads, [&](std::size_t i) { sink.fetch_add(i, std::memory_order_relaxed); });
  }
  benchmark::DoNotOptimize(sink.load());
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_core_bulk_overhead)
    ->ArgName("threads")
    ->Arg(1)
    ->Arg(2)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_core_bulk_sequence(benchmark::State& state) {
  const bool awake = state.range(0) != 0;
  auto& pool = sb::pool(2);
  constexpr std::size_t piece = 8192;  // floats per call
  auto data = sb::gaussian(2 * piece, 3);
  std::vector<float> partial(2);
  float carry = 0.0f;
  for (auto _ : state) {
    stellatrain::thread_pool::awake_guard guard;
    if (awake) guard = pool.stay_awake();
    for (int phase = 0; phase < 8; ++phase) {
      for (std::size_t i = 0; i < 256; ++i) carry += data[i] * 0.5f;  // the serial step
      pool.bulk(2, [&](std::size_t t) {
        float s = 0.0f;
        for (std::size_t i = t * piece; i < (t + 1) * piece; ++i) s += data[i];
        partial[t] = s;
      });
      benchmark::DoNotOptimize(partial.data());
    }
  }
  benchmark::DoNotOptimize(carry);
  state.SetItemsProcessed(state.iterations() * 8);
}
BENCHMARK(BM_core_bulk_sequence)
    ->ArgName("awake")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

namespace {

// BM_core_sample_indices/n/k: the random-k index set of a tensor (what a receiver regenerates).
void BM_core_sample_indices(benchmark::State& state) {
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const auto k = static_cast<std::uint64_t>(state.range(1));
  auto out = sb::prefaulted<std::uint32_t>(static_cast<std::size_t>(k));
  auto ws = sb::prefaulted<std::uint64_t>(
      static_cast<std::size_t>(stellatrain::sample_indices_workspace_words(n)));
  std::uint32_t step = 0;
  for (auto _ : state) {
    stellatrain::sample_sorted_indices<std::uint32_t>({.seed = 1, .step = step++}, n, k, out.span(),
                                                      ws.span());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * k));
}
BENCHMARK(BM_core_sample_indices)
    ->ArgNames({"n", "k"})
    ->Args({sb::n25m, sb::n25m / 1000})
    ->Args({sb::n25m, sb::n25m / 100})
    ->Args({sb::n25m, sb::n25m / 10})
    ->Unit(benchmark::kMillisecond);

}  // namespace
