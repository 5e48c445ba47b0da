// SPDX-License-Identifier: Apache-2.0
// The training of both modes over one link. training.cpp is the translation unit that
// instantiates the pipeline; the link is type-erased, so that it is compiled once for every
// backend (in-process, MPI, ZeroMQ) and shaping (a virtual call per message costs nothing next
// to the exchange).
#pragma once

#include "results.hpp"
#include "settings.hpp"

#include <stellatrain/transport/any_transport.hpp>

#include <vector>

namespace fashion_mnist {

/// Runs the modes that s.mode names over this rank's `link` (every rank calls it); rank 0
/// appends one result per mode to `results`. Counts the bytes that rank 0 sends.
void train(stellatrain::any_transport link, const settings& s, const data& d,
           std::vector<mode_result>* results);

}  // namespace fashion_mnist
