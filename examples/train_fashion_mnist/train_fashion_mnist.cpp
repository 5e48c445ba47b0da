// SPDX-License-Identifier: Apache-2.0
// Data-parallel training of an MLP on Fashion-MNIST by ranks in clusters joined by slow
// uplinks, in four modes: "dense" (the averaged gradient through a dense ring all-reduce, as
// PyTorch DDP does), "dense-hier" (reduced inside each cluster first), "stellatrain" (the
// pipeline: top-k selection with error feedback, packing, sparse all-gather, the CPU optimizer
// and the bandwidth-adaptive density controller) and "stellatrain-hier" (its hierarchical
// exchange). Prints progress and a table of time to the target accuracy, and writes
// summary.json, curve.csv and curve.png. This file holds the options, the backends and the
// report; training.cpp the training, mlp.cpp the model.
//
//   train_fashion_mnist       4 in-process ranks in 2 clusters, 100 Mbit/s uplinks, 20 ms RTT
//   mpirun -np 4 train_fashion_mnist --transport mpi
//   STELLATRAIN_RANK=r STELLATRAIN_ZMQ_PEERS=... train_fashion_mnist --transport zmq
//   train_fashion_mnist --help
#include "fashion_mnist.hpp"
#include "report.hpp"
#include "settings.hpp"
#include "training.hpp"

#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/any_transport.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/in_process.hpp>
#include <stellatrain/transport/shaping.hpp>
#if STELLATRAIN_DEMO_WITH_MPI
#include <stellatrain/transport/mpi.hpp>
#endif
#if STELLATRAIN_DEMO_WITH_ZMQ
#include <stellatrain/transport/zmq.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace st = stellatrain;
namespace fm = fashion_mnist;

