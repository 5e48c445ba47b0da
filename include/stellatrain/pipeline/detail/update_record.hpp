// SPDX-License-Identifier: Apache-2.0
// The update record of a pipeline that keeps its updates (`record_updates<T>`): per tensor,
// the elements its last two applied steps changed and their new values, the optimizer step
// that records them, and the merge that answers `pipeline::copy_changes` from them.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/optimizer_types.hpp>
#include <stellatrain/pipeline/update_record.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace stellatrain::detail {

// One applied update of a tensor.
template <class Index, class T>
struct recorded_update {
  std::int64_t step = param_version::nothing;
  bool whole = true;           // it may have changed every element
  std::vector<Index> indices;  // else: the elements it changed, sorted
  std::vector<T> values;       // their new values
};

// The last two applied updates of one tensor, by step mod 2.
template <class Index, class T>
class update_record {
 public:
  // The log that the update of `step` fills; it counts as unknown until `finish`.
  recorded_update<Index, T>& begin(std::int64_t step) {
    recorded_update<Index, T>& log = logs_[slot(step)];
    log.step = param_version::nothing;
    return log;
  }

  void finish(std::int64_t step, bool whole) {
    recorded_update<Index, T>& log = logs_[slot(step)];
    log.whole = whole;
    log.step = step;
  }

  // The sparse optimizer step `g` of the optimizer's tensor `index` at `step`, recorded: the
  // new values come from the optimizer's own pass where it writes an upload copy
  // (`param_copy`), else from its parameters after the step.
  template <class Optimizer, class Executor>
  void step(Optimizer& optimizer, std::size_t index, std::int64_t step,
            const sparse_view<const float, const Index>& g, Executor& ex) {
    auto& log = begin(step);
    log.indices.assign(g.indices().begin(), g.indices().end());
    std::vector<T>& values = log.values;
    values.resize(g.size());
    if constexpr (requires { optimizer.step(index, g, ex, param_copy<T>{}); }) {
      optimizer.step(index, g, ex, param_copy<T>{.values = std::span<T>(values)});
    } else {
      optimizer.step(index, g, ex);
      const auto p = std::as_const(optimizer).params(index);
      for (std::size_t j = 0; j < values.size(); ++j)
        values[j] = from_float<T>(p[static_cast<std::size_t>(log.indices[j])]);
    }
    finish(step, /*whole=*/false);
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
    const recorded_update<Index, T>& last = logs_[slot(now.step)];
    if (last.step != now.step || last.whole) return whole;
    if (now.step - held.step == 1) {
      whole.count = last.indices.size();
      if (last.indices.size() > indices.size() || last.indices.size() > values.size()) return whole;
      std::ranges::copy(last.indices, indices.begin());
      std::ranges::copy(last.values, values.begin());
      return {.kind = param_changes_kind::sparse, .count = last.indices.size(), .version = now};
    }
    const recorded_update<Index, T>& before = logs_[slot(now.step - 1)];
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

  recorded_update<Index, T> logs_[2];
};

}  // namespace stellatrain::detail
