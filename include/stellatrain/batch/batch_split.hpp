// SPDX-License-Identifier: Apache-2.0
// Per-rank compute models fitted from measured (batch size, compute time) samples, and the split
// of a global batch across ranks of different speeds that these models make the fastest: the
// batch half of the StellaTrain paper's holistic configuration.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// One measurement: a rank computed `batch` examples (forward + backward) in `seconds`.
struct compute_sample {
  std::uint64_t batch = 0;
  double seconds = 0;
};

/// A rank's compute time as a function of its batch: t(b) = fixed_seconds + b * per_example.
///
/// The throughput b / t(b) rises with b and levels off at 1 / per_example, the shape of the
/// reference's min((beta/alpha) b, beta), without its kink.
struct compute_model {
  double fixed_seconds = 0;  ///< time that does not grow with the batch (launches, the optimizer)
  double per_example = 0;    ///< seconds per example, > 0

  [[nodiscard]] double seconds(std::uint64_t batch) const noexcept {
    return fixed_seconds + static_cast<double>(batch) * per_example;
  }
  [[nodiscard]] double examples_per_second(std::uint64_t batch) const noexcept {
    return batch == 0 ? 0.0 : static_cast<double>(batch) / seconds(batch);
  }
};

namespace detail {

inline double median_of(std::vector<double>& v) {
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 != 0) return *mid;
  return (*mid + *std::max_element(v.begin(), mid)) / 2;
}

inline void check_model(const compute_model& m, std::size_t rank) {
  if (!std::isfinite(m.fixed_seconds) || m.fixed_seconds < 0 || !std::isfinite(m.per_example) ||
      m.per_example <= 0) {
    throw error(errc::invalid_argument,
                "split_batch: the model of rank " + std::to_string(rank) +
                    " needs fixed_seconds >= 0 and per_example > 0, both finite");
  }
}

}  // namespace detail

/// Fits a compute_model to `samples` with the Theil-Sen estimator: the slope is the median of
/// the slopes between every two samples whose batch sizes differ by at least a quarter of the
/// larger (closer pairs measure the timing noise more than the slope: two batches of 32 and 36
/// examples differ by about as much as two runs of one batch do), the intercept the median of
/// t - slope * b. Up to about 29% of the samples can be arbitrary outliers (a step that waited
/// on the disk, a preempted thread) without moving the fit far. Fallbacks: without such a pair,
/// or with a slope that noise made <= 0, the model is proportional (fixed 0, per_example the
/// median of t / b); a negative intercept becomes 0. O(n^2) in the samples: keep a window.
///
/// Throws stellatrain::error(invalid_argument) for no samples, a batch of 0, or a time that is
/// not finite and positive.
[[nodiscard]] inline compute_model fit_compute_model(std::span<const compute_sample> samples) {
  if (samples.empty()) {
    throw error(errc::invalid_argument, "fit_compute_model: no samples");
  }
  std::vector<double> ratios;
  ratios.reserve(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    if (s.batch == 0 || !std::isfinite(s.seconds) || s.seconds <= 0) {
      throw error(errc::invalid_argument, "fit_compute_model: sample " + std::to_string(i) +
                                              " needs a batch > 0 and a finite time > 0 (batch " +
                                              std::to_string(s.batch) + ", " +
                                              std::to_string(s.seconds) + " s)");
    }
    ratios.push_back(s.seconds / static_cast<double>(s.batch));
  }
  std::vector<double> slopes;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    for (std::size_t j = i + 1; j < samples.size(); ++j) {
      const auto [small, large] = std::minmax(samples[i].batch, samples[j].batch);
      if (static_cast<double>(large - small) < 0.25 * static_cast<double>(large)) continue;
      slopes.push_back(
          (samples[j].seconds - samples[i].seconds) /
          (static_cast<double>(samples[j].batch) - static_cast<double>(samples[i].batch)));
    }
  }
  const double slope = slopes.empty() ? 0.0 : detail::median_of(slopes);
  if (!(slope > 0)) return {0.0, detail::median_of(ratios)};
  std::vector<double> intercepts;
  intercepts.reserve(samples.size());
  for (const auto& s : samples) {
    intercepts.push_back(s.seconds - slope * static_cast<double>(s.batch));
  }
  return {std::max(0.0, detail::median_of(intercepts)), slope};
}

