// SPDX-License-Identifier: Apache-2.0
// The vocabulary of keeping a copy of the pipeline's parameters up to date elsewhere (a GPU's
// parameters, a bf16 mirror): which updates a copy holds, and what changed since.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace stellatrain {

/// The tag that makes a `pipeline` keep each applied update in precision `T` (float, fp16 or
/// bf16), so that `pipeline::copy_changes` can bring a copy of the parameters up to date with
/// the changed elements only: pass `record_updates<T>` as the pipeline's last constructor
/// argument. The pipeline then keeps, per tensor and for its last two applied steps, the
/// indices the step changed and their new values in `T`, written in the optimizer's pass (the
/// upload copy; rounding to nearest even). A pipeline built without it keeps nothing and has
/// no `copy_changes`.
template <class T>
struct record_updates_t {
  using type = T;
};
template <class T>
requires std::is_same_v<T, float> || std::is_same_v<T, fp16> || std::is_same_v<T, bf16>
inline constexpr record_updates_t<T> record_updates{};

/// Which parameters a copy holds: every update through `step` (-1: the initial parameters after
/// `start`), in the pipeline's state after its `generation`-th `load_checkpoint` (a restore
/// starts a new history: a copy made before it must be replaced whole). A default-constructed
/// version holds nothing known. `pipeline::copy_params` returns the version it copied.
struct param_version {
  /// The step of a version that holds nothing known.
  static constexpr std::int64_t nothing = std::numeric_limits<std::int64_t>::min();

  std::int64_t step = nothing;
  std::uint64_t generation = 0;

  friend constexpr bool operator==(const param_version&, const param_version&) = default;
};

/// What `pipeline::copy_changes` did.
enum class param_changes_kind : std::uint8_t {
  /// The copy is current: nothing to apply.
  none = 0,
  /// `count` (index, value) pairs were written: setting those elements of the copy makes it
  /// hold `version`.
  sparse = 1,
  /// The changes are not available (the copy is too old, holds nothing known or comes from
  /// before a restore; an update was dense; the output spans are too small): copy the whole
  /// tensor with `pipeline::copy_params`.
  whole = 2,
};

/// The result of `pipeline::copy_changes`.
struct param_changes {
  param_changes_kind kind = param_changes_kind::whole;
  /// Pairs written (`sparse`), or pairs the change needs (`whole` because the spans were too
  /// small; 0 otherwise).
  std::uint64_t count = 0;
  /// The version the copy holds after applying the pairs (`none`, `sparse`); for `whole`, the
  /// version of the parameters now (the version `copy_params` returns is the one copied).
  param_version version{};
};

}  // namespace stellatrain
