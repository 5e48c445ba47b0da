// SPDX-License-Identifier: Apache-2.0
// The collectives of a pipeline's start: every rank checks that the others registered the same
// tensors and takes rank 0's initial parameters; a hierarchical exchange also checks every
// rank's view of the clusters and its two links. A mismatch fails every rank at start with the
// same message (never a hang).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pipeline/detail/tensor_table.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/broadcast.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::detail {

// Checks that every rank registered `tensors` (ids and sizes, in order) as rank 0 did, then
// overwrites `initial` (the tensors' values, concatenated) with rank 0's. A rank that differs
// aborts `t` (so that the others learn why it left) and throws `errc::invalid_argument`
// naming the first difference.
template <transport Transport>
void broadcast_initial(Transport& t, std::span<const tensor_shape> tensors,
                       std::span<float> initial, tag_type tag, std::chrono::milliseconds timeout) {
  std::vector<std::uint64_t> shape;
  shape.push_back(tensors.size());
  for (const auto& s : tensors) {
    shape.push_back(s.id);
    shape.push_back(s.size);
  }
  std::vector<std::uint64_t> root_shape = shape;
  collective_workspace<Transport> ws;
  broadcast(t, 0, std::as_writable_bytes(std::span<std::uint64_t>(root_shape)),
            {.tag = tag, .timeout = timeout}, ws);
  if (root_shape != shape) {
    std::string what = "pipeline::start: rank " + std::to_string(t.rank()) +
                       " registered other tensors than rank 0";
    std::size_t i = 1;
    while (i + 1 < shape.size() && shape[i] == root_shape[i] && shape[i + 1] == root_shape[i + 1])
      i += 2;
    if (i + 1 < shape.size()) {
      what += ": its tensor " + std::to_string((i - 1) / 2) + " is id " + std::to_string(shape[i]) +
              " of " + std::to_string(shape[i + 1]) + " elements, rank 0's id " +
              std::to_string(root_shape[i]) + " of " + std::to_string(root_shape[i + 1]) +
              " elements";
    }
    abort_transport(t, what);
    throw_error(errc::invalid_argument, what);
  }
  broadcast(t, 0, std::as_writable_bytes(initial), {.tag = tag, .timeout = timeout}, ws);
}

// Every rank checks every rank's view of the topology and of its two links against rank 0's
// clusters, so that all fail alike on a mismatch.
template <transport Transport>
void check_topology(Transport& lan, Transport& wan, const cluster_topology& topo, tag_type tag,
                    std::chrono::milliseconds timeout) {
  const int ranks = wan.size();
  if (ranks != topo.ranks()) {
    const std::string why = "pipeline::start: the clusters " + topo.to_string() + " hold " +
                            std::to_string(topo.ranks()) + " ranks, the WAN transport has " +
                            std::to_string(ranks);
    abort_transport(wan, why);
    abort_transport(lan, why);
    throw_error(errc::invalid_argument, why);
  }
  std::vector<std::uint64_t> mine{static_cast<std::uint64_t>(wan.rank()),
                                  static_cast<std::uint64_t>(lan.size()),
                                  static_cast<std::uint64_t>(lan.rank())};
  for (int v : topo.sizes()) mine.push_back(static_cast<std::uint64_t>(v));
  std::vector<message_buffer> all(static_cast<std::size_t>(ranks));
  sparse_allgather(wan, std::as_bytes(std::span<const std::uint64_t>(mine)),
                   std::span<message_buffer>(all), {.tag = tag, .timeout = timeout});
  std::vector<std::vector<std::uint64_t>> views(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const message_buffer& m = all[static_cast<std::size_t>(r)];
    auto& v = views[static_cast<std::size_t>(r)];
    v.resize(m.size() / sizeof(std::uint64_t));
    if (m.size() != v.size() * sizeof(std::uint64_t) || v.size() < 4) {
      throw_error(errc::malformed_message,
                  "pipeline::start: rank " + std::to_string(r) + " sent a broken topology");
    }
    std::memcpy(v.data(), m.data(), m.size());
  }
  auto clusters_of = [&](int r) {
    const auto& v = views[static_cast<std::size_t>(r)];
    std::string text;
    for (std::size_t i = 3; i < v.size(); ++i) {
      if (i > 3) text += ',';  // not `"," + std::to_string(...)`: GCC 12 -O3 -Wrestrict
      text += std::to_string(v[i]);
    }
    return text;
  };
  auto fail_with = [&](int r, const std::string& what) {
    throw_error(errc::invalid_argument, "pipeline::start: rank " + std::to_string(r) + " " + what);
  };
  for (int r = 1; r < ranks; ++r) {
    if (clusters_of(r) != clusters_of(0))
      fail_with(r, "has the clusters " + clusters_of(r) + ", rank 0 " + clusters_of(0));
  }
  // From here on every rank's topology is rank 0's.
  for (int r = 0; r < ranks; ++r) {
    const auto& v = views[static_cast<std::size_t>(r)];
    if (v[0] != static_cast<std::uint64_t>(r))
      fail_with(r, "calls itself rank " + std::to_string(v[0]));
    const int c = topo.cluster_of(r);
    if (v[1] != static_cast<std::uint64_t>(topo.size_of(c)) ||
        v[2] != static_cast<std::uint64_t>(topo.local_rank(r))) {
      fail_with(r, "has a LAN transport of rank " + std::to_string(v[2]) + " of " +
                       std::to_string(v[1]) + "; in cluster " + std::to_string(c) + " of " +
                       topo.to_string() + " it needs rank " + std::to_string(topo.local_rank(r)) +
                       " of " + std::to_string(topo.size_of(c)));
    }
  }
}

}  // namespace stellatrain::detail
