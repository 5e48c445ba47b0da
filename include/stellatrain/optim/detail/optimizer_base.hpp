// SPDX-License-Identifier: Apache-2.0
// What the optimizers share: the tensor registry and the calls that only forward to it, to
// the step driver or to the state format.
#pragma once

#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/detail/step_driver.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>
#include <stellatrain/optim/optimizer_types.hpp>
#include <stellatrain/optim/state_format.hpp>

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <ostream>
#include <span>
#include <type_traits>
#include <utility>

namespace stellatrain::detail {

// Base of the optimizers (CRTP). `Derived` provides the static `name`, `options()` (with
// `step_mode` and `nonfinite`) and `with_rule(step, f)` for the step driver, and, privately
// (this base is its friend): `arrays_mask()`, the arrays each tensor keeps as the state
// format records them (registration allocates from it too), and `identity()`; and
// `restore(bytes)`, which loads a saved state through `detail::load_state` and takes over its
// hyper-parameters.
template <class Derived>
class optimizer_base {
 public:
  /// Registers a tensor: copies its initial parameters and allocates (and pre-faults) its
  /// state. Returns its index (0, 1, ...). Linear time; not concurrent with other calls.
  std::size_t add_tensor(std::span<const float> initial_params) {
    inline_executor ex;
    return add_tensor(initial_params, ex);
  }
  template <executor Executor>
  std::size_t add_tensor(std::span<const float> initial_params, Executor& ex) {
    const auto [arrays, steps] = state_layout();
    return registry_.add(initial_params, arrays, steps, ex);
  }

  /// Registers a tensor whose parameters the caller holds: steps update `params` in place, so
  /// no master copy is kept and no copy crosses memory (a framework's own parameter tensor,
  /// for instance). `params` must stay valid while registered; `rebind_params` moves the
  /// tensor to another array of the same size. Checkpoints save and restore it like the
  /// optimizer's own. Returns the tensor's index.
  std::size_t add_tensor_in_place(std::span<float> params) {
    inline_executor ex;
    return add_tensor_in_place(params, ex);
  }
  template <executor Executor>
  std::size_t add_tensor_in_place(std::span<float> params, Executor& ex) {
    if (params.data() == nullptr && !params.empty()) {
      throw_error(errc::invalid_argument,
                  std::string(Derived::name) + "::add_tensor_in_place: null parameters");
    }
    const auto [arrays, steps] = state_layout();
    return registry_.add_held(params, arrays, steps, ex);
  }
  /// Points tensor `t`, registered with `add_tensor_in_place`, at `params` (same size; its
  /// current values are the parameters from now on). Not concurrent with a step of `t`.
  void rebind_params(std::size_t t, std::span<float> params) {
    tensor_state& s = registry_.at(t, Derived::name);
    auto fail = [&](errc code, const std::string& what) {
      throw_error(
          code, std::string(Derived::name) + "::rebind_params: tensor " + std::to_string(t) + what);
    };
    if (!s.caller_held) fail(errc::invalid_argument, " holds its own parameters");
    if (params.size() != s.size) {
      fail(errc::size_mismatch, " has " + std::to_string(s.size) + " elements, the new array " +
                                    std::to_string(params.size()));
    }
    if (params.data() == nullptr && !params.empty())
      fail(errc::invalid_argument, ": null parameters");
    s.params = params.data();
  }

  [[nodiscard]] std::size_t tensor_count() const noexcept { return registry_.tensor_count(); }
  [[nodiscard]] std::uint64_t tensor_size(std::size_t t) const { return tensor(t).size; }

  /// The fp32 parameters of tensor `t` (writable, e.g. to load weights): the master copy, or
  /// the caller's array for a tensor registered in place.
  [[nodiscard]] std::span<float> params(std::size_t t) {
    tensor_state& s = registry_.at(t, Derived::name);
    return {s.params, static_cast<std::size_t>(s.size)};
  }
  [[nodiscard]] std::span<const float> params(std::size_t t) const {
    const tensor_state& s = tensor(t);
    return {s.params, static_cast<std::size_t>(s.size)};
  }
  /// Steps applied to tensor `t` (skipped steps do not count).
  [[nodiscard]] std::uint64_t step_count_of(std::size_t t) const { return tensor(t).step; }
  /// Per-element step counts of tensor `t` (empty unless `step_count::per_element`).
  [[nodiscard]] std::span<const std::uint32_t> element_steps(std::size_t t) const {
    return tensor(t).element_steps.span();
  }

