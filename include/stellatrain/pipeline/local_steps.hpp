// SPDX-License-Identifier: Apache-2.0
// Local steps (DiLoCo's outer loop): each rank trains its own replica for H inner steps, then
// the ranks exchange the pseudo-gradients through a pipeline, whose optimizer is the outer one.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pipeline/detail/pseudo_gradient.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>

namespace stellatrain {

/// Settings of `local_steps`. Every rank must use the same values (the weight excepted).
struct local_steps_options {
  /// H: inner steps per outer step, >= 1 (with the controller: the first outer step's).
  std::uint32_t inner_steps = 25;
  /// Bounds of H for the controller. With min_inner_steps < max_inner_steps, H is chosen
  /// after every outer step from the measured compute and exchange times (`inner_steps_for`);
  /// 0 for either: `inner_steps`, and with both equal H stays fixed.
  std::uint32_t min_inner_steps = 0;
  std::uint32_t max_inner_steps = 0;
  /// The share of the time the outer exchange may take, in (0, 1), for the controller.
  double exchange_share = 0.1;
  /// This rank's weight in the average of the pseudo-gradients, for a batch split across
  /// ranks of different speeds (`batch_weight`; the ranks' weights sum to 1). It needs a
  /// pipeline that sums (`pipeline_options::op` = `reduction::sum`). 0: every rank weighs the
  /// same, as the pipeline's op (`reduction::mean`) averages.
  double weight = 0;
};

/// The H at which an outer exchange of `exchange_seconds` takes the share `share` of the time
/// next to inner steps of `inner_step_seconds` each: the exchange waits for no inner step (the
/// outer step is synchronous), so its share is x / (H c + x), at most f from
/// H = ceil(x (1 - f) / (f c)); then clamped to [lo, hi]. `fallback` (clamped) when c is not
/// positive or a time is not finite.
[[nodiscard]] inline std::uint32_t inner_steps_for(double exchange_seconds,
                                                   double inner_step_seconds, double share,
                                                   std::uint32_t lo, std::uint32_t hi,
                                                   std::uint32_t fallback) noexcept {
  const auto clamp = [&](double h) {
    return static_cast<std::uint32_t>(
        std::clamp(h, static_cast<double>(lo), static_cast<double>(hi)));
  };
  if (!(inner_step_seconds > 0) || !std::isfinite(inner_step_seconds) || !(exchange_seconds >= 0) ||
      !std::isfinite(exchange_seconds)) {
    return clamp(fallback);
  }
  // Rounded up; a value a relative 1e-9 above an integer is that integer (rounding error).
  const double h = exchange_seconds * (1 - share) / (share * inner_step_seconds);
  return clamp(std::ceil(h * (1 - 1e-9)));
}

/// The outer loop of training with local steps (DiLoCo, arXiv 2311.08105; SparseLoCo, arXiv
/// 2508.15706), over a started `pipeline` (the type `Pipeline`) that holds the outer
/// parameters:
///
///   every rank: H inner steps of the application's own optimizer on its replica
///   pseudo-gradient = outer parameters - replica            (per tensor, on this rank)
///   -> the pipeline's exchange strategy: the compressor with its error feedback, the flat or
///      hierarchical exchange, the mean (or the weighted sum) of the ranks' selections
///   -> the pipeline's optimizer, the outer optimizer, steps the outer parameters
///   replica = outer parameters                              (the same bits on every rank)
///
/// The outer optimizer is whatever the pipeline was built with: DiLoCo's is SGD with Nesterov
/// momentum, `sgd_optimizer({.lr = 0.7f, .momentum = 0.9f, .nesterov = true})`; SparseLoCo's is
/// plain SGD, the error feedback being the only memory. A sparse optimizer step is lazy
/// (elements outside the merged selection keep their momentum); `pipeline_options::
/// dense_threshold` = 0 makes every merged update dense, so that momentum decays everywhere
/// as in DiLoCo. With H = 1, an inner SGD of rate lr and a plain outer SGD of rate 1 this is
/// the per-step exchange with SGD of rate lr, up to rounding (tested).
///
/// Use, on every rank, after `outer.start()` (which made every rank's outer parameters rank
/// 0's): copy the outer parameters into the replica (`outer.copy_params`), then after each
/// inner optimizer step call `step(replica)`; on every H-th it runs the outer step and
/// returns true. `replica[t]` is tensor t's parameters (`outer.tensor_size(t)` floats) on
/// this rank. Example (tests/pipeline/test_local_steps.cpp):
/// \code
///   stellatrain::pipeline outer(transport, pool, compressor,
///       stellatrain::sgd_optimizer({.lr = 0.7f, .momentum = 0.9f, .nesterov = true}),
///       {.staleness = 0, .dense_threshold = 0});
///   // outer.add_tensor(...) for every tensor, then:
///   outer.start();
///   stellatrain::local_steps loop(outer, {.inner_steps = 25});
///   // replica: std::vector<std::span<float>>, one span per tensor
///   for (std::size_t t = 0; t < outer.tensor_count(); ++t) outer.copy_params(t, replica[t]);
///   for (;;) {
///     train_one_step(replica);   // forward, backward, the inner optimizer
///     loop.step(replica);        // every 25th: the outer step
///   }
/// \endcode
///
/// The controller (`min_inner_steps` < `max_inner_steps`): after each outer step, the
/// pipeline's last observation (every rank's reports of the outer step before, combined: the
/// same on every rank, see `pipeline`) gives the compute time of that outer step's inner steps
/// and its exchange time; H becomes `inner_steps_for` of the exchange time and the compute time
/// per inner step. Every rank computes the same H for the same outer step, and a changed link
/// moves H two outer steps later (its reports travel with the next outer step's messages).
///
/// Checkpoints: the pipeline's checkpoint taken right after an outer step (`step` returned
/// true) holds the outer parameters, the outer optimizer and the compressor's feedback, and
/// the replica equals the outer parameters then; a run restored from it continues
/// bit-identically (tested). A failure of the outer exchange on any rank makes `step` or
/// `sync` throw on every rank (the pipeline's errors) and leaves the replica as it was.
///
/// Errors: `errc::invalid_argument` for H = 0, bounds that do not hold H, a share outside
/// (0, 1), a weight that is not in (0, 1] or set with a pipeline that averages, a pipeline that
/// is not started or accumulates micro-batches, and a replica of the wrong shape (nothing is
/// handed over then); failures of the exchange are the pipeline's (every rank fails, see
/// `pipeline`). Not thread-safe: one thread drives it.
template <class Pipeline>
class local_steps {
 public:
  local_steps(Pipeline& outer, local_steps_options options) : outer_(&outer), options_(options) {
    auto bad = [](const std::string& what) {
      throw_error(errc::invalid_argument, "local_steps: " + what);
    };
    if (options_.inner_steps == 0) bad("inner_steps must be at least 1");
    if (options_.min_inner_steps == 0) options_.min_inner_steps = options_.inner_steps;
    if (options_.max_inner_steps == 0) options_.max_inner_steps = options_.inner_steps;
    if (options_.min_inner_steps > options_.max_inner_steps ||
        options_.inner_steps < options_.min_inner_steps ||
        options_.inner_steps > options_.max_inner_steps) {
      bad("inner_steps " + std::to_string(options_.inner_steps) + " outside the bounds [" +
          std::to_string(options_.min_inner_steps) + ", " +
          std::to_string(options_.max_inner_steps) + "]");
    }
    if (!(options_.exchange_share > 0 && options_.exchange_share < 1))
      bad("exchange_share must be in (0, 1), got " + std::to_string(options_.exchange_share));
    h_ = options_.inner_steps;
    if (options_.weight != 0) {
      if (!(std::isfinite(options_.weight) && options_.weight > 0 && options_.weight <= 1))
        bad("weight must be in (0, 1], got " + std::to_string(options_.weight));
      if (outer.options().op != reduction::sum)
        bad("a weight needs a pipeline that sums the pseudo-gradients (reduction::sum)");
    }
    if (outer.options().micro_batches != 1)
      bad("the outer pipeline must take one hand-over per step (micro_batches 1)");
    if (outer.tensor_count() == 0 || outer.bucket_count() == 0)
      bad("start the outer pipeline first");
  }

