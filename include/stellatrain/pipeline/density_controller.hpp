// SPDX-License-Identifier: Apache-2.0
// Chooses the compression density (k/n) for each training step from measurements, so that the
// exchange of a step hides behind the compute of the next one: the "holistic configuration"
// of the StellaTrain paper, wired in.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/saved_state.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>

namespace stellatrain {

/// What one training step measured, as seen by one rank.
struct step_measurement {
  /// Compute time of the step (forward + backward), measured between gradient hand-overs or
  /// reported by the application.
  double compute_seconds = 0;
  /// Wall time the step's exchange took, from the first byte sent to the last byte received.
  double comm_seconds = 0;
  /// Bytes this rank's busiest link carried for the step.
  std::uint64_t link_bytes = 0;
  /// Throughput of the link while it was busy (bytes / busy seconds), as a metering transport
  /// measures it; 0 when unknown (then `link_bytes / comm_seconds` net of latency is used).
  double link_bytes_per_second = 0;
  /// Sequential rounds of latency the exchange actually went through (for example buckets
  /// whose exchanges did not overlap); 0: as the cost model says.
  double latency_rounds = 0;
};

/// The cost model: bytes and seconds of one step's exchange at density d.
///
/// Each rank sends a message of `header_bytes + elements * d * bytes_per_element` bytes (the
/// packed selection of all its tensors); a sparse all-gather over `ranks` ranks moves
/// `ranks - 1` such messages over every rank's link, in `latency_rounds` sequential rounds of
/// one-way latency (ranks - 1 for a ring, 1 for a direct exchange). So
///   link_bytes(d)   = (ranks - 1) * (header_bytes + elements * d * bytes_per_element)
///   comm_seconds(d) = link_bytes(d) / bandwidth + latency_rounds * latency.
struct exchange_cost_model {
  std::uint64_t elements = 0;  ///< gradient elements per step, all tensors
  std::uint32_t ranks = 1;
  double bytes_per_element = 8;  ///< wire bytes per selected element (index + value)
  double header_bytes = 0;       ///< fixed bytes per message (headers, checksums, framing)
  double latency_rounds = 0;     ///< sequential rounds of one-way latency per exchange

