// SPDX-License-Identifier: Apache-2.0
// Throughput of the transport collectives on one backend, per rank and as a share of a link
// rate: what the WAN test (bench/wan/transport.sh, under wan-emu) and the loopback
// measurements print.
//
//   transport_perf --backend inproc|zmq|mpi [options]
//     --ranks N          in-process ranks (inproc only; default 4)
//     --allgather BYTES  message per rank of the sparse all-gather (default 800000: a 1%
//                        selection of 10M fp32 elements as u32 index + fp32 value)
//     --allreduce N      floats of the dense all-reduce (default 10000000; 0 = skip)
//     --reps K           timed repetitions of each (default 5)
//     --batch B          all-gather calls per timed repetition, back to back (default 1);
//                        the reported time is per call. B > 1 measures throughput as
//                        nccl-tests does (the ring's fill latency and the start barrier's
//                        exit skew spread over B calls, as over a step's buckets in training);
//                        B = 1 is the latency of one call started by a barrier
//     --allreduce-reps K timed repetitions of the all-reduce (default: --reps)
//     --warmups W        untimed all-gathers first (default 5; the all-reduce gets 1): TCP
//                        opens its windows over the first ones, as in the first steps of training
//     --algorithm A      all-gather algorithm: auto|ring|direct|native (default auto)
//     --chunk BYTES      pipelining chunk (default: the transport's choice)
//     --link-mbit R      link rate to report utilization against (default 0: not reported)
//     --shape-mbit R     inproc only: shape every rank's sends to R Mbit/s
//     --latency-ms L     inproc only: one-way latency of the shaping
//     --native           mpi only: enable MPI's native collectives
//     --verbose          also print every repetition's time
// ZeroMQ ranks read STELLATRAIN_RANK and STELLATRAIN_ZMQ_PEERS (or _FILE); MPI ranks come
// from mpirun. Rank 0 prints one line per collective:
//   backend=zmq op=sparse_allgather ranks=4 bytes=800000 median_s=0.2 per_rank_MBps=...
//   goodput_mbit=... utilization=0.93
// Goodput is the payload each rank sends per second: (P-1) x bytes for the all-gather,
// 2 (P-1)/P x 4N for the all-reduce; utilization divides it by --link-mbit.
#include <stellatrain/stellatrain.hpp>
#if defined(STELLATRAIN_PERF_WITH_ZMQ)
#include <stellatrain/transport/zmq.hpp>
#endif
#if defined(STELLATRAIN_PERF_WITH_MPI)
#include <stellatrain/transport/mpi.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

using namespace stellatrain;
using namespace std::chrono_literals;

struct config {
  std::string backend;
  int ranks = 4;
  std::size_t allgather = 800000;
  std::size_t allreduce = 10'000'000;
  int reps = 5;
  int batch = 1;
  allgather_algorithm algorithm = allgather_algorithm::automatic;
  std::string algorithm_name = "auto";
  std::size_t chunk = auto_chunk_bytes;
  double link_mbit = 0;
  double shape_mbit = 0;
  double latency_ms = 0;
  bool native = false;
  bool verbose = false;
  int warmups = 5;
  int allreduce_reps = 0;  // 0: --reps
};

[[noreturn]] void usage(const char* what) {
  std::fprintf(stderr, "transport_perf: %s (see the top of bench/wan/transport_perf.cpp)\n", what);
  std::exit(2);
}

