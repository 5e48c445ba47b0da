// SPDX-License-Identifier: Apache-2.0
// Data-parallel training of an MLP on Fashion-MNIST by ranks in clusters joined by slow
// uplinks, in four modes: "dense" (the averaged gradient through a dense ring all-reduce, as
// PyTorch DDP does), "dense-hier" (reduced inside each cluster first), "stellatrain" (the
// pipeline: top-k selection with error feedback, packing, sparse all-gather, the CPU optimizer
// and the bandwidth-adaptive density controller) and "stellatrain-hier" (its hierarchical
// exchange). Prints progress and a table of time to the target accuracy, and writes
// summary.json, curve.csv and curve.png. This file holds the backends; options.cpp the command
// line, training.cpp the training, mlp.cpp the model, report.cpp the output.
//
//   train_fashion_mnist       4 in-process ranks in 2 clusters, 100 Mbit/s uplinks, 20 ms RTT
//   mpirun -np 4 train_fashion_mnist --transport mpi --clusters 2,2
//   STELLATRAIN_RANK=r STELLATRAIN_ZMQ_PEERS=... train_fashion_mnist --transport zmq
//   train_fashion_mnist --help
#include "fashion_mnist.hpp"
#include "options.hpp"
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

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace st = stellatrain;
namespace fm = fashion_mnist;

namespace {

using fm::data;
using fm::settings;

// The clusters: --clusters, else (MPI, ZeroMQ) $STELLATRAIN_CLUSTERS, else one rank each.
st::cluster_topology topology_of(const settings& s, int world) {
  if (!s.clusters.empty()) return st::cluster_topology::parse(s.clusters);
  if (s.transport == "inprocess") return st::cluster_topology::flat(world);
  return st::cluster_topology::from_environment(world);
}

// The WAN of this process's ranks, or none (the clusters' uplinks, shared by their ranks in this
// process).
std::shared_ptr<st::cluster_links> uplinks(const settings& s, const st::cluster_topology& topo) {
  if (!s.shaped()) return nullptr;
  const auto one_way = std::chrono::microseconds(static_cast<std::int64_t>(s.rtt_ms * 500.0));
  return std::make_shared<st::cluster_links>(topo, s.bandwidth_mbps * 1e6, one_way);
}

// The rank's link: the backend, shaped when asked (the uplinks; the rank's own link inside its
// cluster at --lan-bandwidth).
template <st::transport Inner>
st::any_transport link_of(Inner inner, const settings& s,
                          const std::shared_ptr<st::cluster_links>& links) {
  if (!s.shaped()) return st::any_transport(std::move(inner));
  return st::any_transport(st::shaped_transport<Inner>(
      std::move(inner), {.bits_per_second = s.lan_mbps * 1e6, .clusters = links}));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    settings s;
    if (const auto done = fm::parse_options(argc, argv, s)) return *done;
#if STELLATRAIN_DEMO_WITH_MPI
    std::optional<st::mpi_environment> mpi;
    if (s.transport == "mpi") mpi.emplace(argc, argv);
#else
    if (s.transport == "mpi") {
      throw st::error(st::errc::unsupported,
                      "this build has no MPI support (install libopenmpi-dev and rebuild)");
    }
#endif
#if !STELLATRAIN_DEMO_WITH_ZMQ
    if (s.transport == "zmq") {
      throw st::error(
          st::errc::unsupported,
          "this build has no ZeroMQ support (install libzmq3-dev cppzmq-dev and rebuild)");
    }
#endif
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
        fm::train(link_of(std::move(t), s, links), *topo, s, d, links, &results);
      });
    } else if (s.transport == "mpi") {
#if STELLATRAIN_DEMO_WITH_MPI
      st::mpi_transport t;
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over MPI: %d ranks\n", ranks);
      topo.emplace(topology_of(s, ranks));
      const auto links = uplinks(s, *topo);
      fm::train(link_of(std::move(t), s, links), *topo, s, d, links, &results);
#endif
    } else {
#if STELLATRAIN_DEMO_WITH_ZMQ
      auto t = st::zmq_transport::from_environment();
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over ZeroMQ: %d ranks\n", ranks);
      topo.emplace(topology_of(s, ranks));
      const auto links = uplinks(s, *topo);
      fm::train(link_of(std::move(t), s, links), *topo, s, d, links, &results);
#endif
    }
    if (my_rank == 0) fm::report(s, results, *topo);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
