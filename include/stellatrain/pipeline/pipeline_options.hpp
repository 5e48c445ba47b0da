// SPDX-License-Identifier: Apache-2.0
// The settings of a `pipeline` and the totals it reports.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>

#include <chrono>
#include <cstdint>

namespace stellatrain {

/// Settings of a `pipeline`. Every rank must use the same values (except `timeout`).
struct pipeline_options {
  /// Target fp32 gradient bytes per bucket (see `plan_buckets`); 0: one bucket per tensor.
  std::uint64_t bucket_bytes = std::uint64_t{4} << 20;
  /// 0: the forward of step t+1 sees every update through step t. 1: it may start with the
  /// updates through step t-1 (step t's exchange and optimizer overlap the next compute).
  int staleness = 1;
  /// Gradient hand-overs per tensor and step; the pipeline averages them.
  std::uint32_t micro_batches = 1;
  /// How the ranks' selections combine: `reduction::mean` (data-parallel averaging) or sum.
  reduction op = reduction::mean;
  /// Index encoding on the wire (`automatic`: the smallest per section).
  index_encoding wire_indices = index_encoding::automatic;
  /// Every tensor sends at least this many elements per step (when it has them).
  std::uint64_t min_k = 1;
  /// Tensors of at most this many elements are sent whole every step (biases, norms).
  std::uint64_t send_all_below = 0;
  /// Threads that run exchanges; bucket b's exchanges run on thread b mod exchange_threads,
  /// so that the latency of one bucket's exchange overlaps the transfer of another's.
  int exchange_threads = 2;
  /// Algorithm of the sparse all-gather (a flat exchange's).
  allgather_algorithm algorithm = allgather_algorithm::automatic;
  /// Bound on every wait: a collective, a gate, a hand-over waiting for a free slot.
  std::chrono::milliseconds timeout{120'000};
  /// The pipeline's tags are [tag_base, tag_base + pipeline_tag_count) on every transport it
  /// uses (pipeline/detail/tags.hpp lays them out).
  tag_type tag_base = 4096;
  /// Aggregation scatters into a dense gradient from this many received pairs per element.
  double dense_threshold = 0.25;
};

/// Tags a pipeline uses from `pipeline_options::tag_base` on.
inline constexpr tag_type pipeline_tag_count = 16386;

/// Totals of a pipeline's work on this rank.
struct pipeline_stats {
  std::uint64_t steps_applied = 0;  ///< steps whose every bucket is applied
  std::uint64_t bytes_sent = 0;     ///< packed bytes this rank contributed (its own messages)
  std::uint64_t link_bytes = 0;  ///< bytes its link carried by the cost model (P - 1 per message)
  std::uint64_t elements_sent = 0;  ///< selected elements this rank sent
  /// CPU time of its stages (select, pack, exchange, unpack, aggregate, optimize)
  double stage_cpu_seconds = 0;
  double exchange_seconds = 0;   ///< wall time with an exchange in flight
  double gate_wait_seconds = 0;  ///< time the application waited in gates and hand-overs
  double last_density = 0;       ///< density of the last step selected
};

/// The last measurement a pipeline handed to its policy (all ranks' reports of one step,
/// combined), and how many steps it observed so far.
struct pipeline_observation {
  step_measurement measurement{};
  std::uint64_t steps = 0;
};

}  // namespace stellatrain
