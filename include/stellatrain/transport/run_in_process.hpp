// SPDX-License-Identifier: Apache-2.0
// Runs the ranks of in-process worlds on threads of one process: `run_in_process` (one world)
// and `run_in_process_clusters` (a world of all ranks and one per cluster).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/detail/run_ranks.hpp>
#include <stellatrain/transport/in_process_transport.hpp>
#include <stellatrain/transport/in_process_world.hpp>

#include <cstddef>
#include <memory>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

namespace stellatrain {

namespace detail {

// The world of `run_in_process` (see `run_ranks`).
class in_process_run_world {
 public:
  explicit in_process_run_world(int ranks) : world_(ranks) {}

  std::tuple<in_process_transport> open(int rank) { return {world_.transport(rank)}; }
  void abort(int rank, std::string_view reason) noexcept { world_.abort(rank, reason); }
  void abort_all(std::string_view reason) noexcept { world_.abort(0, reason); }
  [[nodiscard]] int first_abort() const noexcept { return world_.abort_rank(); }

 private:
  in_process_world world_;
};

// The worlds of `run_in_process_clusters` (see `run_ranks`): the WAN world of all ranks, whose
// first abort names the cause, and a LAN world per cluster.
class in_process_cluster_worlds {
 public:
  explicit in_process_cluster_worlds(const cluster_topology& topology)
      : topology_(topology), wan_(topology.ranks()) {
    for (int c = 0; c < topology.clusters(); ++c)
      lans_.push_back(std::make_unique<in_process_world>(topology.size_of(c)));
  }

  // (lan, wan), the WAN transport taken first.
  std::tuple<in_process_transport, in_process_transport> open(int rank) {
    in_process_transport wan = wan_.transport(rank);
    in_process_transport lan = lan_of(rank).transport(topology_.local_rank(rank));
    return {std::move(lan), std::move(wan)};
  }
  void abort(int rank, std::string_view reason) noexcept {
    wan_.abort(rank, reason);
    lan_of(rank).abort(topology_.local_rank(rank), reason);
  }
  void abort_all(std::string_view reason) noexcept {
    wan_.abort(0, reason);
    for (auto& w : lans_) w->abort(0, reason);
  }
  [[nodiscard]] int first_abort() const noexcept { return wan_.abort_rank(); }

 private:
  in_process_world& lan_of(int rank) const noexcept {
    return *lans_[static_cast<std::size_t>(topology_.cluster_of(rank))];
  }

  const cluster_topology& topology_;
  in_process_world wan_;
  std::vector<std::unique_ptr<in_process_world>> lans_;
};

}  // namespace detail

/// Runs `fn(in_process_transport&)` on `ranks` threads, one per rank, and joins them.
///
/// When a rank's `fn` throws, the world is aborted at once (the other ranks' pending and
/// later operations fail with `errc::peer_failure` rather than wait for a timeout); when a
/// rank's `fn` returns, its transport closes. After every thread has ended, the cause is
/// rethrown: the exception of the rank that aborted the world first, else the first thrown.
///
/// \code
///   stellatrain::run_in_process(4, [](stellatrain::in_process_transport& t) {
///     stellatrain::barrier(t);
///   });
/// \endcode
template <class Fn>
void run_in_process(int ranks, Fn&& fn) {
  detail::in_process_run_world world(ranks);
  detail::run_ranks(ranks, world, fn);
}

/// Runs `fn(lan, wan)` on one thread per rank of `topology`, and joins them: `wan` is the rank's
/// transport in a world of all ranks (its global rank), `lan` its transport in a world of its
/// cluster's ranks (its local rank) — the two links of a hierarchical pipeline
/// (`hierarchical_links`). Failures behave as in `run_in_process`: a rank that throws aborts
/// both of its worlds, and the cause is rethrown after every thread has ended.
///
/// \code
///   stellatrain::run_in_process_clusters(stellatrain::cluster_topology::parse("2,2"),
///       [](stellatrain::in_process_transport& lan, stellatrain::in_process_transport& wan) {
///         /* lan.size() == 2, wan.size() == 4 */
///       });
/// \endcode
template <class Fn>
void run_in_process_clusters(const cluster_topology& topology, Fn&& fn) {
  detail::in_process_cluster_worlds worlds(topology);
  detail::run_ranks(topology.ranks(), worlds, fn);
}

}  // namespace stellatrain