namespace {

using fm::data;
using fm::settings;

const char* usage =
    R"(train_fashion_mnist: data-parallel training by clusters of ranks joined by slow
uplinks, dense all-reduce against the stellatrain pipeline, each flat and hierarchical, on
Fashion-MNIST (Debian's dataset-fashion-mnist).

Options (defaults in brackets):
  --transport T     inprocess | mpi | zmq                                 [inprocess]
                    mpi: run under mpirun, one rank per process;
                    zmq: STELLATRAIN_RANK and STELLATRAIN_ZMQ_PEERS (or _FILE) per process
  --clusters C      cluster sizes in rank order, e.g. 2,2 or 3,1; their sum is the number of
                    ranks [inprocess: 2,2, or one rank per cluster with --ranks; otherwise
                    $STELLATRAIN_CLUSTERS, else one rank per cluster]
  --ranks N         ranks as threads of this process (inprocess only), one per cluster
  --bandwidth M     each cluster's uplink in Mbit/s, shaped by the library (each direction,
                    shared by the cluster's ranks); 0: no shaping
                    [100 for inprocess, 0 otherwise: the network (wan-emu) decides]
  --lan-bandwidth M each rank's link inside its cluster, Mbit/s; 0: unshaped          [0]
  --rtt MS          round-trip time between clusters added by the shaping, ms
                    [20 for inprocess, else 0]
  --min-density D   lower bound of the controller's density               [0.0001]
  --max-density D   upper bound of the controller's density               [0.01]
  --epochs E        epochs of training of each mode (both the same)       [0.5]
  --target A        test accuracy whose time is measured, 0..1            [0.82]
  --mode M[,M...]   modes to run, in the order dense, dense-hier, stellatrain,
                    stellatrain-hier; all (every one) or both (dense,stellatrain)   [all]
  --batch B         examples per rank and step                            [32]
  --hidden H        width of the two hidden layers                        [1024]
  --lr L            Adam learning rate of the dense mode                  [0.001]
  --sparse-lr L     Adam learning rate of the stellatrain mode            [0.003]
  --lr-end L        rate both modes reach by a linear decay               [0.001]
  --decay-steps N   steps of that decay (0: each mode keeps its rate)     [60]
                    The defaults are the best of sweeps on the reference machine (dense
                    0.0005-0.003, stellatrain 0.001-0.008; with the decay, starts of dense
                    0.001-0.003 and stellatrain 0.003-0.005): Adam normalizes each element's
                    step, so an element that error feedback holds back for many steps moves
                    about lr when it is sent at last; sparse training wants larger steps
                    early, and the decay to a common rate keeps its later steps as calm as
                    dense training's.
  --staleness S     0 or 1, the pipeline's staleness                      [0]
                    (with 1, each change of the rate waits for the pipeline to drain)
  --eval-every K    steps between evaluations                             [5]
  --eval-samples N  test examples per evaluation during training          [2000]
  --seed S          seed of the initial parameters and data order         [1]
  --data DIR        folder of the IDX files     [/usr/share/datasets/fashion-mnist]
  --out DIR         where summary.json, curve.csv and curve.png go        [out/demo]
  --help            this text

Wall times exclude the evaluations (the clock stops while rank 0 evaluates). The final
accuracy is measured on the whole test set (10000 examples).
)";

settings parse(int argc, char** argv) {
  settings s;
  bool ranks_given = false;
  std::string mode = "all";
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc)
      throw st::error(st::errc::invalid_argument, std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    try {
      if (a == "--help" || a == "-h") {
        std::fputs(usage, stdout);
        std::exit(0);
      } else if (a == "--transport") {
        s.transport = value(i);
      } else if (a == "--ranks") {
        s.ranks = std::stoi(value(i));
        ranks_given = true;
      } else if (a == "--clusters") {
        s.clusters = value(i);
      } else if (a == "--lan-bandwidth") {
        s.lan_mbps = std::stod(value(i));
      } else if (a == "--bandwidth") {
        s.bandwidth_mbps = std::stod(value(i));
      } else if (a == "--rtt") {
        s.rtt_ms = std::stod(value(i));
      } else if (a == "--min-density") {
        s.min_density = std::stod(value(i));
      } else if (a == "--max-density") {
        s.max_density = std::stod(value(i));
      } else if (a == "--epochs") {
        s.epochs = std::stod(value(i));
      } else if (a == "--target") {
        s.target = std::stod(value(i));
      } else if (a == "--mode") {
        mode = value(i);
      } else if (a == "--batch") {
        s.batch = std::stoi(value(i));
      } else if (a == "--hidden") {
        s.hidden = std::stoi(value(i));
      } else if (a == "--lr") {
        s.lr = std::stof(value(i));
      } else if (a == "--sparse-lr") {
        s.sparse_lr = std::stof(value(i));
      } else if (a == "--lr-end") {
        s.lr_end = std::stof(value(i));
      } else if (a == "--decay-steps") {
        s.decay_steps = std::stoi(value(i));
      } else if (a == "--staleness") {
        s.staleness = std::stoi(value(i));
      } else if (a == "--eval-every") {
        s.eval_every = std::stoi(value(i));
      } else if (a == "--eval-samples") {
        s.eval_samples = static_cast<std::size_t>(std::stoul(value(i)));
      } else if (a == "--seed") {
        s.seed = std::stoull(value(i));
      } else if (a == "--data") {
        s.data = value(i);
      } else if (a == "--out") {
        s.out = value(i);
      } else {
        throw st::error(st::errc::invalid_argument, "unknown option " + a + " (see --help)");
      }
    } catch (const std::logic_error&) {
      throw st::error(st::errc::invalid_argument, "bad value for " + a + " (see --help)");
    }
  }
  const bool inproc = s.transport == "inprocess";
  if (!inproc && s.transport != "mpi" && s.transport != "zmq") {
    throw st::error(st::errc::invalid_argument, "--transport must be inprocess, mpi or zmq");
  }
  if (mode == "all") {
    s.modes = fm::mode_names;
  } else if (mode == "both") {
    s.modes = {"dense", "stellatrain"};
  } else {
    std::vector<std::string> asked;
    for (std::size_t at = 0; at <= mode.size();) {
      const std::size_t comma = std::min(mode.find(',', at), mode.size());
      asked.push_back(mode.substr(at, comma - at));
      at = comma + 1;
    }
    for (const auto& m : asked) {
      if (std::find(fm::mode_names.begin(), fm::mode_names.end(), m) == fm::mode_names.end()) {
        throw st::error(st::errc::invalid_argument,
                        "--mode: unknown mode '" + m +
                            "' (all, both, dense, dense-hier, stellatrain, stellatrain-hier)");
      }
    }
    for (const auto& m : fm::mode_names)
      if (std::find(asked.begin(), asked.end(), m) != asked.end()) s.modes.push_back(m);
  }
  if (inproc) {
    if (s.clusters.empty() && !ranks_given) s.clusters = "2,2";
    if (!s.clusters.empty()) {
      const int sum = st::cluster_topology::parse(s.clusters).ranks();
      if (ranks_given && sum != s.ranks) {
        throw st::error(
            st::errc::invalid_argument,
            "--ranks " + std::to_string(s.ranks) + " and --clusters " + s.clusters + " disagree");
      }
      s.ranks = sum;
    }
  }
  if (s.bandwidth_mbps < 0) s.bandwidth_mbps = inproc ? 100 : 0;
  if (s.rtt_ms < 0) s.rtt_ms = inproc ? 20 : 0;
  if (s.ranks < 1 || s.batch < 1 || s.hidden < 1 || s.eval_every < 1 || !(s.epochs > 0) ||
      s.staleness < 0 || s.staleness > 1 || s.decay_steps < 0 || !(s.lr > 0) ||
      !(s.sparse_lr > 0) || !(s.lr_end > 0) || !(s.min_density > 0) ||
      s.min_density > s.max_density || s.max_density > 1 || !(s.lan_mbps >= 0)) {
    throw st::error(st::errc::invalid_argument, "an option is out of range (see --help)");
  }
  return s;
}

