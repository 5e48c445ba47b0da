// SPDX-License-Identifier: Apache-2.0
// The state the CPU optimizers keep per registered tensor (fp32 master parameters, up to three
// fp32 state arrays, optional per-element step counters) and the registry of those tensors.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::detail {

inline constexpr std::size_t max_state_arrays = 3;

// One tensor: every array is allocated (and zeroed, so its pages are faulted in) at
// registration and never reallocated, so steps never allocate. The parameters are the
// optimizer's own copy (`own_params`) or an array the caller holds and steps update in place.
struct tensor_state {
  aligned_buffer<float> own_params;  // empty when the caller holds the parameters
  float* params = nullptr;           // own_params.data() or the caller's array
  bool caller_held = false;          // registered in place
  std::array<aligned_buffer<float>, max_state_arrays> state;  // e.g. m, v, vmax
  aligned_buffer<std::uint32_t> element_steps;                // per_element step counts
  std::uint64_t step = 0;                                     // step calls applied
  std::uint64_t size = 0;
};

// Raw pointers of one tensor's arrays, handed to the kernels.
struct tensor_arrays {
  float* params = nullptr;
  float* s0 = nullptr;
  float* s1 = nullptr;
  float* s2 = nullptr;
  std::uint32_t* element_steps = nullptr;
};

inline tensor_arrays arrays_of(tensor_state& t) noexcept {
  return {t.params, t.state[0].data(), t.state[1].data(), t.state[2].data(),
          t.element_steps.data()};
}

// The registered tensors of one optimizer. Registration must not run concurrently with
// anything else on the optimizer; steps on different tensors may run concurrently.
class tensor_registry {
 public:
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }

  [[nodiscard]] tensor_state& at(std::size_t t, const char* who) {
    if (t >= tensors_.size()) [[unlikely]] {
      throw_error(errc::out_of_range, std::string(who) + ": tensor " + std::to_string(t) +
                                          " is not registered (" + std::to_string(tensors_.size()) +
                                          " tensors)");
    }
    return tensors_[t];
  }
  [[nodiscard]] const tensor_state& at(std::size_t t, const char* who) const {
    return const_cast<tensor_registry*>(this)->at(t, who);
  }

  // Where a tensor's arrays start: array a (0 the parameters, then the state arrays, then
  // the step counts) `(a + 1) * array_stagger` bytes past its aligned boundary. Allocated one
  // after another, same-sized arrays otherwise start a multiple of a large power of two apart
  // (at 100M elements, 384 MiB), so the i-th elements of all of them fall in the same memory
  // bank and the streams of a dense step evict one another's open rows: a dense Adam step
  // over 100M parameters took 1.4-1.8x as long (bench_optim, BM_optim_adam_array_offsets).
  static constexpr std::size_t array_stagger = 69 * cache_line_bytes;

  // Copies `initial` into parameters of the optimizer's own.
  template <executor Executor>
  std::size_t add(std::span<const float> initial, std::size_t state_arrays, bool element_steps,
                  Executor& ex) {
    tensor_state t;
    const std::size_t n = initial.size();
    t.own_params = aligned_buffer<float>(n, placed(0, false), ex);
    t.params = t.own_params.data();
    // Copying the initial values touches every page of the parameters.
    for_each_chunk(ex, n, balanced_grain(n, ex.concurrency(), std::uint64_t{1} << 18, 16),
                   [&](std::uint64_t b, std::uint64_t e) {
                     std::memcpy(t.params + b, initial.data() + b, (e - b) * sizeof(float));
                   });
    return push(std::move(t), n, state_arrays, element_steps, ex);
  }

  // Steps update the caller's `params` in place.
  template <executor Executor>
  std::size_t add_held(std::span<float> params, std::size_t state_arrays, bool element_steps,
                       Executor& ex) {
    tensor_state t;
    t.params = params.data();
    t.caller_held = true;
    return push(std::move(t), params.size(), state_arrays, element_steps, ex);
  }

  [[nodiscard]] std::vector<tensor_state>& tensors() noexcept { return tensors_; }
  [[nodiscard]] const std::vector<tensor_state>& tensors() const noexcept { return tensors_; }

 private:
  static buffer_options placed(std::size_t a, bool prefault) {
    return {.prefault = prefault, .offset = (a + 1) * array_stagger};
  }

  // Allocates the state arrays of `t` (n elements) and registers it.
  template <executor Executor>
  std::size_t push(tensor_state t, std::size_t n, std::size_t state_arrays, bool element_steps,
                   Executor& ex) {
    t.size = n;
    for (std::size_t a = 0; a < state_arrays; ++a)
      t.state[a] = aligned_buffer<float>(n, placed(a + 1, true), ex);
    if (element_steps)
      t.element_steps = aligned_buffer<std::uint32_t>(n, placed(max_state_arrays + 1, true), ex);
    tensors_.push_back(std::move(t));
    return tensors_.size() - 1;
  }

  std::vector<tensor_state> tensors_;
};

}  // namespace stellatrain::detail
