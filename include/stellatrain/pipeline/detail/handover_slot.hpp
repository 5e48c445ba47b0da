// SPDX-License-Identifier: Apache-2.0
// One step's hand-overs of one bucket of a pipeline: the gradients (summed over micro-batches)
// or the selections handed over instead, and how many tensors are in. A bucket's steps
// alternate between two slots; a slot is free for step s + 2 once the exchange of step s has
// read it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/sparse.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace stellatrain::detail {

// The slot of `step`.
inline std::size_t slot_of(std::int64_t step) noexcept {
  return static_cast<std::size_t>(step % 2);
}

template <class Value, class Index>
struct handover_slot {
  aligned_buffer<float> grad;     // the bucket's tensors' gradients, concatenated
  std::int64_t pushes_step = -1;  // the step `pushes` counts for
  std::size_t pushes = 0;         // tensors handed over completely
  std::vector<char> preselected;  // per tensor: handed over as a selection
  std::vector<sparse_buffer<Value, Index>> selections;

  template <class Executor>
  void allocate(std::uint64_t elements, std::size_t tensors, Executor& ex) {
    grad = aligned_buffer<float>(elements, {.prefault = true}, ex);
    preselected.assign(tensors, 0);
    selections.resize(tensors);
  }

  // Micro-batch `micro` (of `micro_batches`) of the gradient of tensor `i`, at `offset`: the
  // first is copied, the others added, and the last scales the sum to the mean.
  void add_gradient(std::size_t i, std::uint64_t offset, std::span<const float> g,
                    std::uint32_t micro, std::uint32_t micro_batches) {
    float* dst = grad.data() + offset;
    if (micro == 0) {
      std::memcpy(dst, g.data(), g.size_bytes());
    } else {
      for (std::size_t j = 0; j < g.size(); ++j) dst[j] += g[j];
    }
    if (micro + 1 == micro_batches && micro_batches > 1) {
      const float scale = 1.0f / static_cast<float>(micro_batches);
      for (std::size_t j = 0; j < g.size(); ++j) dst[j] *= scale;
    }
    preselected[i] = 0;
  }

  // The selection of tensor `i` of `dense_size` elements, handed over instead of its gradient.
  void take_selection(std::size_t i, std::uint64_t dense_size,
                      sparse_view<const Value, const Index> s) {
    auto& buf = selections[i];
    buf.set_dense_size(dense_size);
    if (buf.capacity() < s.size()) buf.reserve(s.size(), {.prefault = true});
    buf.resize(s.size());
    std::copy(s.indices().begin(), s.indices().end(), buf.indices().begin());
    std::copy(s.values().begin(), s.values().end(), buf.values().begin());
    preselected[i] = 1;
  }

  // One more of the bucket's `tensors` is in for `step`; returns whether all of them are.
  bool count(std::int64_t step, std::size_t tensors) {
    if (pushes_step != step) {
      pushes_step = step;
      pushes = 0;
    }
    return ++pushes == tensors;
  }

  [[nodiscard]] bool complete(std::int64_t step, std::size_t tensors) const noexcept {
    return pushes_step == step && pushes == tensors;
  }

  void forget() noexcept {
    pushes = 0;
    pushes_step = -1;
  }
};

}  // namespace stellatrain::detail
