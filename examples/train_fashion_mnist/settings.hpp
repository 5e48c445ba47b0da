// SPDX-License-Identifier: Apache-2.0
// The trainer's options and its data, shared by its translation units.
#pragma once

#include "dataset.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

namespace fashion_mnist {

struct settings {
  int ranks = 4;               // in-process only; MPI/ZeroMQ take the world size
  double bandwidth_mbps = -1;  // per rank link; -1: 100 in-process, unshaped otherwise
  double rtt_ms = -1;          // -1: 20 in-process, 0 otherwise
  double min_density = 1e-4;
  double max_density = 0.01;
  double epochs = 0.5;
  double target = 0.82;
  std::string transport = "inprocess";
  std::string out = "out/demo";
  std::string mode = "both";
  int batch = 32;  // per rank
  int hidden = 1024;
  float lr = 1e-3f;         // dense mode
  float sparse_lr = 3e-3f;  // stellatrain mode
  float lr_end = 1e-3f;     // both modes decay linearly to this rate...
  int decay_steps = 60;     // ...over these steps (0: constant rates)
  int eval_every = 5;       // steps
  std::size_t eval_samples = 2000;
  std::uint64_t seed = 1;
  std::string data = default_directory;
  int staleness = 0;
};

struct data {
  dataset train;
  dataset test;
};

}  // namespace fashion_mnist
