// SPDX-License-Identifier: Apache-2.0
// The pipeline on the shaped in-process transport: 4 ranks, a 10M-parameter model in 20
// buckets, the compute of a step emulated by a fixed time in which the CPU is free (the GPU
// computes), links of 100 Mbit/s and 1 Gbit/s with 10 ms one-way latency, density 1%,
// staleness 1, direct all-gather, 8 exchange threads.
//
//   BM_pipeline_step/Mbps/permille/copy   one run of 40 steps. copy:0, what a trainer does: it
//                                    keeps a bf16 copy of the parameters (the GPU's, here
//                                    in host memory) up to date with the changed elements
//                                    (`record_updates` + `copy_changes`, then the scatter)
//                                    and hands over the gradients zero-copy (`gradient_buffer`
//                                    + `push_gradient_buffer(t)`). copy:1: it copies whole tensors
//                                    both ways (`copy_params` in fp32, `push_gradient(t, g)`).
//                                    Counters (rank 0, steady state = steps 10..39):
//     step_s        mean wall time per step
//     bound_s       max(compute, wire bytes per step on the link / link rate)
//     step_over_bound  step_s / bound_s  (target <= 1.15)
//     stage_cores   CPU time of the pipeline's stages per step / step_s (target <= 0.5)
//     link_MB       bytes per step on the rank's link (P - 1 copies of its message)
//     gate_s        time per step the training loop waited for parameters
//     exchange_s    sum over the step's buckets of their exchange times (they overlap)
//     copy_s, sleep_s, push_s  the training loop's time per step bringing its copy of the
//                   parameters up to date (with the gates), in the emulated compute, and
//                   handing over the gradients
//     whole_copies  copy:0: tensors per step copied whole (their changes were not kept)
//
//   BM_cluster_wan_bytes   2 clusters of 2 ranks, each cluster's uplink 100 Mbit/s each way
//                          with 10 ms one-way delay (`cluster_links`), the LAN unshaped; 5M
//                          parameters in 10 tensors, a fixed density of 1%, staleness 0,
//                          20 ms of emulated compute; 12 steps (4 warm-up) of the flat
//                          pipeline, then of the hierarchical one, in the same run.
//     flat_KB, hier_KB   bytes per step out of cluster 0's uplink
//     hier_over_flat     their ratio (target: at most 1/G plus headers, G = 2)
//     flat_step_s, hier_step_s  wall time per step
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/pipeline/runtime_exchange.hpp>
#include <stellatrain/transport/barrier.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/in_process.hpp>
#include <stellatrain/transport/shaping.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

namespace st = stellatrain;