  /// Dense step: `grad` (float, fp16 or bf16) has one value per element of tensor `t`.
  /// Optionally writes the new parameters to `copy` (fp16 / bf16 / float, one per element) in
  /// the same pass. Errors (nothing changes): unknown tensor (`out_of_range`), sizes
  /// (`size_mismatch`), a non-finite gradient under `nonfinite_policy::raise` (`not_finite`).
  template <class Arch = xsimd::default_arch, class Grad, executor Executor, class Out = bf16>
  step_report step(std::size_t t, std::span<const Grad> grad, Executor& ex,
                   param_copy<Out> copy = {}) {
    return dense_step<Arch>(self(), registry_, t, grad, ex, copy);
  }
  template <class Arch = xsimd::default_arch, class Grad>
  step_report step(std::size_t t, std::span<const Grad> grad) {
    inline_executor ex;
    return step<Arch>(t, grad, ex);
  }

  /// Sparse step: updates only the elements at `grad`'s indices (sorted non-decreasing; equal
  /// indices summed). `grad.dense_size()` must be the tensor's size. Optionally writes the new
  /// values of the touched parameters to `copy` (compact: position j for `indices[j]`; or a
  /// dense mirror). Errors (nothing changes): those of the dense step, an index out of range
  /// (`out_of_range`) or out of order (`invalid_argument`). Time: O(nnz), latency-bound (one
  /// random cache line per touched element and array, prefetched ahead), split across the
  /// executor.
  template <class Arch = xsimd::default_arch, class Value, class Index, executor Executor,
            class Out = bf16>
  step_report step(std::size_t t, const sparse_view<Value, Index>& grad, Executor& ex,
                   param_copy<Out> copy = {}) {
    const sparse_view<const std::remove_const_t<Value>, const std::remove_const_t<Index>> g = grad;
    return sparse_step<Arch>(self(), registry_, t, g, ex, copy);
  }
  template <class Arch = xsimd::default_arch, class Value, class Index>
  step_report step(std::size_t t, const sparse_view<Value, Index>& grad) {
    inline_executor ex;
    return step<Arch>(t, grad, ex);
  }

  /// Bytes that `save_state` writes (format: optim/state_format.hpp).
  [[nodiscard]] std::uint64_t state_size_bytes() const { return saved_state_size(records()); }
  /// Saves parameters, state arrays, step counts and hyper-parameters; returns the bytes
  /// written to `out` (which must hold `state_size_bytes()`). Not concurrent with steps.
  std::size_t save_state(std::span<std::byte> out) const {
    return save_state_into(out, detail::optimizer_state_kind, records());
  }
  void save_state(std::ostream& os) const {
    save_state_to(os, detail::optimizer_state_kind, records());
  }

  /// Restores a saved state into this optimizer, whose registered tensors (count and sizes)
  /// and algorithm options (listed in the optimizer's own comment) must match the saved ones;
  /// the saved hyper-parameters replace the current ones. Verifies every checksum first: a
  /// corrupted or mismatched state throws and changes nothing. Continuing from a restored
  /// state is bit-identical to not stopping.
  void load_state(std::span<const std::byte> bytes) { self().restore(bytes); }
  void load_state(std::istream& is) {
    const auto bytes = read_state_stream(is);
    load_state(std::span<const std::byte>(bytes));
  }

  // Used by the step driver.
  [[nodiscard]] nonfinite_policy nonfinite() const noexcept { return self().options().nonfinite; }
  [[nodiscard]] step_count step_mode() const noexcept { return self().options().step_mode; }

 protected:
  optimizer_base() = default;

  // State array `a` of tensor `t` (empty where the options keep no such array).
  [[nodiscard]] std::span<const float> state_array(std::size_t t, std::size_t a) const {
    return tensor(t).state[a].span();
  }

  tensor_registry registry_;

 private:
  // The state arrays a tensor keeps and whether it counts steps per element: the arrays its
  // checkpoint records (state_format.hpp: bit 0 params, bits 1-3 state arrays, bit 4
  // per-element steps).
  [[nodiscard]] std::pair<std::size_t, bool> state_layout() const {
    const std::uint32_t mask = self().arrays_mask();
    return {static_cast<std::size_t>(std::popcount(mask & 0xEu)), (mask & (1u << 4)) != 0};
  }
  // The saved state's records (optim/state_format.hpp).
  [[nodiscard]] auto records() const {
    return state_records(self().identity(), registry_, self().arrays_mask());
  }
  [[nodiscard]] const tensor_state& tensor(std::size_t t) const {
    return registry_.at(t, Derived::name);
  }
  [[nodiscard]] Derived& self() noexcept { return static_cast<Derived&>(*this); }
  [[nodiscard]] const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }
};

}  // namespace stellatrain::detail