config parse(int argc, char** argv) {
  config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--backend")
      c.backend = next();
    else if (a == "--ranks")
      c.ranks = std::stoi(next());
    else if (a == "--allgather")
      c.allgather = std::stoull(next());
    else if (a == "--allreduce")
      c.allreduce = std::stoull(next());
    else if (a == "--reps")
      c.reps = std::stoi(next());
    else if (a == "--batch")
      c.batch = std::stoi(next());
    else if (a == "--chunk")
      c.chunk = std::stoull(next());
    else if (a == "--link-mbit")
      c.link_mbit = std::stod(next());
    else if (a == "--shape-mbit")
      c.shape_mbit = std::stod(next());
    else if (a == "--latency-ms")
      c.latency_ms = std::stod(next());
    else if (a == "--native")
      c.native = true;
    else if (a == "--verbose")
      c.verbose = true;
    else if (a == "--warmups")
      c.warmups = std::stoi(next());
    else if (a == "--allreduce-reps")
      c.allreduce_reps = std::stoi(next());
    else if (a == "--algorithm") {
      c.algorithm_name = next();
      if (c.algorithm_name == "auto")
        c.algorithm = allgather_algorithm::automatic;
      else if (c.algorithm_name == "ring")
        c.algorithm = allgather_algorithm::ring;
      else if (c.algorithm_name == "direct")
        c.algorithm = allgather_algorithm::direct;
      else if (c.algorithm_name == "native")
        c.algorithm = allgather_algorithm::native;
      else
        usage("unknown algorithm");
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (c.backend.empty()) usage("--backend is required");
  if (c.reps < 1) usage("--reps must be at least 1");
  if (c.batch < 1) usage("--batch must be at least 1");
  return c;
}

// Times `reps` repetitions of `batch` back-to-back calls of `op` after `warmups` untimed
// calls, each repetition's start aligned by a barrier; returns the time per call of each
// repetition, the maximum over ranks (all ranks get the same vector). The warm-up sizes the
// buffers and lets TCP open its windows: the steady state of training, where the collective
// runs every step.
template <transport T, class Op>
std::vector<double> timed(T& t, int warmups, int reps, int batch, Op&& op) {
  std::vector<double> mine;
  for (int k = 0; k < warmups; ++k) {
    barrier(t, {.tag = 900, .timeout = 600s});
    op();
  }
  for (int k = 0; k < reps; ++k) {
    barrier(t, {.tag = 900, .timeout = 600s});
    const auto t0 = std::chrono::steady_clock::now();
    for (int b = 0; b < batch; ++b) op();
    mine.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
                   batch);
  }
  std::vector<message_buffer> all(static_cast<std::size_t>(t.size()));
  sparse_allgather(t, std::as_bytes(std::span<const double>(mine)), all,
                   {.tag = 901, .timeout = 600s});
  std::vector<double> worst(static_cast<std::size_t>(reps), 0.0);
  for (const auto& m : all) {
    std::vector<double> v(static_cast<std::size_t>(reps));
    std::memcpy(v.data(), m.data(), m.size());
    for (int k = 0; k < reps; ++k)
      worst[static_cast<std::size_t>(k)] =
          std::max(worst[static_cast<std::size_t>(k)], v[static_cast<std::size_t>(k)]);
  }
  return worst;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// The all-gather algorithm that runs: "auto" resolves as sparse_allgather documents.
std::string allgather_name(const config& c, int p) {
  if (c.algorithm != allgather_algorithm::automatic) return c.algorithm_name;
  if (c.backend == "mpi" && c.native) return "auto:native";
  return p <= allgather_options{}.direct_max_ranks ? "auto:direct" : "auto:ring";
}

void report(const config& c, int p, const char* op, std::size_t bytes, int batch,
            double sent_per_rank, const std::vector<double>& times) {
  const double s = median(times);
  const double best = *std::min_element(times.begin(), times.end());
  const double goodput = sent_per_rank * 8 / s / 1e6;
  std::printf(
      "backend=%s op=%s algorithm=%s ranks=%d bytes=%zu reps=%zu batch=%d median_s=%.4f "
      "best_s=%.4f "
      "per_rank_MBps=%.1f goodput_mbit=%.2f",
      c.backend.c_str(), op,
      std::strcmp(op, "sparse_allgather") == 0 ? allgather_name(c, p).c_str() : "ring", p, bytes,
      times.size(), batch, s, best, sent_per_rank / s / 1e6, goodput);
  if (c.link_mbit > 0) std::printf(" utilization=%.3f", goodput / c.link_mbit);
  if (c.verbose) {
    std::printf(" times_s=");
    for (std::size_t k = 0; k < times.size(); ++k)
      std::printf("%s%.4f", k == 0 ? "" : ",", times[k]);
  }
  std::printf("\n");
  std::fflush(stdout);
}

template <transport T>
void run(T& t, const config& c) {
  const int p = t.size();
  collective_workspace<T> ws;
  if (c.allgather > 0) {
    std::vector<std::byte> mine(c.allgather, std::byte{static_cast<unsigned char>(t.rank())});
    std::vector<message_buffer> out(static_cast<std::size_t>(p));
    for (auto& m : out) m.reserve(c.allgather, true);
    const allgather_options opt{
        .tag = 1, .timeout = 600s, .algorithm = c.algorithm, .chunk_bytes = c.chunk};
    const auto times =
        timed(t, c.warmups, c.reps, c.batch, [&] { sparse_allgather(t, mine, out, opt, ws); });
    for (int r = 0; r < p; ++r) {
      if (out[static_cast<std::size_t>(r)].size() != c.allgather ||
          out[static_cast<std::size_t>(r)].data()[c.allgather / 2] !=
              std::byte{static_cast<unsigned char>(r)}) {
        throw error(errc::malformed_message, "transport_perf: wrong all-gather result");
      }
    }
    if (t.rank() == 0)
      report(c, p, "sparse_allgather", c.allgather, c.batch,
             static_cast<double>(p - 1) * static_cast<double>(c.allgather), times);
  }
  if (c.allreduce > 0) {
    aligned_buffer<float> grad(c.allreduce, {.prefault = true});
    std::fill(grad.begin(), grad.end(), 1.0f);
    const allreduce_options opt{.tag = 2, .timeout = 600s, .chunk_bytes = c.chunk};
    const auto times = timed(t, 1, c.allreduce_reps > 0 ? c.allreduce_reps : c.reps, 1, [&] {
      std::fill(grad.begin(), grad.end(), 1.0f);
      dense_allreduce(t, grad.span(), opt, ws);
    });
    if (grad[c.allreduce - 1] != static_cast<float>(p))
      throw error(errc::malformed_message, "transport_perf: wrong all-reduce result");
    const double sent = 2.0 * (p - 1) / p * 4.0 * static_cast<double>(c.allreduce);
    if (t.rank() == 0) report(c, p, "dense_allreduce", c.allreduce * 4, 1, sent, times);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const config c = parse(argc, argv);
  try {
    if (c.backend == "inproc") {
      run_in_process(c.ranks, [&](in_process_transport& raw) {
        if (c.shape_mbit > 0) {
          shaped_transport t(
              std::move(raw),
              {.bits_per_second = c.shape_mbit * 1e6,
               .latency = std::chrono::microseconds(static_cast<long long>(c.latency_ms * 1000))});
          run(t, c);
        } else {
          run(raw, c);
        }
      });
      return 0;
    }
#if defined(STELLATRAIN_PERF_WITH_ZMQ)
    if (c.backend == "zmq") {
      auto t = zmq_transport::from_environment({.connect_timeout = 120s});
      run(t, c);
      return 0;
    }
#endif
#if defined(STELLATRAIN_PERF_WITH_MPI)
    if (c.backend == "mpi") {
      mpi_environment env(argc, argv);
      mpi_transport t(MPI_COMM_WORLD, {.native_collectives = c.native});
      run(t, c);
      return 0;
    }
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "transport_perf: %s\n", e.what());
    return 1;
  }
  usage(("backend '" + c.backend + "' is not built in").c_str());
}