// The clusters: --clusters, else (MPI, ZeroMQ) $STELLATRAIN_CLUSTERS, else one rank each.
st::cluster_topology topology_of(const settings& s, int world) {
  if (!s.clusters.empty()) return st::cluster_topology::parse(s.clusters);
  if (s.transport == "inprocess") return st::cluster_topology::flat(world);
  return st::cluster_topology::from_environment(world);
}

// The rank's link: the backend, shaped when asked (the clusters' uplinks, shared by their
// ranks; the rank's own link inside its cluster at --lan-bandwidth).
bool shaped(const settings& s) { return s.bandwidth_mbps > 0 || s.rtt_ms > 0 || s.lan_mbps > 0; }

// The WAN of this process's ranks, or none.
std::shared_ptr<st::cluster_links> uplinks(const settings& s, const st::cluster_topology& topo) {
  if (!shaped(s)) return nullptr;
  const auto one_way = std::chrono::microseconds(static_cast<std::int64_t>(s.rtt_ms * 500.0));
  return std::make_shared<st::cluster_links>(topo, s.bandwidth_mbps * 1e6, one_way);
}

template <st::transport Inner>
st::any_transport link_of(Inner inner, const settings& s,
                          const std::shared_ptr<st::cluster_links>& links) {
  if (!shaped(s)) return st::any_transport(std::move(inner));
  return st::any_transport(st::shaped_transport<Inner>(
      std::move(inner), {.bits_per_second = s.lan_mbps * 1e6, .clusters = links}));
}

