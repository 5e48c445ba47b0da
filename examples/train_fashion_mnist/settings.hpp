// SPDX-License-Identifier: Apache-2.0
// The trainer's options and its data, shared by its translation units.
#pragma once

#include "dataset.hpp"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fashion_mnist {

/// What the command line asked for (options.hpp parses and checks it; every field is in range).
struct settings {
  int ranks = 4;              // in-process only; MPI/ZeroMQ take the world size
  std::string clusters;       // cluster sizes ("2,2"); empty: see --clusters
  double bandwidth_mbps = 0;  // each cluster's uplink; 0: unshaped
  double lan_mbps = 0;        // each rank's link inside its cluster; 0: unshaped
  double rtt_ms = 0;          // between clusters
  double min_density = 1e-4;
  double max_density = 0.01;
  double epochs = 0.5;
  double target = 0.82;
  std::string transport = "inprocess";
  // The sparse all-gather of the stellatrain modes: automatic (direct in process, where every
  // link carries its copies at the link rate whatever the order; else a ring for more than 2
  // ranks), direct or ring.
  std::string allgather = "automatic";
  std::string out = "out/demo";
  std::vector<std::string> modes;  // of mode_names, in this order
  int batch = 32;                  // per rank: the global batch is batch * ranks
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
  int local_steps = 8;          // H of the stellatrain-local mode
  int local_topk = 64;          // stellatrain-local: elements sent of every 4096
  int local_bits = 2;           // stellatrain-local: bits per value sent, 1 or 2
  int diloco_steps = 32;        // H of the diloco mode
  bool stop_at_target = false;  // a mode ends at its first evaluation at the target
  std::string split = "equal";  // equal | holistic: how the global batch goes to the ranks
  int split_interval = 10;      // steps between the ranks' exchanges of compute times
  std::vector<std::pair<int, double>> slow_ranks;  // (rank, factor): compute emulated slower
  double device_rate = 0;  // examples/s of each rank's emulated device (0: the CPU's own pace)
  std::string bandwidth_schedule;         // "T:R,..." (seconds since the mode's start : Mbit/s)
  std::vector<std::string> command_line;  // as given, for summary.json

  /// Whether the library shapes the links (else the network decides).
  [[nodiscard]] bool shaped() const { return bandwidth_mbps > 0 || rtt_ms > 0 || lan_mbps > 0; }
};

/// The modes, in the order they run: dense, each flat (every rank exchanges with every rank)
/// and hierarchical (reduced inside each cluster, exchanged between them); DiLoCo, the
/// published local-steps method; stellatrain flat and hierarchical; stellatrain with local
/// steps (flat).
inline const std::vector<std::string> mode_names{
    "dense", "dense-hier", "diloco", "stellatrain", "stellatrain-hier", "stellatrain-local"};

struct data {
  dataset train;
  dataset test;
};

}  // namespace fashion_mnist