/// The slowest rank's predicted compute time for `split` (rank i computes split[i] examples
/// with models[i]); split and models have one entry per rank.
[[nodiscard]] inline double slowest_seconds(std::span<const compute_model> models,
                                            std::span<const std::uint64_t> split) {
  if (models.size() != split.size()) {
    throw error(errc::invalid_argument, "slowest_seconds: " + std::to_string(models.size()) +
                                            " models for " + std::to_string(split.size()) +
                                            " ranks");
  }
  double t = 0;
  for (std::size_t i = 0; i < split.size(); ++i) t = std::max(t, models[i].seconds(split[i]));
  return t;
}

/// Bounds of each rank's batch in split_batch.
struct batch_bounds {
  std::uint64_t min_per_rank = 1;
  std::uint64_t max_per_rank = std::numeric_limits<std::uint64_t>::max();
};

/// Splits `global_batch` examples across the ranks of `models` so that the slowest rank's
/// compute time, max_i t_i(b_i), is as small as integer batches allow, with sum b_i =
/// global_batch and every b_i within `bounds`. Deterministic: every rank that calls it with
/// the same models gets the same split (where two ranks would finish at the same time, the
/// lower one gives up the example).
///
/// Throws stellatrain::error(invalid_argument) for no models, a model that is not finite with
/// per_example > 0 (a rank that reports no progress has no model: leave it out or give it
/// min_per_rank by a model of its own), min_per_rank > max_per_rank, or a global batch that
/// the bounds cannot meet (fewer than ranks * min_per_rank examples, or more than ranks *
/// max_per_rank).
[[nodiscard]] inline std::vector<std::uint64_t> split_batch(std::uint64_t global_batch,
                                                            std::span<const compute_model> models,
                                                            batch_bounds bounds = {}) {
  const std::size_t n = models.size();
  if (n == 0) throw error(errc::invalid_argument, "split_batch: no ranks");
  for (std::size_t i = 0; i < n; ++i) detail::check_model(models[i], i);
  if (bounds.min_per_rank > bounds.max_per_rank) {
    throw error(errc::invalid_argument, "split_batch: min_per_rank exceeds max_per_rank");
  }
  const auto ranks = static_cast<long double>(n);
  if (static_cast<long double>(global_batch) < ranks * bounds.min_per_rank ||
      static_cast<long double>(global_batch) > ranks * bounds.max_per_rank) {
    throw error(errc::invalid_argument, "split_batch: a global batch of " +
                                            std::to_string(global_batch) + " cannot go to " +
                                            std::to_string(n) + " ranks with " +
                                            std::to_string(bounds.min_per_rank) + ".." +
                                            std::to_string(bounds.max_per_rank) + " examples each");
  }
  // The examples rank i can take within time t, within its bounds.
  const auto capacity = [&](std::size_t i, double t) -> std::uint64_t {
    const double b = std::floor((t - models[i].fixed_seconds) / models[i].per_example);
    if (!(b >= static_cast<double>(bounds.min_per_rank))) return bounds.min_per_rank;
    if (b >= static_cast<double>(bounds.max_per_rank)) return bounds.max_per_rank;
    return static_cast<std::uint64_t>(b);
  };
  const auto total = [&](double t) {
    long double sum = 0;
    for (std::size_t i = 0; i < n; ++i) sum += capacity(i, t);
    return sum;
  };
  // Bisection for the least time at which the ranks can take the whole batch.
  double lo = 0;
  double hi = 0;
  for (std::size_t i = 0; i < n; ++i) hi = std::max(hi, models[i].seconds(global_batch));
  for (int iteration = 0; iteration < 200 && hi > lo; ++iteration) {
    const double mid = lo + (hi - lo) / 2;
    if (mid <= lo || mid >= hi) break;
    (total(mid) >= static_cast<long double>(global_batch) ? hi : lo) = mid;
  }
  std::vector<std::uint64_t> split(n);
  long double sum = 0;
  for (std::size_t i = 0; i < n; ++i) {
    split[i] = capacity(i, hi);
    sum += split[i];
  }
  // Hand back the excess one example at a time from the rank that would finish last; the
  // excess is at most a few examples per rank (those whose capacity steps at the same time).
  for (; sum > static_cast<long double>(global_batch); sum -= 1) {
    std::size_t last = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (split[i] > bounds.min_per_rank &&
          (last == n || models[i].seconds(split[i]) > models[last].seconds(split[last]))) {
        last = i;
      }
    }
    --split[last];
  }
  return split;
}

}  // namespace stellatrain
