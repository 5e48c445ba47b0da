// SPDX-License-Identifier: Apache-2.0
// What one mode's training produced on rank 0 (report.hpp writes it out).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fashion_mnist {

struct curve_point {
  double seconds;  // wall time since the mode started
  std::uint64_t step;
  double epoch;
  double loss;                       // mean training loss since the previous point
  double accuracy;                   // test accuracy, 0..1
  std::uint64_t bytes;               // bytes rank 0 sent so far
  double density;                    // density of the last step (1 for dense)
  double step_seconds;               // mean wall time per step since the previous point
  double bandwidth_mbps;             // the density controller's estimate (0: dense, or none yet)
  double link_mbps;                  // the uplinks' rate now (0: not shaped by the library)
  std::vector<std::uint64_t> split;  // each rank's batch in the last step
  std::vector<double> compute;       // each rank's newest compute time (s; 0: not known yet)
  std::uint64_t wan_bytes = 0;       // bytes that left each cluster so far, the clusters' mean
};

// One step as rank 0 saw it: every step has one, evaluated or not.
struct step_point {
  std::uint64_t step;
  double seconds;         // training time at the step's end
  double density;         // the step's density (1 for dense)
  double bandwidth_mbps;  // the controller's estimate then (0: dense, or none yet)
  double link_mbps;       // the uplinks' rate during the step (0: not shaped by the library)
  double latency_ms;      // the controller's one-way latency, given or fitted (0: dense, none yet)
};

struct mode_result {
  std::string mode;
  std::vector<curve_point> curve;
  std::vector<step_point> timeline;
  std::optional<double> time_to_target;  // seconds; empty if never reached
  std::optional<std::uint64_t> steps_to_target;
  double final_accuracy = 0;
  std::uint64_t steps = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  /// Bytes that left each cluster over its uplink (to ranks of other clusters), the mean over
  /// the clusters, for the whole training.
  std::uint64_t wan_bytes_per_cluster = 0;
  std::uint64_t split_changes = 0;  // times the batch split changed
  std::uint64_t parameters = 0;     // of the model
};

}  // namespace fashion_mnist