  [[nodiscard]] double link_bytes(double density) const noexcept {
    return static_cast<double>(ranks - 1) *
           (header_bytes + static_cast<double>(elements) * density * bytes_per_element);
  }
  [[nodiscard]] double comm_seconds(double density, double bandwidth,
                                    double latency) const noexcept {
    return link_bytes(density) / bandwidth + latency_rounds * latency;
  }
  /// The density whose exchange takes `seconds` (may fall outside [0, 1]).
  [[nodiscard]] double density_for(double seconds, double bandwidth,
                                   double latency) const noexcept {
    return density_for_transfer(seconds - latency_rounds * latency, bandwidth);
  }
  /// The density whose bytes take `transfer_seconds` on the link, latency aside.
  [[nodiscard]] double density_for_transfer(double transfer_seconds,
                                            double bandwidth) const noexcept {
    if (ranks <= 1 || elements == 0) return 1.0;
    const double bytes = transfer_seconds * bandwidth / static_cast<double>(ranks - 1);
    return (bytes - header_bytes) / (static_cast<double>(elements) * bytes_per_element);
  }
};

/// Settings of `adaptive_density_controller`.
struct density_controller_options {
  double min_density = 1e-4;      ///< never select fewer than this fraction
  double max_density = 0.1;       ///< never select more than this fraction
  double initial_density = 0.01;  ///< until the first measurement
  /// Aim for comm = target_ratio * compute: below 1 leaves slack for jitter.
  double target_ratio = 0.95;
  /// Weight of the newest sample in the moving averages of bandwidth, latency and compute (1:
  /// no smoothing).
  double smoothing = 0.5;
  /// Two samples in a row more than this factor away from their moving average (in the same
  /// direction) replace it: a changed link is followed after two steps; one such sample
  /// alone is taken for noise and ignored.
  double change_factor = 1.3;
  /// Leave the density alone while the new choice is within this relative distance of it: a
  /// dead band that keeps steady state from dithering.
  double dead_band = 0.05;
  /// The share of `target_ratio * compute` the transfer (the exchange net of its latency) may
  /// always take. The exchange fits into the compute when the latency leaves room; when the
  /// latency alone fills the compute (a short step on a long link), no density could hide,
  /// and without this floor the density would fall to `min_density` although the link is idle
  /// but for its delay. The step then takes at most latency + this share of the compute.
  double latency_bound_share = 0.5;
  /// One-way link latency in seconds if known (0: estimated from measurements that carry the
  /// link's throughput, else counted as transfer time).
  double latency_seconds = 0;
  /// While the exchange finishes below `probe_below * target` for `probe_after` steps in a
  /// row, the bandwidth estimate is raised by `probe_factor` (the estimate can only be
  /// measured up to what the traffic offers; probing finds out whether there is more).
  double probe_below = 0.5;
  int probe_after = 3;
  double probe_factor = 1.1;
};

/// A density policy: anything that answers `density()` for the next step and learns from each
/// step's `step_measurement`. The pipeline calls `density()` once per step and `observe()`
/// once the step's exchange finished. Users may supply their own model of it. A policy that
/// learns may also offer `cp.save(w)` and `p.load(r)` (fields of a `state_record_writer` /
/// `state_record_reader`, core/saved_state.hpp): the pipeline's checkpoints then hold its
/// state, and a policy with `load` must be copyable (a restore reads into a copy first).
///
/// Minimal conforming policy:
/// \code
///   struct fixed_density {
///     double d = 0.01;
///     double density() const noexcept { return d; }
///     void observe(const stellatrain::step_measurement&) {}
///   };
/// \endcode
template <class P>
concept density_policy = requires(P& p, const P& cp, const step_measurement& m) {
  { cp.density() }
  noexcept->std::convertible_to<double>;
  p.observe(m);
};

/// A fixed density, for baselines and tests.
struct fixed_density {
  double value = 0.01;
  [[nodiscard]] double density() const noexcept { return value; }
  void observe(const step_measurement&) noexcept {}
};

/// Picks the largest density whose predicted exchange time stays at `target_ratio` of the
/// compute time, within [min_density, max_density], from moving averages of the link
/// bandwidth and of the compute time (`exchange_cost_model` predicts the exchange time). When
/// the latency leaves less than `latency_bound_share` of that time for the transfer, the
/// transfer gets that share and the exchange ends after the compute (it cannot hide anyway).
///
/// Bandwidth is taken from `step_measurement::link_bytes_per_second` when given, else derived
/// as link_bytes / (comm_seconds - latency). Changes smaller than `dead_band` are ignored, so
/// a steady link gives a steady density; a bandwidth change moves the density within a few
/// steps (the smoothing sets how many).
class adaptive_density_controller {
 public:
  /// A controller whose model is set later with `set_model` (the pipeline does, once it knows
  /// the tensors and ranks).
  explicit adaptive_density_controller(density_controller_options options = {})
      : adaptive_density_controller(exchange_cost_model{}, options) {}

  adaptive_density_controller(exchange_cost_model model, density_controller_options options = {})
      : model_(model), options_(options), density_(clamp(options.initial_density)) {
    if (!(options_.min_density > 0) || options_.min_density > options_.max_density ||
        options_.max_density > 1 || !(options_.smoothing > 0) || options_.smoothing > 1 ||
        !(options_.target_ratio > 0) || !(options_.change_factor > 1) ||
        !(options_.latency_bound_share >= 0) || options_.latency_bound_share > 1) {
      throw_error(errc::invalid_argument,
                  "adaptive_density_controller: need 0 < min_density <= max_density <= 1, "
                  "0 < smoothing <= 1, target_ratio > 0, change_factor > 1 and "
                  "0 <= latency_bound_share <= 1");
    }
  }

  [[nodiscard]] double density() const noexcept { return density_; }
  /// The current bandwidth estimate in bytes per second (0 before the first measurement).
  [[nodiscard]] double bandwidth() const noexcept { return bandwidth_.value; }
  /// The current compute-time estimate in seconds (0 before the first measurement).
  [[nodiscard]] double compute_seconds() const noexcept { return compute_.value; }
  /// The current one-way latency estimate in seconds.
  [[nodiscard]] double latency() const noexcept {
    return options_.latency_seconds > 0 ? options_.latency_seconds : latency_;
  }
  [[nodiscard]] const exchange_cost_model& model() const noexcept { return model_; }
  /// Replaces the cost model (for example when the encoding's bytes per element are measured).
  void set_model(const exchange_cost_model& model) noexcept { model_ = model; }

