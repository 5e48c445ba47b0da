// SPDX-License-Identifier: Apache-2.0
// Transport benchmarks (in-process backend): the sparse all-gather of 2 MB per rank at 4
// ranks against a plain memcpy of the bytes each rank must copy, the dense ring all-reduce,
// and the accuracy of the shaping decorator at 100 Mbit/s.
//
// Counters: per_rank_GBps = bytes each rank receives from the others per second (what bounds
// the pipeline); rate_ratio = achieved / configured rate of the shaped link.
#include "bench_support.hpp"
#include "rank_group.hpp"

#include <stellatrain/stellatrain.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace stellatrain;

constexpr int ranks = 4;
constexpr int batch = 8;  // collectives per timed iteration

// Baseline: one thread copies what one rank of the all-gather receives, (P-1) x bytes.
void BM_transport_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto src = bench::prefaulted<std::byte>(bytes * (ranks - 1));
  auto dst = bench::prefaulted<std::byte>(bytes * (ranks - 1));
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), dst.size());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(dst.size()));
  state.SetItemsProcessed(state.iterations());
  state.counters["per_rank_GBps"] = benchmark::Counter(
      static_cast<double>(dst.size()) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}
BENCHMARK(BM_transport_memcpy)->ArgName("bytes")->Arg(2'000'000)->UseRealTime();

// The 4 transports of one in-process world, kept across iterations.
struct inproc_world {
  in_process_world world{ranks};
  std::vector<in_process_transport> transports;
  std::vector<collective_workspace<in_process_transport>> ws =
      std::vector<collective_workspace<in_process_transport>>(ranks);
  inproc_world() {
    for (int r = 0; r < ranks; ++r) transports.push_back(world.transport(r));
  }
};

void BM_transport_inproc_allgather(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const auto algorithm = static_cast<allgather_algorithm>(state.range(1));
  inproc_world w;
  bench::rank_group group(ranks);
  std::vector<aligned_buffer<std::byte>> mine;
  std::vector<std::vector<message_buffer>> out(ranks);
  for (int r = 0; r < ranks; ++r) {
    mine.push_back(bench::prefaulted<std::byte>(bytes));
    for (int q = 0; q < ranks; ++q) out[static_cast<std::size_t>(r)].emplace_back(bytes, true);
  }
  const allgather_options opt{.algorithm = algorithm};
  // A batch of back-to-back collectives per timed iteration: the steady state of a pipeline,
  // with the thread hand-off of the harness spread over the batch.
  auto step = [&](int r) {
    for (int k = 0; k < batch; ++k) {
      sparse_allgather(w.transports[static_cast<std::size_t>(r)],
                       mine[static_cast<std::size_t>(r)].span(), out[static_cast<std::size_t>(r)],
                       opt, w.ws[static_cast<std::size_t>(r)]);
    }
  };
  group.run(step);  // warm-up
  for (auto _ : state) group.run(step);
  const double received = static_cast<double>(bytes) * (ranks - 1) * batch;
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * received));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * batch);
  state.counters["per_rank_GBps"] = benchmark::Counter(
      received * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_transport_inproc_allgather)
    ->ArgNames({"bytes", "algorithm"})
    ->Args({2'000'000, static_cast<int>(allgather_algorithm::automatic)})
    ->Args({2'000'000, static_cast<int>(allgather_algorithm::ring)})
    ->Args({2'000'000, static_cast<int>(allgather_algorithm::direct)})
    ->UseRealTime()
    ->MinTime(0.5);

void BM_transport_inproc_allreduce(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  inproc_world w;
  bench::rank_group group(ranks);
  std::vector<aligned_buffer<float>> grads;
  for (int r = 0; r < ranks; ++r) grads.push_back(bench::prefaulted<float>(n));
  auto step = [&](int r) {
    dense_allreduce(w.transports[static_cast<std::size_t>(r)],
                    grads[static_cast<std::size_t>(r)].span(), {},
                    w.ws[static_cast<std::size_t>(r)]);
  };
  group.run(step);
  for (auto _ : state) group.run(step);
  // Bytes each rank sends (and receives): 2 (P-1)/P of the gradient.
  const double moved = 2.0 * (ranks - 1) / ranks * 4.0 * static_cast<double>(n);
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * moved));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n));
  state.counters["per_rank_GBps"] = benchmark::Counter(
      moved * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_transport_inproc_allreduce)
    ->ArgName("floats")
    ->Arg(1 << 20)
    ->Arg(10'000'000)
    ->UseRealTime()
    ->MinTime(0.5);

// Shaped in-process link: rank 0 streams `bytes` to rank 1 in 256 KiB messages; the time is
// from the first send to the last byte received.
void BM_transport_shaped_rate(benchmark::State& state) {
  const double mbit = static_cast<double>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t piece = 256 << 10;
  in_process_world world(2);
  shaped_transport a(world.transport(0), {.bits_per_second = mbit * 1e6});
  shaped_transport b(world.transport(1), {.bits_per_second = mbit * 1e6});
  auto src = bench::prefaulted<std::byte>(bytes);
  auto dst = bench::prefaulted<std::byte>(bytes);
  double seconds = 0;
  for (auto _ : state) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(50));  // the bucket refills: each run starts alike
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<shaped_request<in_process_transport>> sends;
    std::vector<shaped_request<in_process_transport>> recvs;
    for (std::size_t at = 0; at < bytes; at += piece) {
      const std::size_t n = std::min(piece, bytes - at);
      recvs.push_back(b.irecv(0, 1, dst.span().subspan(at, n)));
      sends.push_back(a.isend(1, 1, std::span<const std::byte>(src.span()).subspan(at, n)));
    }
    for (auto& r : recvs) wait_or_throw(r, std::chrono::seconds(60), "shaped receive");
    const auto t1 = std::chrono::steady_clock::now();
    for (auto& s : sends) wait_or_throw(s, std::chrono::seconds(60), "shaped send");
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    seconds += std::chrono::duration<double>(t1 - t0).count();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(bytes));
  state.SetItemsProcessed(state.iterations());
  const double achieved =
      static_cast<double>(bytes) * 8.0 * static_cast<double>(state.iterations()) / seconds;
  state.counters["rate_ratio"] = achieved / (mbit * 1e6);
  state.counters["achieved_mbit"] = achieved / 1e6;
}
BENCHMARK(BM_transport_shaped_rate)
    ->ArgNames({"mbit", "bytes"})
    ->Args({100, 4 << 20})
    ->Args({100, 1 << 20})
    ->UseManualTime()
    ->Iterations(3);

}  // namespace
