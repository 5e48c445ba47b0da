// SPDX-License-Identifier: Apache-2.0
// The batch split that every rank applies from the same step on: each rank measures its own
// compute time, every few steps the ranks all-gather these measurements, and each rank fits
// the same models to the same samples and so computes the same split (batch_split.hpp).
#pragma once

#include <stellatrain/batch/batch_split.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// Settings of `batch_split_agreement`.
struct batch_split_options {
  std::uint64_t global_batch = 0;  ///< B: the examples of one step, all ranks together
  batch_bounds bounds{};           ///< each rank's batch stays within these
  /// Steps between decisions: every `interval` steps the ranks all-gather the samples of the
  /// steps since the last decision (one collective, one round of latency).
  std::uint64_t interval = 10;
  /// The first decision comes after min(first_decision, interval) steps, the later ones
  /// `interval` steps apart: three samples per rank already fit a model (their median
  /// resists one slow first step), and every step before the first decision runs at the
  /// equal split. 0: the first after `interval` steps too.
  std::uint64_t first_decision = 3;
  /// Samples of each rank that the fit uses (the newest); older ones are dropped, so the
  /// models follow a rank whose speed changes.
  std::size_t window = 32;
  /// A new split is taken only if its predicted slowest compute is at least this share below
  /// the current split's (under the same models): noise does not move the batches around.
  double min_gain = 0.02;
  /// false: gather and fit as usual but keep the first (equal) split, for comparisons
  /// with the same telemetry.
  bool adapt = true;
  tag_type tag = 64;                          ///< tag of the all-gather
  std::chrono::milliseconds timeout{60'000};  ///< bound on each all-gather
  allgather_algorithm algorithm = allgather_algorithm::direct;
};

/// The split of `global_batch` into `ranks` batches as equal as integers allow (the first
/// `global_batch % ranks` ranks take one example more).
[[nodiscard]] inline std::vector<std::uint64_t> equal_split(std::uint64_t global_batch,
                                                            std::size_t ranks) {
  if (ranks == 0) throw error(errc::invalid_argument, "equal_split: no ranks");
  std::vector<std::uint64_t> split(ranks, global_batch / ranks);
  for (std::size_t i = 0; i < global_batch % ranks; ++i) ++split[i];
  return split;
}

/// The factor by which rank `rank` scales its gradient (the mean over its own b_i examples)
/// before an exchange that averages over the ranks, so that the average is the mean over all
/// B examples of the step: b_i * P / B. With equal batches it is 1.
///
/// Dense exchange: exactly the gradient of the global batch. Sparse exchange with error
/// feedback: the compressor sees the scaled gradient, so each rank's residual holds its
/// share of the global-batch gradient that was not sent yet; what the ranks send in a step
/// sums (after the averaging) to the global-batch gradient of the selected elements plus the
/// residual they release. A split change rescales the shares of later steps only: residuals
/// keep the scale of the steps they came from.
[[nodiscard]] inline double batch_weight(std::span<const std::uint64_t> split, std::size_t rank) {
  if (rank >= split.size()) {
    throw error(errc::invalid_argument, "batch_weight: rank " + std::to_string(rank) + " of " +
                                            std::to_string(split.size()));
  }
  long double total = 0;
  for (auto b : split) total += static_cast<long double>(b);
  if (total <= 0) throw error(errc::invalid_argument, "batch_weight: an empty global batch");
  return static_cast<double>(static_cast<long double>(split[rank]) *
                             static_cast<long double>(split.size()) / total);
}

/// Keeps every rank's batch in a split that all ranks agree on, and adapts it to the ranks'
/// measured speeds (the batch half of the StellaTrain paper's holistic configuration).
///
/// Use: each rank computes the batch `my_batch()` of step s, then calls `end_step(seconds)`
/// with the compute time it measured for it (forward + backward, without waiting for the
/// exchange). In a decision step (the `first_decision`-th, then every `interval`-th after it)
/// that call is a collective: all ranks must make it in the same steps (they do when they call it
/// once per step from the same first step). Its return says whether the split of the next step
/// differs; no split changes within a step.
///
/// Agreement: each rank contributes its samples to an all-gather; every rank then holds the
/// same samples, fits each rank's `compute_model` with `fit_compute_model` over its newest
/// `window` samples and runs `split_batch`: identical inputs and the same code give the same
/// split on every rank without a second round. (Ranks built with different compilers or
/// floating-point flags could round differently: build them from one build.)
///
/// Bad measurements: a time that is not finite and positive, or a sample of an empty batch, is
/// not sent (counted in `rejected_samples()`). While some rank has no sample at all (a rank
/// that reports no progress), the split stays as it is: no rank's batch is guessed.
template <transport Transport>
class batch_split_agreement {
 public:
  /// Starts from the equal split. Throws stellatrain::error(invalid_argument) for a global
  /// batch the bounds cannot meet (fewer than ranks * min_per_rank examples, more than ranks *
  /// max_per_rank), an interval or window of 0, or min_gain outside [0, 1).
  batch_split_agreement(Transport& t, batch_split_options options)
      : t_(t), options_(options), history_(static_cast<std::size_t>(t.size())) {
    const auto ranks = static_cast<std::size_t>(t.size());
    if (options_.interval == 0 || options_.window == 0 || !(options_.min_gain >= 0) ||
        options_.min_gain >= 1) {
      throw error(errc::invalid_argument,
                  "batch_split_agreement: need interval >= 1, window >= 1, 0 <= min_gain < 1");
    }
    if (options_.bounds.min_per_rank > options_.bounds.max_per_rank) {
      throw error(errc::invalid_argument,
                  "batch_split_agreement: min_per_rank exceeds max_per_rank");
    }
    split_ = equal_split(options_.global_batch, ranks);
    for (auto b : split_) {
      if (b < options_.bounds.min_per_rank || b > options_.bounds.max_per_rank) {
        // The equal split is the most balanced one: if it breaks the bounds, every split
        // does (or the batch is too small for one example per rank).
        throw error(errc::invalid_argument,
                    "batch_split_agreement: a global batch of " +
                        std::to_string(options_.global_batch) + " cannot go to " +
                        std::to_string(ranks) + " ranks with " +
                        std::to_string(options_.bounds.min_per_rank) + ".." +
                        std::to_string(options_.bounds.max_per_rank) + " examples each");
      }
    }
  }

