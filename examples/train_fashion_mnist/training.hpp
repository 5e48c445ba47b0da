// SPDX-License-Identifier: Apache-2.0
// The training of both modes over one link. training.cpp is the translation unit that
// instantiates the pipeline; the link is type-erased, so that it is compiled once for every
// backend (in-process, MPI, ZeroMQ) and shaping (a virtual call per message costs nothing next
// to the exchange).
#pragma once

#include "results.hpp"
#include "settings.hpp"

#include <stellatrain/transport/any_transport.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/shaping.hpp>

#include <memory>
#include <vector>

namespace fashion_mnist {

/// Runs the modes that s.modes names over this rank's `link` to every rank (every rank calls
/// it; the clusters of `topology` group the ranks); rank 0 appends one result per mode to
/// `results`. Counts the bytes that rank 0 sends and the bytes that leave each cluster.
/// `uplinks`: the clusters' shaped uplinks of this process, or null; --bandwidth-schedule
/// changes their rate.
void train(stellatrain::any_transport link, const stellatrain::cluster_topology& topology,
           const settings& s, const data& d,
           const std::shared_ptr<stellatrain::cluster_links>& uplinks,
           std::vector<mode_result>* results);

}  // namespace fashion_mnist