namespace {

constexpr int ranks = 4;
constexpr std::size_t tensors = 20;
constexpr std::size_t tensor_elements = 500'000;  // 10M parameters
constexpr auto compute = std::chrono::milliseconds(100);
constexpr int steps = 40;
constexpr int warmup = 10;

void BM_pipeline_step(benchmark::State& state) {
  const double rate = static_cast<double>(state.range(0)) * 1e6;
  const double density = static_cast<double>(state.range(1)) / 1000.0;
  const bool zero_copy = state.range(2) == 0;
  for (auto _ : state) {
    double step_seconds = 0, stage_cpu = 0, link_bytes = 0, gate = 0, exchange = 0, copy = 0,
           slept = 0, push = 0, wholes = 0;
    // One rank; `record` is the pipeline's update record (bf16 for the zero-copy variant).
    auto rank = [&](st::in_process_transport& raw, auto record) {
      const int r = raw.rank();
      st::shaped_transport<st::in_process_transport> t(
          std::move(raw), {.bits_per_second = rate, .latency = std::chrono::milliseconds(10)});
      st::thread_pool pool{1};
      st::pipeline p(t, pool, st::error_feedback_compressor<st::threshold_selector<>, st::bf16>(),
                     st::adam_optimizer({.lr = 1e-3f}),
                     // Direct all-gather: every rank's shaped link carries its 3 copies at the
                     // link rate and the latency is paid once per bucket, not 3 times; 8
                     // exchange threads keep 8 buckets' latencies overlapping.
                     {.bucket_bytes = tensor_elements * sizeof(float),
                      .staleness = 1,
                      .exchange_threads = 8,
                      .algorithm = st::allgather_algorithm::direct},
                     st::fixed_density{density}, record);
      std::vector<float> init(tensor_elements, 0.0f);
      for (std::size_t i = 0; i < tensors; ++i) p.add_tensor(static_cast<std::uint32_t>(i), init);
      p.start();
      std::vector<float> g(tensor_elements);
      std::mt19937 rng(static_cast<std::uint32_t>(r));
      std::normal_distribution<float> dist(0.0f, 1.0f);
      for (auto& x : g) x = dist(rng);
      std::vector<float> params(tensor_elements);
      // copy:0: the bf16 copy of every tensor, its version, and room for the changes.
      std::vector<std::vector<st::bf16>> mirror(tensors, std::vector<st::bf16>(tensor_elements));
      std::vector<st::param_version> held(tensors);
      std::vector<std::uint32_t> changed(tensor_elements / 2);
      std::vector<st::bf16> changed_values(tensor_elements / 2);
      st::transport_clock::time_point t0{};
      st::pipeline_stats s0{};
      double copy_time = 0, sleep_time = 0, push_time = 0, whole_copies = 0;
      for (int s = 0; s < steps; ++s) {
        if (s == warmup) {
          t0 = st::transport_clock::now();
          s0 = p.stats();
        }
        const auto a = st::transport_clock::now();
        for (std::size_t b = 0; b < p.bucket_count(); ++b) {  // one tensor per bucket here
          p.wait_for_forward(b);
          if constexpr (!decltype(p)::records_updates) {
            p.copy_params(b, params);
          } else {
            const st::param_changes c =
                p.copy_changes(b, held[b], std::span(changed), std::span(changed_values));
            if (c.kind == st::param_changes_kind::sparse) {
              for (std::uint64_t j = 0; j < c.count; ++j) mirror[b][changed[j]] = changed_values[j];
              held[b] = c.version;
            } else if (c.kind == st::param_changes_kind::whole) {
              held[b] = p.copy_params(b, std::span(mirror[b]));
              if (s >= warmup) ++whole_copies;
            }
          }
        }
        const auto c = st::transport_clock::now();
        std::this_thread::sleep_for(compute);  // forward + backward on the GPU
        const auto d = st::transport_clock::now();
        for (std::size_t i = tensors; i-- > 0;) {
          if (!zero_copy) {
            p.push_gradient(i, g);
            continue;
          }
          // A trainer's device-to-host copy would write the gradient into the buffer (DMA,
          // no CPU time); the gradient is the same every step, so each of the two buffers a
          // tensor alternates between is written once, in the first two steps.
          if (s < 2) std::ranges::copy(g, p.gradient_buffer(i).begin());
          p.push_gradient_buffer(i);
        }
        const auto e = st::transport_clock::now();
        if (s >= warmup) {
          copy_time += std::chrono::duration<double>(c - a).count();
          sleep_time += std::chrono::duration<double>(d - c).count();
          push_time += std::chrono::duration<double>(e - d).count();
        }
      }
      const auto t1 = st::transport_clock::now();
      const auto s1 = p.stats();
      p.flush();
      if (r == 0) {
        const int measured = steps - warmup;
        step_seconds = std::chrono::duration<double>(t1 - t0).count() / measured;
        stage_cpu = (s1.stage_cpu_seconds - s0.stage_cpu_seconds) / measured;
        link_bytes = static_cast<double>(s1.link_bytes - s0.link_bytes) / measured;
        gate = (s1.gate_wait_seconds - s0.gate_wait_seconds) / measured;
        exchange = (s1.exchange_seconds - s0.exchange_seconds) / measured;
        copy = copy_time / measured;
        slept = sleep_time / measured;
        push = push_time / measured;
        wholes = whole_copies / measured;
      }
    };
    st::run_in_process(ranks, [&](st::in_process_transport& raw) {
      if (zero_copy) {
        rank(raw, st::record_updates<st::bf16>);
      } else {
        rank(raw, st::record_updates_t<void>{});
      }
    });
    const double bound =
        std::max(std::chrono::duration<double>(compute).count(), link_bytes / (rate / 8.0));
    state.SetIterationTime(step_seconds);
    state.counters["step_s"] = step_seconds;
    state.counters["bound_s"] = bound;
    state.counters["step_over_bound"] = step_seconds / bound;
    state.counters["stage_cores"] = stage_cpu / step_seconds;
    state.counters["link_MB"] = link_bytes / 1e6;
    state.counters["gate_s"] = gate;
    state.counters["exchange_s"] = exchange;
    state.counters["copy_s"] = copy;
    state.counters["sleep_s"] = slept;
    state.counters["push_s"] = push;
    state.counters["whole_copies"] = wholes;
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(tensors * tensor_elements));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(tensors * tensor_elements * 4));
}