  /// The batches of the current step, rank by rank (the same on every rank).
  [[nodiscard]] const std::vector<std::uint64_t>& split() const noexcept { return split_; }
  /// This rank's batch of the current step.
  [[nodiscard]] std::uint64_t my_batch() const noexcept {
    return split_[static_cast<std::size_t>(t_.rank())];
  }
  /// This rank's gradient weight for the current split (see `batch_weight`).
  [[nodiscard]] double my_weight() const {
    return batch_weight(split_, static_cast<std::size_t>(t_.rank()));
  }
  /// The models of the last decision (empty before the first one, or while a rank had no
  /// samples).
  [[nodiscard]] const std::vector<compute_model>& models() const noexcept { return models_; }
  /// Each rank's newest sample as of the last decision ({0, 0} for a rank without one).
  [[nodiscard]] std::vector<compute_sample> latest_samples() const {
    std::vector<compute_sample> out(history_.size());
    for (std::size_t r = 0; r < history_.size(); ++r)
      if (!history_[r].empty()) out[r] = history_[r].back();
    return out;
  }
  [[nodiscard]] std::uint64_t steps() const noexcept { return step_; }
  [[nodiscard]] std::uint64_t decisions() const noexcept { return decisions_; }
  [[nodiscard]] std::uint64_t changes() const noexcept { return changes_; }
  [[nodiscard]] std::uint64_t rejected_samples() const noexcept { return rejected_; }
  [[nodiscard]] const batch_split_options& options() const noexcept { return options_; }

  /// Ends this rank's step: `compute_seconds` is what computing `my_batch()` examples took.
  /// In a decision step a collective (see the class); returns whether the split changed.
  bool end_step(double compute_seconds) {
    const std::uint64_t batch = my_batch();
    if (batch > 0 && std::isfinite(compute_seconds) && compute_seconds > 0) {
      pending_.push_back({batch, compute_seconds});
      // Only the newest `window` samples can reach a fit.
      if (pending_.size() > options_.window) pending_.erase(pending_.begin());
    } else {
      ++rejected_;
    }
    ++step_;
    if (!is_decision_step(step_)) return false;
    exchange();
    return decide();
  }