  [[nodiscard]] const local_steps_options& options() const noexcept { return options_; }
  /// H of the outer step in progress (the controller's choice, or the fixed one).
  [[nodiscard]] std::uint32_t inner_steps() const noexcept { return h_; }
  /// Inner steps since the last outer step.
  [[nodiscard]] std::uint32_t inner_steps_done() const noexcept { return inner_; }
  /// Outer steps run so far.
  [[nodiscard]] std::int64_t outer_steps() const noexcept { return outer_steps_; }

  /// Counts one inner step of `replica`; on the H-th runs `sync(replica)` and returns true.
  bool step(std::span<const std::span<float>> replica) {
    check(replica);
    if (++inner_ < h_) return false;
    outer_step(replica);
    return true;
  }

  /// The outer step now, whatever the count (collective: every rank calls it at the same
  /// point): hands every tensor's pseudo-gradient to the pipeline, waits until the outer
  /// optimizer applied it, and writes the new outer parameters into `replica`.
  void sync(std::span<const std::span<float>> replica) {
    check(replica);
    outer_step(replica);
  }

 private:
  void outer_step(std::span<const std::span<float>> replica) {
    ran_[outer_->steps_pushed()] = std::max<std::uint32_t>(inner_, 1);
    detail::hand_over_pseudo_gradients(*outer_, replica, static_cast<float>(options_.weight));
    outer_->flush();
    for (std::size_t t = 0; t < outer_->tensor_count(); ++t) outer_->copy_params(t, replica[t]);
    inner_ = 0;
    ++outer_steps_;
    if (options_.min_inner_steps < options_.max_inner_steps) choose_h();
  }