void report(const settings& s, std::vector<fm::mode_result>& results,
            const st::cluster_topology& topo) {
  const fm::mode_result* dense = nullptr;
  for (const auto& r : results)
    if (r.mode == "dense") dense = &r;
  // Time to target of each mode against dense flat (what PyTorch DDP does).
  std::vector<std::optional<double>> speedup;
  for (const auto& r : results) {
    speedup.emplace_back();
    if (dense && dense->time_to_target && r.time_to_target && *r.time_to_target > 0)
      speedup.back() = *dense->time_to_target / *r.time_to_target;
  }
  std::printf("\n%-17s %10s %15s %7s %16s %14s %9s\n", "mode", "final acc", "time to target",
              "steps", "WAN MB/cluster", "per step (KB)", "speedup");
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    char ttt[32] = "not reached";
    if (r.time_to_target) std::snprintf(ttt, sizeof ttt, "%.1f s", *r.time_to_target);
    char sp[32] = "";
    if (speedup[i]) std::snprintf(sp, sizeof sp, "%.1fx", *speedup[i]);
    const double wan_mb = static_cast<double>(r.wan_bytes_per_cluster) / 1e6;
    std::printf("%-17s %9.2f%% %15s %7llu %16.1f %14.1f %9s\n", r.mode.c_str(),
                r.final_accuracy * 100, ttt, static_cast<unsigned long long>(r.steps), wan_mb,
                r.steps ? wan_mb * 1e3 / static_cast<double>(r.steps) : 0.0, sp);
  }
  char link[128] = "links not shaped by the library";
  if (shaped(s)) {
    std::snprintf(link, sizeof link, "uplinks %.0f Mbit/s, %.0f ms RTT between clusters, LAN %s",
                  s.bandwidth_mbps, s.rtt_ms,
                  s.lan_mbps > 0
                      ? (std::to_string(static_cast<int>(s.lan_mbps)) + " Mbit/s").c_str()
                      : "unshaped");
  }
  std::printf("(target accuracy %.1f%% on %zu test examples; clusters %s, %s, %s)\n",
              s.target * 100, s.eval_samples, topo.to_string().c_str(), s.transport.c_str(), link);
  const std::filesystem::path dir(s.out);
  std::filesystem::create_directories(dir);
  std::ostringstream settings_json;
  settings_json << "{\"transport\": \"" << s.transport << "\", \"ranks\": " << topo.ranks()
                << ", \"clusters\": \"" << topo.to_string() << "\""
                << ", \"bandwidth_mbps\": " << s.bandwidth_mbps << ", \"lan_mbps\": " << s.lan_mbps
                << ", \"rtt_ms\": " << s.rtt_ms << ", \"epochs\": " << s.epochs
                << ", \"batch\": " << s.batch << ", \"hidden\": " << s.hidden
                << ", \"lr\": " << s.lr << ", \"sparse_lr\": " << s.sparse_lr
                << ", \"lr_end\": " << s.lr_end << ", \"decay_steps\": " << s.decay_steps
                << ", \"min_density\": " << s.min_density << ", \"max_density\": " << s.max_density
                << ", \"staleness\": " << s.staleness << "}";
  fm::write_summary_json(dir / "summary.json", results, s.target, speedup, settings_json.str());
  fm::write_curve_csv(dir / "curve.csv", results);
  std::string why;
  const bool plotted = fm::plot(dir, results, s.target, why);
  std::printf("\nwrote %s\n      %s\n", (dir / "summary.json").string().c_str(),
              (dir / "curve.csv").string().c_str());
  if (plotted) {
    std::printf("      %s\n", (dir / "curve.png").string().c_str());
  } else {
    std::printf("      (no plot: %s)\n", why.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if STELLATRAIN_DEMO_WITH_MPI
    std::optional<st::mpi_environment> mpi;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::string(argv[i]) == "--transport" && std::string(argv[i + 1]) == "mpi")
        mpi.emplace(argc, argv);
    }
#endif
    const settings s = parse(argc, argv);
    data d{fm::load(s.data, "train"), fm::load(s.data, "t10k")};
    std::vector<fm::mode_result> results;
    int ranks = s.ranks;
    int my_rank = 0;
    std::optional<st::cluster_topology> topo;
    if (s.transport == "inprocess") {
      std::printf(
          "Fashion-MNIST: %zu training and %zu test examples; MLP 784-%d-%d-10; %d in-process "
          "ranks\n",
          d.train.count, d.test.count, s.hidden, s.hidden, s.ranks);
      topo.emplace(topology_of(s, s.ranks));
      const auto links = uplinks(s, *topo);
      st::run_in_process(s.ranks, [&](st::in_process_transport& t) {
        fm::train(link_of(std::move(t), s, links), *topo, s, d, &results);
      });
    } else if (s.transport == "mpi") {
#if STELLATRAIN_DEMO_WITH_MPI
      st::mpi_transport t;
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over MPI: %d ranks\n", ranks);
      topo.emplace(topology_of(s, ranks));
      fm::train(link_of(std::move(t), s, uplinks(s, *topo)), *topo, s, d, &results);
#else
      throw st::error(st::errc::unsupported,
                      "this build has no MPI support (install libopenmpi-dev and rebuild)");
#endif
    } else {
#if STELLATRAIN_DEMO_WITH_ZMQ
      auto t = st::zmq_transport::from_environment();
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over ZeroMQ: %d ranks\n", ranks);
      topo.emplace(topology_of(s, ranks));
      fm::train(link_of(std::move(t), s, uplinks(s, *topo)), *topo, s, d, &results);
#else
      throw st::error(
          st::errc::unsupported,
          "this build has no ZeroMQ support (install libzmq3-dev cppzmq-dev and rebuild)");
#endif
    }
    if (my_rank == 0) report(s, results, *topo);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