// One mode of BM_cluster_wan_bytes: bytes per step out of cluster 0's uplink and seconds per
// step, steady state.
struct cluster_run {
  double wan_bytes = 0;
  double step_seconds = 0;
};

cluster_run run_clusters(bool hierarchical) {
  using link = st::shaped_transport<st::in_process_transport>;
  constexpr std::size_t n_tensors = 10;
  constexpr std::size_t n_elements = 500'000;
  constexpr int n_steps = 12;
  constexpr int n_warmup = 4;
  const auto topo = st::cluster_topology::parse("2,2");
  auto links = std::make_shared<st::cluster_links>(topo, 100e6, std::chrono::microseconds(10'000));
  cluster_run out;
  st::run_in_process_clusters(topo, [&](st::in_process_transport& lan_raw,
                                        st::in_process_transport& wan_raw) {
    link lan(std::move(lan_raw), {.bits_per_second = 0});
    link wan(std::move(wan_raw), {.bits_per_second = 0, .clusters = links});
    st::thread_pool pool{1};
    using compressor = st::error_feedback_compressor<st::threshold_selector<>, st::bf16>;
    using exchange = st::runtime_exchange<link, compressor>;
    using pipeline = st::pipeline<exchange, st::thread_pool, st::adam_optimizer, st::fixed_density>;
    const st::pipeline_options options{.bucket_bytes = n_elements * sizeof(float) * 5,
                                       .staleness = 0,
                                       .exchange_threads = 2,
                                       .algorithm = st::allgather_algorithm::direct};
    auto p = std::make_unique<pipeline>(
        hierarchical ? exchange(st::hierarchical_links<link>{lan, wan, topo}, compressor())
                     : exchange(wan, compressor()),
        pool, st::adam_optimizer({.lr = 1e-3f}), options, st::fixed_density{0.01});
    std::vector<float> init(n_elements, 0.0f);
    for (std::size_t i = 0; i < n_tensors; ++i) p->add_tensor(static_cast<std::uint32_t>(i), init);
    p->start();
    std::vector<float> g(n_elements);
    std::mt19937 rng(static_cast<std::uint32_t>(wan.rank()));
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (auto& x : g) x = dist(rng);
    std::uint64_t bytes0 = 0;
    st::transport_clock::time_point t0{};
    for (int s = 0; s < n_steps; ++s) {
      if (s == n_warmup) {
        st::barrier(wan, {.tag = 7});
        bytes0 = links->bytes_out(0);
        t0 = st::transport_clock::now();
      }
      for (std::size_t b = 0; b < p->bucket_count(); ++b) p->wait_for_forward(b);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // forward + backward
      for (std::size_t i = n_tensors; i-- > 0;) p->push_gradient(i, g);
    }
    p->flush();
    const auto t1 = st::transport_clock::now();
    const std::uint64_t bytes1 = links->bytes_out(0);
    if (wan.rank() == 0) {
      out.wan_bytes = static_cast<double>(bytes1 - bytes0) / (n_steps - n_warmup);
      out.step_seconds = std::chrono::duration<double>(t1 - t0).count() / (n_steps - n_warmup);
    }
    st::barrier(wan, {.tag = 8});
  });
  return out;
}

void BM_cluster_wan_bytes(benchmark::State& state) {
  for (auto _ : state) {
    const cluster_run flat = run_clusters(false);
    const cluster_run hier = run_clusters(true);
    state.SetIterationTime(flat.step_seconds + hier.step_seconds);
    state.counters["flat_KB"] = flat.wan_bytes / 1e3;
    state.counters["hier_KB"] = hier.wan_bytes / 1e3;
    state.counters["hier_over_flat"] = hier.wan_bytes / flat.wan_bytes;
    state.counters["flat_step_s"] = flat.step_seconds;
    state.counters["hier_step_s"] = hier.step_seconds;
  }
}

}  // namespace

BENCHMARK(BM_cluster_wan_bytes)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

BENCHMARK(BM_pipeline_step)
    ->ArgNames({"Mbps", "permille", "copy"})
    ->Args({100, 10, 0})
    ->Args({1000, 10, 0})
    ->Args({100, 10, 1})
    ->Args({1000, 10, 1})
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
