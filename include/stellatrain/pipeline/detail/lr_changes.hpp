// SPDX-License-Identifier: Apache-2.0
// The learning-rate changes a pipeline has been asked for and not yet put into effect: each
// belongs to the first step handed over after it, and the optimizer takes it once every bucket
// has applied the step before (pipeline::set_lr).
#pragma once

#include <stellatrain/config.hpp>

#include <cstdint>
#include <deque>
#include <optional>

namespace stellatrain::detail {

class lr_changes {
 public:
  // The learning rate of the steps from `step` on; returns false when it is the one asked for
  // last.
  bool request(std::int64_t step, float lr) {
    if (requested_ == lr) return false;
    requested_ = lr;
    if (!pending_.empty() && pending_.back().step == step) {
      pending_.back().lr = lr;
    } else {
      pending_.push_back({step, lr});
    }
    return true;
  }

  [[nodiscard]] bool empty() const noexcept { return pending_.empty(); }

  // Puts into effect, by `set(lr)`, the changes of the steps up to `step` whose previous step
  // `applied(step - 1)` says is applied everywhere; returns whether none of them is left
  // waiting (then `step` may be applied). `changed` is set when one was set.
  template <class Applied, class Set>
  bool take(std::int64_t step, Applied&& applied, Set&& set, bool* changed = nullptr) {
    while (!pending_.empty() && pending_.front().step <= step) {
      const change& c = pending_.front();
      if (!applied(c.step - 1)) return false;
      set(c.lr);
      pending_.pop_front();
      if (changed) *changed = true;
    }
    return true;
  }

  // Forgets every change (a checkpoint restores the learning rate).
  void clear() noexcept {
    pending_.clear();
    requested_.reset();
  }

 private:
  struct change {
    std::int64_t step;  // the first step at the new learning rate
    float lr;
  };
  std::deque<change> pending_;      // by step
  std::optional<float> requested_;  // the last learning rate asked for
};

}  // namespace stellatrain::detail