  /// Whether the step that ends as the `steps`-th (counted from 1) is a decision step.
  [[nodiscard]] bool is_decision_step(std::uint64_t steps) const noexcept {
    const std::uint64_t first = options_.first_decision == 0
                                    ? options_.interval
                                    : std::min(options_.first_decision, options_.interval);
    return steps >= first && (steps - first) % options_.interval == 0;
  }

 private:
  // Wire form of a rank's samples, little-endian: a count, then (batch, seconds) pairs.
  static constexpr std::size_t sample_bytes = 16;

  void exchange() {
    std::vector<std::byte> mine(8 + pending_.size() * sample_bytes);
    detail::store_le<std::uint64_t>(mine.data(), pending_.size());
    std::byte* w = mine.data() + 8;
    for (const auto& s : pending_) {
      detail::store_le<std::uint64_t>(w, s.batch);
      detail::store_le<std::uint64_t>(w + 8, std::bit_cast<std::uint64_t>(s.seconds));
      w += sample_bytes;
    }
    pending_.clear();
    std::vector<message_buffer> got(static_cast<std::size_t>(t_.size()));
    sparse_allgather(
        t_, std::span<const std::byte>(mine), std::span<message_buffer>(got),
        {.tag = options_.tag, .timeout = options_.timeout, .algorithm = options_.algorithm});
    for (std::size_t r = 0; r < got.size(); ++r) {
      const auto bytes = got[r].span();
      if (bytes.size() < 8) {
        throw error(errc::malformed_message,
                    "batch_split_agreement: a short message from rank " + std::to_string(r));
      }
      const std::uint64_t n = detail::load_le<std::uint64_t>(bytes.data());
      if (n > (bytes.size() - 8) / sample_bytes || bytes.size() != 8 + n * sample_bytes) {
        throw error(errc::malformed_message, "batch_split_agreement: rank " + std::to_string(r) +
                                                 " sent a message of the wrong size");
      }
      for (const std::byte* p = bytes.data() + 8; p != bytes.data() + bytes.size();
           p += sample_bytes) {
        const compute_sample s{
            .batch = detail::load_le<std::uint64_t>(p),
            .seconds = std::bit_cast<double>(detail::load_le<std::uint64_t>(p + 8))};
        if (s.batch == 0 || !std::isfinite(s.seconds) || !(s.seconds > 0)) {
          throw error(errc::malformed_message, "batch_split_agreement: rank " + std::to_string(r) +
                                                   " sent an invalid sample");
        }
        auto& h = history_[r];
        h.push_back(s);
        if (h.size() > options_.window) h.pop_front();
      }
    }
  }

  bool decide() {
    ++decisions_;
    for (const auto& h : history_) {
      if (h.empty()) {
        models_.clear();
        return false;
      }
    }
    std::vector<compute_model> models;
    models.reserve(history_.size());
    for (const auto& h : history_) {
      const std::vector<compute_sample> samples(h.begin(), h.end());
      models.push_back(fit_compute_model(samples));
    }
    auto next = split_batch(options_.global_batch, models, options_.bounds);
    const bool take =
        options_.adapt && next != split_ &&
        slowest_seconds(models, next) <= slowest_seconds(models, split_) * (1 - options_.min_gain);
    models_ = std::move(models);
    if (!take) return false;
    split_ = std::move(next);
    ++changes_;
    return true;
  }

  Transport& t_;
  batch_split_options options_;
  std::vector<std::uint64_t> split_;
  std::vector<std::deque<compute_sample>> history_;
  std::vector<compute_sample> pending_;
  std::vector<compute_model> models_;
  std::uint64_t step_ = 0;
  std::uint64_t decisions_ = 0;
  std::uint64_t changes_ = 0;
  std::uint64_t rejected_ = 0;
};

}  // namespace stellatrain
