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
  double loss;          // mean training loss since the previous point
  double accuracy;      // test accuracy, 0..1
  std::uint64_t bytes;  // bytes rank 0 sent so far
  double density;       // density of the last step (1 for dense)
};

struct mode_result {
  std::string mode;
  std::vector<curve_point> curve;
  std::optional<double> time_to_target;  // seconds; empty if never reached
  std::optional<std::uint64_t> steps_to_target;
  double final_accuracy = 0;
  std::uint64_t steps = 0;
  std::uint64_t bytes = 0;
  double seconds = 0;
  /// Bytes that left each cluster over its uplink (to ranks of other clusters), the mean over
  /// the clusters, for the whole training.
  std::uint64_t wan_bytes_per_cluster = 0;
};

}  // namespace fashion_mnist
