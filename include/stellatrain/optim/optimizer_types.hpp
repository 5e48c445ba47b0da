// SPDX-License-Identifier: Apache-2.0
// Vocabulary shared by the CPU optimizers: how sparse steps count, what happens to non-finite
// gradients, what a step reports, and where an optional 16-bit copy of the parameters goes.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace stellatrain {

/// Which step number a sparse ("lazy") update uses for everything that depends on the step:
/// Adam's bias correction and SGD's first-step momentum rule.
///
/// - `per_tensor`: the tensor's own step count, advanced by every step call on the tensor
///   whether or not an element is touched (as `torch.optim.SparseAdam` does). An element
///   first touched at tensor step 10 is bias-corrected as if it had seen 10 steps; SGD's
///   "buffer = gradient" rule applies on the tensor's first step only, later first touches
///   fold into a zero buffer (`buf = (1 - dampening) * g`).
/// - `per_element`: each element counts the steps that touched it (a 32-bit counter per
///   element, saturating), so every element follows exactly the dense algorithm run over
///   the steps that touched it; SGD's rule applies at each element's first touch.
///
/// Dense steps touch every element, so both modes agree for purely dense training.
enum class step_count : std::uint8_t { per_tensor = 0, per_element = 1 };

/// What a step does with NaN or infinite gradient values. In every case the state of an
/// element is never overwritten with a value computed from a non-finite gradient.
///
/// - `skip_elements` (default): elements whose gradient is not finite are left untouched,
///   as if they were not in the update; the others are updated. Costs nothing extra (the
///   check is fused into the update pass). The step's report counts the skipped elements.
/// - `skip_tensor`: if any gradient value is not finite, nothing of the tensor changes (no
///   parameter, no state, no step count) and the report says `applied == false`. Costs one
///   extra read of the gradient before the update pass (all-or-nothing needs the check first).
/// - `raise`: like `skip_tensor`, but throws `stellatrain::error` (`errc::not_finite`) naming
///   the tensor and the first non-finite position.
enum class nonfinite_policy : std::uint8_t { skip_elements = 0, skip_tensor = 1, raise = 2 };

/// What one step call did.
struct step_report {
  /// False when the step was skipped as a whole (`nonfinite_policy::skip_tensor`).
  bool applied = true;
  /// Elements updated (for a sparse step: distinct indices updated).
  std::uint64_t updated = 0;
  /// Gradient values found NaN or infinite (for a sparse step: after summing duplicates).
  std::uint64_t nonfinite = 0;
};

/// Where a sparse step writes the copy of the updated parameters.
enum class copy_layout : std::uint8_t {
  /// One value per gradient entry, in the order of the sparse gradient (position j holds the
  /// new value of parameter `indices[j]`): what an upload of the touched values needs.
  compact = 0,
  /// A dense mirror of the whole tensor: only the touched positions are written.
  dense = 1,
};

/// An optional low-precision copy of the parameters that a step writes in the same pass as
/// the update (for the host-to-device upload). `Value` is `fp16`, `bf16` or `float`;
/// conversion rounds to nearest even. An empty `values` span means "no copy".
///
/// For a dense step `values` has one element per parameter (the layout is ignored); for a
/// sparse step it has `grad.size()` elements (`compact`) or the tensor's size (`dense`).
/// Elements skipped for a non-finite gradient still receive their (unchanged) value.
template <class Value>
struct param_copy {
  static_assert(value_type<Value>, "param_copy holds float, fp16 or bf16 values");
  std::span<Value> values{};
  copy_layout layout = copy_layout::compact;
};

/// The "no copy" argument of the step functions.
using no_param_copy = param_copy<bf16>;

}  // namespace stellatrain