  // H from the last observed outer step, if it is new and this loop ran it.
  void choose_h() {
    const pipeline_observation o = outer_->last_measurement();
    if (o.steps == 0 || o.steps == observed_) return;
    observed_ = o.steps;
    const auto step = static_cast<std::int64_t>(o.steps) - 1;
    const auto it = ran_.find(step);
    if (it == ran_.end()) return;
    const double per_inner = o.measurement.compute_seconds / it->second;
    h_ = inner_steps_for(o.measurement.comm_seconds, per_inner, options_.exchange_share,
                         options_.min_inner_steps, options_.max_inner_steps, h_);
    ran_.erase(ran_.begin(), it);
  }

  void check(std::span<const std::span<float>> replica) const {
    if (replica.size() != outer_->tensor_count()) {
      throw_error(errc::invalid_argument,
                  "local_steps: the replica has " + std::to_string(replica.size()) +
                      " tensors, the pipeline " + std::to_string(outer_->tensor_count()));
    }
    for (std::size_t t = 0; t < replica.size(); ++t) {
      if (replica[t].size() != outer_->tensor_size(t)) {
        throw_error(errc::invalid_argument,
                    "local_steps: tensor " + std::to_string(t) + " of the replica has " +
                        std::to_string(replica[t].size()) + " elements, the pipeline's " +
                        std::to_string(outer_->tensor_size(t)));
      }
    }
  }

  Pipeline* outer_;
  local_steps_options options_;
  std::uint32_t inner_ = 0;
  std::uint32_t h_ = 1;
  std::int64_t outer_steps_ = 0;
  std::map<std::int64_t, std::uint32_t> ran_;  // inner steps run before each pipeline step
  std::uint64_t observed_ = 0;                 // observations taken into account
};

}  // namespace stellatrain
