// SPDX-License-Identifier: Apache-2.0
// The per-tensor state of threshold selection, carried from one step to the next.
#pragma once

#include <stellatrain/config.hpp>

#include <cstdint>
#include <type_traits>

namespace stellatrain {

/// What a threshold selector keeps per tensor between steps. The GPU selectors keep it in
/// device memory (one per tensor, caller-owned); copy it to the host to look at the statistics.
/// All-zero bytes are the initial state: the first selection runs exact and sets the threshold.
///
/// \code
///   stellatrain::topk_threshold_state* state;           // one per tensor
///   cudaMalloc(&state, sizeof *state);
///   cudaMemsetAsync(state, 0, sizeof *state, stream);   // or stellatrain::reset_threshold_state
/// \endcode
struct topk_threshold_state {
  std::uint32_t key;         ///< magnitude key of the threshold (0: none yet)
  float slack;               ///< next threshold = (1 - slack) x magnitude of the k-th element
  std::uint64_t calls;       ///< selections made with this state
  std::uint64_t misses;      ///< of which the threshold missed (too few or too many candidates)
  std::uint64_t candidates;  ///< candidates the last threshold scan found
};
static_assert(std::is_trivially_copyable_v<topk_threshold_state> &&
                  sizeof(topk_threshold_state) == 32,
              "topk_threshold_state is copied between host and device as 32 bytes");

}  // namespace stellatrain
