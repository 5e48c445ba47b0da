// SPDX-License-Identifier: Apache-2.0
// Options of the GPU top-k selectors (select/topk_cuda.cuh, compress/error_feedback_cuda.cuh).
#pragma once

#include <stellatrain/config.hpp>

#include <cstdint>

namespace stellatrain {

/// Which implementation selects on the GPU.
enum class topk_backend : std::uint8_t {
  radix,            ///< stellatrain's radix select (always available)
  cub_device_topk,  ///< cub::DeviceTopK on composite keys (CCCL >= 3.4.3 and n <= 2^32 only)
};

/// Options of the GPU top-k selectors. The workspace size depends on them: pass the same
/// options to `topk_workspace_bytes` and to the selection.
struct topk_cuda_options {
  /// Candidate buffers hold this fraction of n (at least min(n, 65536)). When the bucket of
  /// tied elements after a radix pass fits, the next passes read the buffer instead of the
  /// tensor. Two buffers of 4 (n <= 2^32) or 8 bytes per entry.
  double candidate_fraction = 1.0 / 32;
  /// Buffer 0 also holds this many times k: the candidates of a threshold scan. 0 leaves no
  /// room beyond `candidate_fraction`, so threshold selection misses whenever more candidates
  /// turn up (still exact, at the cost of a full radix select).
  double threshold_candidate_factor = 2.0;
  /// Threshold selection: the first slack (next threshold = (1 - slack) x the k-th magnitude)
  /// and its bounds; it grows after a miss with too few candidates, shrinks after one with too
  /// many, and decays by 5% per hit.
  float threshold_initial_slack = 0.03f;
  float threshold_min_slack = 0.005f;
  float threshold_max_slack = 0.5f;
  /// Room for a sampled threshold estimate (`estimate_threshold_sampled`): the sample size
  /// (0: no room), how much wider than k/n the sampled quantile is, and the jitter seed.
  std::uint64_t sample_size = 65536;
  double sample_oversample = 1.25;
  std::uint64_t sample_seed = 0;
  /// The implementation of exact selection.
  topk_backend backend = topk_backend::radix;
};

}  // namespace stellatrain
