// SPDX-License-Identifier: Apache-2.0
// ZeroMQ backend on loopback TCP: the sparse all-gather of 2 MB per rank at 4 ranks (ranks as
// threads of this process, each with its own ZeroMQ context and sockets), against a memcpy
// of the bytes a rank receives. Built when the zmq component is.
#include "bench_support.hpp"
#include "rank_group.hpp"

#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/zmq.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using namespace stellatrain;

constexpr int ranks = 4;
constexpr int batch = 8;  // collectives per timed iteration

void BM_transport_zmq_memcpy(benchmark::State& state) {
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
}
BENCHMARK(BM_transport_zmq_memcpy)->ArgName("bytes")->Arg(2'000'000)->UseRealTime();

void BM_transport_zmq_allgather(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const auto algorithm = static_cast<allgather_algorithm>(state.range(1));
  // Worlds on free loopback ports, connected in parallel (each constructor waits for all).
  std::vector<std::unique_ptr<zmq_listener>> listeners;
  std::vector<std::string> endpoints;
  for (int r = 0; r < ranks; ++r) {
    listeners.push_back(std::make_unique<zmq_listener>("tcp://127.0.0.1:*"));
    endpoints.push_back(listeners.back()->endpoint());
  }
  std::vector<std::unique_ptr<zmq_transport>> t(ranks);
  bench::rank_group group(ranks);
  group.run([&](int r) {
    t[static_cast<std::size_t>(r)] = std::make_unique<zmq_transport>(
        std::move(*listeners[static_cast<std::size_t>(r)]), r, endpoints);
  });
  std::vector<collective_workspace<zmq_transport>> ws(ranks);
  std::vector<aligned_buffer<std::byte>> mine;
  std::vector<std::vector<message_buffer>> out(ranks);
  for (int r = 0; r < ranks; ++r) {
    mine.push_back(bench::prefaulted<std::byte>(bytes));
    for (int q = 0; q < ranks; ++q) out[static_cast<std::size_t>(r)].emplace_back(bytes, true);
  }
  const allgather_options opt{.algorithm = algorithm};
  auto step = [&](int r) {
    for (int k = 0; k < batch; ++k) {
      sparse_allgather(*t[static_cast<std::size_t>(r)], mine[static_cast<std::size_t>(r)].span(),
                       out[static_cast<std::size_t>(r)], opt, ws[static_cast<std::size_t>(r)]);
    }
  };
  group.run(step);
  for (auto _ : state) group.run(step);
  const double received = static_cast<double>(bytes) * (ranks - 1) * batch;
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * received));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * batch);
  state.counters["per_rank_GBps"] = benchmark::Counter(
      received * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  group.run([&](int r) { t[static_cast<std::size_t>(r)].reset(); });  // close together
}
BENCHMARK(BM_transport_zmq_allgather)
    ->ArgNames({"bytes", "algorithm"})
    ->Args({2'000'000, static_cast<int>(allgather_algorithm::automatic)})
    ->Args({2'000'000, static_cast<int>(allgather_algorithm::ring)})
    ->UseRealTime()
    ->MinTime(0.5);

}  // namespace