  /// Writes / reads everything the controller learned, as fields of a saved-state record
  /// (core/saved_state.hpp; the pipeline's checkpoint holds them): restoring it into a
  /// controller with the same options makes it decide exactly as the saved one would have.
  void save(state_record_writer& w) const {
    w.put(density_);
    w.put(bandwidth_.value);
    w.put(bandwidth_.held);
    w.put(compute_.value);
    w.put(compute_.held);
    w.put(latency_);
    w.put(static_cast<std::int64_t>(fast_steps_));
  }
  void load(state_record_reader& r) {
    const auto density = r.get<double>();
    const auto bandwidth = r.get<double>();
    const auto bandwidth_held = r.get<double>();
    const auto compute = r.get<double>();
    const auto compute_held = r.get<double>();
    const auto latency = r.get<double>();
    const auto fast_steps = r.get<std::int64_t>();
    density_ = clamp(density);
    bandwidth_ = {bandwidth, bandwidth_held};
    compute_ = {compute, compute_held};
    latency_ = latency;
    fast_steps_ = static_cast<int>(fast_steps);
  }
  /// The model's prediction of the exchange time at the current density and estimates.
  [[nodiscard]] double predicted_comm_seconds() const noexcept {
    return bandwidth_.value > 0 ? model_.comm_seconds(density_, bandwidth_.value, latency()) : 0.0;
  }

  void observe(const step_measurement& m) {
    const double rounds = m.latency_rounds > 0 ? m.latency_rounds : model_.latency_rounds;
    if (m.compute_seconds > 0) compute_.add(m.compute_seconds, options_);
    if (m.comm_seconds > 0 && m.link_bytes > 0) {
      const auto bytes = static_cast<double>(m.link_bytes);
      double sample = m.link_bytes_per_second;
      if (sample > 0) {
        // The link's own throughput is known: what it does not explain is latency.
        if (options_.latency_seconds <= 0 && rounds > 0) {
          const double excess = std::max(0.0, (m.comm_seconds - bytes / sample) / rounds);
          latency_ = latency_ == 0 ? excess : latency_ + options_.smoothing * (excess - latency_);
        }
      } else {
        // Only wall times are known: charge the known latency (0 if none was given), the rest
        // to the transfer. An unknown latency makes this sample underestimate the bandwidth;
        // the density still converges to where comm == target, because each step rescales it
        // by target / measured (monotonically: the error shrinks by latency / comm per step).
        const double busy = std::max(m.comm_seconds - rounds * latency(), 1e-3 * m.comm_seconds);
        sample = bytes / busy;
      }
      bandwidth_.add(sample, options_);
    }
    if (bandwidth_.value <= 0 || compute_.value <= 0) return;

    const double target = options_.target_ratio * compute_.value;
    const double delay = rounds * latency();
    const double transfer = std::max(target - delay, options_.latency_bound_share * target);
    if (m.comm_seconds > 0 && m.comm_seconds - delay < options_.probe_below * transfer &&
        density_ < options_.max_density) {
      if (++fast_steps_ >= options_.probe_after) {
        bandwidth_.value *= options_.probe_factor;
        fast_steps_ = 0;
      }
    } else {
      fast_steps_ = 0;
    }
    const double wanted = clamp(model_.density_for_transfer(transfer, bandwidth_.value));
    if (std::fabs(wanted - density_) > options_.dead_band * density_) density_ = wanted;
  }

 private:
  // A moving average that follows a change at once but ignores a lone outlier: a sample more
  // than `change_factor` away from the average is held back; when the next sample is away in
  // the same direction, the average jumps to the mean of the two, otherwise the held sample
  // is dropped.
  struct tracked {
    double value = 0;
    double held = 0;  // a deviating sample waiting for confirmation, 0 for none

    void add(double sample, const density_controller_options& o) noexcept {
      if (value == 0) {
        value = sample;
        return;
      }
      const bool above = sample > value * o.change_factor;
      const bool below = sample * o.change_factor < value;
      if (above || below) {
        if (held != 0 && (held > value) == above) {
          value = 0.5 * (held + sample);
          held = 0;
        } else {
          held = sample;
        }
        return;
      }
      held = 0;
      value += o.smoothing * (sample - value);
    }
  };
  [[nodiscard]] double clamp(double d) const noexcept {
    if (!(d == d)) return options_.min_density;  // NaN from a degenerate model
    return std::clamp(d, options_.min_density, options_.max_density);
  }

  exchange_cost_model model_;
  density_controller_options options_;
  double density_;
  tracked bandwidth_;
  tracked compute_;
  double latency_ = 0;
  int fast_steps_ = 0;
};

static_assert(density_policy<adaptive_density_controller>);
static_assert(density_policy<fixed_density>);

}  // namespace stellatrain
