// SPDX-License-Identifier: Apache-2.0
// The update record of a pipeline that keeps its updates (`record_updates<T>`): per tensor,
// the elements its last two applied steps changed and their new values, and the merge that
// answers `pipeline::copy_changes` from them.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pipeline/param_changes.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace stellatrain::detail {

// One applied update of a tensor.
template <class Index, class T>
struct update_log {
  std::int64_t step = param_version::nothing;
  bool whole = true;           // it may have changed every element
  std::vector<Index> indices;  // else: the elements it changed, sorted
  std::vector<T> values;       // their new values
};

// The last two applied updates of one tensor, by step mod 2.
template <class Index, class T>
class update_history {
 public:
  // The log that the update of `step` fills; it counts as unknown until `finish`.
  update_log<Index, T>& begin(std::int64_t step) {
    update_log<Index, T>& log = logs_[slot(step)];
    log.step = param_version::nothing;
    return log;
  }

  void finish(std::int64_t step, bool whole) {
    update_log<Index, T>& log = logs_[slot(step)];
    log.whole = whole;
    log.step = step;
  }

  // Forgets both updates (a restore starts a new history).
  void forget() noexcept {
    for (auto& log : logs_) log.step = param_version::nothing;
  }

  // The changes that bring a copy of version `held` to `now` (see `pipeline::copy_changes`):
  // the last update's pairs, or the union of the last two (the later value where both changed
  // an element). O(changes).
  param_changes changes_since(param_version held, param_version now, std::span<Index> indices,
                              std::span<T> values) const {
    if (held == now) return {.kind = param_changes_kind::none, .count = 0, .version = now};
    param_changes whole{.kind = param_changes_kind::whole, .count = 0, .version = now};
    if (held.generation != now.generation || held.step < -1 || held.step >= now.step ||
        now.step - held.step > 2) {
      return whole;
    }
    const update_log<Index, T>& last = logs_[slot(now.step)];
    if (last.step != now.step || last.whole) return whole;
    if (now.step - held.step == 1) {
      whole.count = last.indices.size();
      if (last.indices.size() > indices.size() || last.indices.size() > values.size()) return whole;
      std::ranges::copy(last.indices, indices.begin());
      std::ranges::copy(last.values, values.begin());
      return {.kind = param_changes_kind::sparse, .count = last.indices.size(), .version = now};
    }
    const update_log<Index, T>& before = logs_[slot(now.step - 1)];
    if (before.step != now.step - 1 || before.whole) return whole;
    const std::size_t na = before.indices.size(), nb = last.indices.size();
    const std::size_t room = std::min(indices.size(), values.size());
    std::size_t i = 0, j = 0, n = 0;
    while (i < na || j < nb) {
      const bool take_last = j < nb && (i == na || last.indices[j] <= before.indices[i]);
      if (n < room) {
        indices[n] = take_last ? last.indices[j] : before.indices[i];
        values[n] = take_last ? last.values[j] : before.values[i];
      }
      ++n;
      if (take_last) {
        if (i < na && before.indices[i] == last.indices[j]) ++i;
        ++j;
      } else {
        ++i;
      }
    }
    if (n > room) {
      whole.count = n;
      return whole;
    }
    return {.kind = param_changes_kind::sparse, .count = n, .version = now};
  }

 private:
  static std::size_t slot(std::int64_t step) noexcept { return static_cast<std::size_t>(step % 2); }

  update_log<Index, T> logs_[2];
};

}  // namespace stellatrain::detail
