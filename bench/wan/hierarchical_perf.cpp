// SPDX-License-Identifier: Apache-2.0
// The hierarchical pipeline over one backend, on synthetic gradients at a fixed density: the
// checksum of the parameters every rank ends with, and the utilisation of each cluster's
// uplink during the exchanges between clusters. What bench/wan/hierarchical.sh runs in process
// and under wan-emu (2 clusters of 2, each behind one shaped uplink).
//
//   hierarchical_perf --backend inproc|zmq|mpi --clusters 2,2 [options]   (--help lists them)
//
// Every rank's gradient of step s is a fixed pseudo-random vector of its own, rotated by s, so
// the run's result depends only on the options: the same on every backend (the script
// compares the checksums). Rank 0 prints one line:
//   backend=zmq clusters=2,2 elements=... density=... steps=... params_crc=... identical=1
//   exchanges=... wan_MB_per_cluster_step=... exchange_s=... utilization=0.93 ...
// identical=1: every rank's parameters hash the same (else the exit status is 1).
//
// Utilisation: for each exchange (one bucket of one step) and cluster, the bytes the cluster's
// ranks sent to other clusters, over the time from the first of those sends being posted to
// the last being received on the far side, divided by --uplink-mbit; exchanges that overlap
// in time are merged first. No byte crosses before its send is posted or after its receipt,
// so this is a lower bound of the link's use while the bytes crossed (a late receiver's
// wait counts as link time). The timestamps of different ranks are compared, so the
// ranks must share one clock (one host, as under wan-emu). Reported: the total bytes over the
// total time of the merged exchanges ("utilization") and the worst cluster's median over
// exchanges ("median_utilization").
#include <stellatrain/stellatrain.hpp>
#if defined(STELLATRAIN_PERF_WITH_ZMQ)
#include <stellatrain/transport/zmq.hpp>
#endif
#if defined(STELLATRAIN_PERF_WITH_MPI)
#include <stellatrain/transport/mpi.hpp>
#endif

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace {

namespace st = stellatrain;
using namespace std::chrono_literals;

struct config {
  std::string backend;
  std::string clusters = "2,2";
  std::uint64_t elements = 10'000'000;
  int tensors = 1;
  double density = 0.05;
  int steps = 8;
  int warmups = 2;
  double uplink_mbit = 0;
  std::uint64_t seed = 1;
};

using metered_link = st::metered_transport<st::any_transport>;
using group_link = st::group_transport<metered_link>;
using compressor = st::error_feedback_compressor<st::threshold_selector<>, st::bf16>;
using pipeline = st::pipeline<st::hierarchical_exchange<group_link, compressor>, st::thread_pool,
                              st::adam_optimizer, st::fixed_density>;

// One message between clusters, as this rank's meter saw it (trivially copyable: gathered).
struct wan_record {
  std::int64_t posted_ns = 0;
  std::int64_t completed_ns = 0;
  std::uint64_t bytes = 0;
  std::uint32_t tag = 0;
  std::int32_t from = 0;  ///< the sender's world rank
  std::int32_t to = 0;
  std::int32_t sent = 0;  ///< 1: recorded by the sender, 0: by the receiver
};

std::int64_t ns(st::transport_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The pipeline's messages between clusters while `on` is set (its tags start at tag_base; the
// tool's own collectives use lower ones).
class wan_recorder {
 public:
  wan_recorder(const st::cluster_topology& topo, int rank, st::tag_type first_tag)
      : topo_(topo), rank_(rank), first_tag_(first_tag) {}

  void operator()(const st::transfer_record& r) {
    if (!on_.load(std::memory_order_acquire) || r.tag < first_tag_) return;
    if (topo_.cluster_of(r.peer) == topo_.cluster_of(rank_)) return;
    std::lock_guard lock(mutex_);
    records_.push_back({ns(r.posted), ns(r.completed), r.bytes, static_cast<std::uint32_t>(r.tag),
                        r.sent ? rank_ : r.peer, r.sent ? r.peer : rank_, r.sent ? 1 : 0});
  }
  void record(bool on) { on_.store(on, std::memory_order_release); }
  std::vector<wan_record> take() {
    std::lock_guard lock(mutex_);
    return std::move(records_);
  }

 private:
  const st::cluster_topology& topo_;
  int rank_;
  st::tag_type first_tag_;
  std::atomic<bool> on_{false};
  std::mutex mutex_;
  std::vector<wan_record> records_;
};

struct uplink_use {
  std::size_t exchanges = 0;      ///< merged exchanges, over all clusters
  double bytes_per_cluster = 0;   ///< per measured step
  double seconds = 0;             ///< median duration of a merged exchange
  double utilization = 0;         ///< total bytes / total time, all clusters
  double median_utilization = 0;  ///< the worst cluster's median
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

uplink_use uplink_of(const std::vector<wan_record>& all, const st::cluster_topology& topo,
                     const config& c, int measured_steps) {
  uplink_use out;
  double total_bytes = 0;
  double total_seconds = 0;
  double worst = -1;
  std::vector<double> durations;
  for (int k = 0; k < topo.clusters(); ++k) {
    // Per tag: the cluster's bytes out, its first send posted, the last receipt elsewhere.
    struct span {
      std::int64_t begin = INT64_MAX;
      std::int64_t end = INT64_MIN;
      double bytes = 0;
    };
    std::map<std::uint32_t, span> by_tag;
    for (const auto& r : all) {
      if (topo.cluster_of(r.from) != k) continue;
      span& s = by_tag[r.tag];
      if (r.sent) {
        s.begin = std::min(s.begin, r.posted_ns);
        s.bytes += static_cast<double>(r.bytes);
      } else {
        s.end = std::max(s.end, r.completed_ns);
      }
    }
    std::vector<span> spans;
    for (const auto& [tag, s] : by_tag)
      if (s.begin < s.end) spans.push_back(s);
    std::sort(spans.begin(), spans.end(),
              [](const span& a, const span& b) { return a.begin < b.begin; });
    std::vector<double> use;
    for (std::size_t i = 0; i < spans.size();) {
      span m = spans[i];
      for (++i; i < spans.size() && spans[i].begin <= m.end; ++i) {
        m.end = std::max(m.end, spans[i].end);
        m.bytes += spans[i].bytes;
      }
      const double sec = static_cast<double>(m.end - m.begin) * 1e-9;
      total_bytes += m.bytes;
      total_seconds += sec;
      durations.push_back(sec);
      ++out.exchanges;
      if (c.uplink_mbit > 0) use.push_back(m.bytes * 8 / sec / (c.uplink_mbit * 1e6));
    }
    if (!use.empty()) worst = worst < 0 ? median(use) : std::min(worst, median(use));
  }
  out.bytes_per_cluster = total_bytes / topo.clusters() / std::max(measured_steps, 1);
  out.seconds = median(durations);
  if (c.uplink_mbit > 0 && total_seconds > 0)
    out.utilization = total_bytes * 8 / total_seconds / (c.uplink_mbit * 1e6);
  out.median_utilization = std::max(worst, 0.0);
  return out;
}

// Gathers every rank's bytes on every rank (a tag below the pipeline's).
std::vector<std::vector<std::byte>> gather(metered_link& t, std::span<const std::byte> mine,
                                           st::tag_type tag) {
  std::vector<st::message_buffer> got(static_cast<std::size_t>(t.size()));
  st::sparse_allgather(t, mine, got, {.tag = tag, .timeout = 600s});
  std::vector<std::vector<std::byte>> out;
  for (const auto& m : got) out.emplace_back(m.data(), m.data() + m.size());
  return out;
}

int run(st::any_transport world, const config& c) {
  const auto topo = st::cluster_topology::parse(c.clusters);
  topo.check_world(world.size(), "--clusters");
  const st::pipeline_options options{.staleness = 0, .timeout = std::chrono::minutes(5)};
  const int rank = world.rank();
  wan_recorder recorder(topo, rank, options.tag_base);
  metered_link t(std::move(world),
                 {.on_transfer = [&](const st::transfer_record& r) { recorder(r); }});
  std::vector<int> all(static_cast<std::size_t>(t.size()));
  for (int r = 0; r < t.size(); ++r) all[static_cast<std::size_t>(r)] = r;
  group_link wan(t, all);
  std::vector<int> members;
  const int cluster = topo.cluster_of(rank);
  for (int j = 0; j < topo.size_of(cluster); ++j) members.push_back(topo.global_rank(cluster, j));
  group_link lan(t, members);

  st::thread_pool pool{1};
  pipeline p(st::hierarchical_links<group_link>{lan, wan, topo}, pool, compressor(),
             st::adam_optimizer({.lr = 1e-3f}), options, st::fixed_density{c.density});
  const std::uint64_t per_tensor = c.elements / static_cast<std::uint64_t>(c.tensors);
  std::vector<float> init(per_tensor);
  std::mt19937_64 init_rng(c.seed);
  std::normal_distribution<float> unit(0.0f, 1.0f);
  for (auto& x : init) x = 0.1f * unit(init_rng);
  for (int i = 0; i < c.tensors; ++i) p.add_tensor(static_cast<std::uint32_t>(i), init);
  p.start();

  // This rank's gradient source: twice the tensor, so that a rotation is a contiguous copy.
  std::vector<float> source(2 * per_tensor);
  std::mt19937_64 rng(c.seed * 1000 + static_cast<std::uint64_t>(rank) + 1);
  for (std::uint64_t i = 0; i < per_tensor; ++i) source[i] = source[i + per_tensor] = unit(rng);
  for (int s = 0; s < c.steps + c.warmups; ++s) {
    if (s == c.warmups) {  // every exchange of the warm-up steps done on every rank
      p.flush();
      st::barrier(t, {.tag = 10, .timeout = 600s});
      recorder.record(true);
    }
    for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
    for (int i = c.tensors; i-- > 0;) {
      const std::uint64_t shift =
          (static_cast<std::uint64_t>(s) * 7919 + static_cast<std::uint64_t>(i) * 104729) %
          per_tensor;
      p.push_gradient(static_cast<std::size_t>(i),
                      std::span<const float>(source).subspan(shift, per_tensor));
    }
  }
  p.flush();
  st::barrier(t, {.tag = 11, .timeout = 600s});
  recorder.record(false);

  std::uint32_t crc = 0;
  std::vector<float> params(per_tensor);
  for (int i = 0; i < c.tensors; ++i) {
    p.copy_params(static_cast<std::size_t>(i), params);
    crc = st::crc32c(std::as_bytes(std::span<const float>(params)), crc);
  }
  const auto crcs = gather(t, std::as_bytes(std::span<const std::uint32_t>(&crc, 1)), 12);
  bool identical = true;
  for (const auto& m : crcs) identical = identical && std::memcmp(m.data(), &crc, sizeof crc) == 0;

  const std::vector<wan_record> mine = recorder.take();
  const auto records = gather(t, std::as_bytes(std::span<const wan_record>(mine)), 13);
  if (rank == 0) {
    std::vector<wan_record> everyone;
    for (const auto& m : records) {
      const std::size_t n = m.size() / sizeof(wan_record);
      const std::size_t at = everyone.size();
      everyone.resize(at + n);
      std::memcpy(everyone.data() + at, m.data(), n * sizeof(wan_record));
    }
    const uplink_use u = uplink_of(everyone, topo, c, c.steps);
    std::printf(
        "backend=%s clusters=%s elements=%llu density=%g steps=%d params_crc=%08x identical=%d "
        "exchanges=%zu wan_MB_per_cluster_step=%.3f exchange_s=%.4f",
        c.backend.c_str(), topo.to_string().c_str(),
        static_cast<unsigned long long>(per_tensor * static_cast<std::uint64_t>(c.tensors)),
        c.density, c.steps, crc, identical ? 1 : 0, u.exchanges, u.bytes_per_cluster / 1e6,
        u.seconds);
    if (c.uplink_mbit > 0)
      std::printf(" uplink_mbit=%g utilization=%.3f median_utilization=%.3f", c.uplink_mbit,
                  u.utilization, u.median_utilization);
    std::printf("\n");
    std::fflush(stdout);
  }
  st::barrier(t, {.tag = 14, .timeout = 600s});
  return identical ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  config c;
  CLI::App app{"The hierarchical pipeline over one backend: parameter checksum and uplink use"};
  app.add_option("--backend", c.backend, "inproc, zmq or mpi")
      ->required()
      ->check(CLI::IsMember({"inproc", "zmq", "mpi"}));
  app.add_option("--clusters", c.clusters, "cluster sizes in rank order, e.g. 2,2")
      ->capture_default_str();
  app.add_option("--elements", c.elements, "parameters in all")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1000}, std::uint64_t{1} << 32));
  app.add_option("--tensors", c.tensors,
                 "tensors of equal size (each above 4 MiB is a bucket of its own)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--density", c.density, "fixed density of the selection")
      ->capture_default_str()
      ->check(CLI::Range(1e-6, 1.0));
  app.add_option("--steps", c.steps, "measured steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--warmups", c.warmups, "steps before the measured ones")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("--uplink-mbit", c.uplink_mbit,
                 "each cluster's uplink rate to report utilisation against (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--seed", c.seed, "seed of the parameters and gradients")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const auto topo = st::cluster_topology::parse(c.clusters);
    if (c.backend == "inproc") {
      int status = 0;
      std::mutex m;
      st::run_in_process(topo.ranks(), [&](st::in_process_transport& t) {
        const int s = run(st::any_transport(std::move(t)), c);
        std::lock_guard lock(m);
        status = std::max(status, s);
      });
      return status;
    }
#if defined(STELLATRAIN_PERF_WITH_ZMQ)
    if (c.backend == "zmq")
      return run(st::any_transport(st::zmq_transport::from_environment({.connect_timeout = 120s})),
                 c);
#endif
#if defined(STELLATRAIN_PERF_WITH_MPI)
    if (c.backend == "mpi") {
      st::mpi_environment env(argc, argv);
      return run(st::any_transport(st::mpi_transport(MPI_COMM_WORLD)), c);
    }
#endif
    std::fprintf(stderr, "hierarchical_perf: backend %s is not built in\n", c.backend.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hierarchical_perf: %s\n", e.what());
    return 1;
  }
}
