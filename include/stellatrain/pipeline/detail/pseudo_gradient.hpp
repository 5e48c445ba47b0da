// SPDX-License-Identifier: Apache-2.0
// The hand-over of local steps: each tensor's pseudo-gradient (outer parameters - replica),
// formed in the pipeline's own gradient buffer, for `local_steps` and `streaming_local_steps`.
#pragma once

#include <stellatrain/config.hpp>

#include <cstddef>
#include <span>

namespace stellatrain::detail {

// Hands every tensor t of `p` (a started pipeline, no step in flight for its buffers) its
// pseudo-gradient outer_t - replica[t], times `weight` unless it is 0, in backward order (as
// gradients come: a bucket goes as soon as it is whole).
template <class Pipeline>
void hand_over_pseudo_gradients(Pipeline& p, std::span<const std::span<float>> replica,
                                float weight) {
  for (std::size_t t = p.tensor_count(); t-- > 0;) {
    const std::span<float> g = p.gradient_buffer(t);
    p.copy_params(t, g);
    const std::span<const float> mine = replica[t];
    if (weight == 0) {
      for (std::size_t i = 0; i < g.size(); ++i) g[i] -= mine[i];
    } else {
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = (g[i] - mine[i]) * weight;
    }
    p.push_gradient_buffer(t);
  }
}

}  // namespace stellatrain::detail
