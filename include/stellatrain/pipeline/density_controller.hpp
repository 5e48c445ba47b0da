// SPDX-License-Identifier: Apache-2.0
// Chooses the compression density (k/n) for each training step from measurements, so that the
// exchange of a step hides behind the compute of the next one: the "holistic configuration"
// of the StellaTrain paper, wired in.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/saved_state.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
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
  /// One-way link latency in seconds if known (`measure_latency`, transport/latency_probe.hpp,
  /// measures it with round trips of tiny messages before training). 0: estimated, from
  /// measurements that carry the link's throughput, else by fitting
  /// comm = rounds * latency + bytes / bandwidth to the last `latency_fit_window` steps once
  /// their bytes differ enough to tell the two apart (until then latency counts as transfer
  /// time).
  double latency_seconds = 0;
  /// While the exchange finishes below `probe_below * target` for `probe_after` steps in a
  /// row, the bandwidth estimate is raised by `probe_factor` (the estimate can only be
  /// measured up to what the traffic offers; probing finds out whether there is more).
  double probe_below = 0.5;
  int probe_after = 3;
  double probe_factor = 1.1;
  /// While the latency is fitted (`latency_seconds` 0, no link throughput measured) and the
  /// window's steps are too alike in bytes to tell latency from transfer, every
  /// `explore_every`-th step runs at twice the density (half at `max_density`), so that the
  /// fit gets the spread it needs: a density held at one value, at its floor say, would
  /// otherwise keep a wrong latency, and the bandwidth it implies, for good. 0: never.
  int explore_every = 8;
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
/// as link_bytes / (comm_seconds - latency), the latency given or fitted (`latency_seconds`).
/// Changes smaller than `dead_band` are ignored, so a steady link gives a steady density; a
/// bandwidth change moves the density within a few steps (the smoothing sets how many).
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
        !(options_.latency_bound_share >= 0) || options_.latency_bound_share > 1 ||
        options_.explore_every < 0) {
      throw_error(errc::invalid_argument,
                  "adaptive_density_controller: need 0 < min_density <= max_density <= 1, "
                  "0 < smoothing <= 1, target_ratio > 0, change_factor > 1, "
                  "0 <= latency_bound_share <= 1 and explore_every >= 0");
    }
  }

  /// The density of the next step: the chosen one, or on an exploring step (see
  /// `explore_every`) twice that (half at `max_density`).
  [[nodiscard]] double density() const noexcept {
    if (!exploring_) return density_;
    return density_ * 2 <= options_.max_density ? density_ * 2 : clamp(density_ / 2);
  }
  /// Whether `density()` is an exploring step's rather than the chosen one.
  [[nodiscard]] bool exploring() const noexcept { return exploring_; }
  /// The current bandwidth estimate in bytes per second (0 before the first measurement).
  [[nodiscard]] double bandwidth() const noexcept { return bandwidth_.value; }
  /// The current compute-time estimate in seconds (0 before the first measurement).
  [[nodiscard]] double compute_seconds() const noexcept { return compute_.value; }
  /// The current one-way latency estimate in seconds.
  [[nodiscard]] double latency() const noexcept {
    return options_.latency_seconds > 0 ? options_.latency_seconds : latency_;
  }
  [[nodiscard]] const exchange_cost_model& model() const noexcept { return model_; }
  /// Steps the latency fit looks back on.
  static constexpr std::size_t latency_fit_window = 16;
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
    w.put(static_cast<std::uint64_t>(samples_));
    w.put(static_cast<std::int64_t>(since_explored_));
    w.put(static_cast<std::uint8_t>(exploring_ ? 1 : 0));
    for (const auto& x : window_) {
      w.put(x.rounds);
      w.put(x.bytes);
      w.put(x.seconds);
    }
  }
  void load(state_record_reader& r) {
    const auto density = r.get<double>();
    const auto bandwidth = r.get<double>();
    const auto bandwidth_held = r.get<double>();
    const auto compute = r.get<double>();
    const auto compute_held = r.get<double>();
    const auto latency = r.get<double>();
    const auto fast_steps = r.get<std::int64_t>();
    const auto samples = r.get<std::uint64_t>();
    const auto since_explored = r.get<std::int64_t>();
    const auto exploring = r.get<std::uint8_t>();
    std::array<exchange_sample, latency_fit_window> window{};
    for (auto& x : window) x = {r.get<double>(), r.get<double>(), r.get<double>()};
    density_ = clamp(density);
    bandwidth_ = {bandwidth, bandwidth_held};
    compute_ = {compute, compute_held};
    latency_ = latency;
    fast_steps_ = static_cast<int>(fast_steps);
    samples_ = samples;
    since_explored_ = static_cast<int>(since_explored);
    exploring_ = exploring != 0;
    window_ = window;
  }
  /// The model's prediction of the exchange time at the current density and estimates.
  [[nodiscard]] double predicted_comm_seconds() const noexcept {
    return bandwidth_.value > 0 ? model_.comm_seconds(density_, bandwidth_.value, latency()) : 0.0;
  }

  void observe(const step_measurement& m) {
    const double rounds = m.latency_rounds > 0 ? m.latency_rounds : model_.latency_rounds;
    exploring_ = false;
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
        // Only wall times are known: charge the latency (given, or fitted once the steps'
        // bytes differ enough), the rest to the transfer. While the latency is unknown this
        // sample underestimates the bandwidth; the density still converges to where comm ==
        // target, because each step rescales it by target / measured (monotonically: the
        // error shrinks by latency / comm per step).
        if (options_.latency_seconds <= 0 && rounds > 0) {
          const bool posed = fit_latency({rounds, bytes, m.comm_seconds});
          exploring_ =
              !posed && options_.explore_every > 0 && ++since_explored_ >= options_.explore_every;
          if (exploring_) since_explored_ = 0;
        }
        const double busy = std::max(m.comm_seconds - rounds * latency(), 1e-3 * m.comm_seconds);
        sample = bytes / busy;
      }
      // A changed link makes the older samples of a settled fit another link's (while the
      // latency is still unknown, the estimate jumps as the density moves: keep them).
      if (bandwidth_.add(sample, options_) && latency_ > 0) restart_fit();
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
    // A bound the link allows is taken even within the dead band (which would otherwise hold
    // the density a few percent short of it for good).
    const bool to_bound =
        wanted != density_ && (wanted == options_.max_density || wanted == options_.min_density);
    if (to_bound || std::fabs(wanted - density_) > options_.dead_band * density_) density_ = wanted;
  }

 private:
  // A moving average that follows a change at once but ignores a lone outlier: a sample more
  // than `change_factor` away from the average is held back; when the next sample is away in
  // the same direction, the average jumps to the mean of the two, otherwise the held sample
  // is dropped.
  struct tracked {
    double value = 0;
    double held = 0;  // a deviating sample waiting for confirmation, 0 for none

    // Returns whether the average jumped to a changed level.
    bool add(double sample, const density_controller_options& o) noexcept {
      if (value == 0) {
        value = sample;
        return false;
      }
      const bool above = sample > value * o.change_factor;
      const bool below = sample * o.change_factor < value;
      if (above || below) {
        if (held != 0 && (held > value) == above) {
          value = 0.5 * (held + sample);
          held = 0;
          return true;
        }
        held = sample;
        return false;
      }
      held = 0;
      value += o.smoothing * (sample - value);
      return false;
    }
  };

  // One step's exchange for the latency fit.
  struct exchange_sample {
    double rounds = 0, bytes = 0, seconds = 0;
  };

  // Least squares of seconds = rounds * latency + bytes * (1 / bandwidth), no intercept, over
  // the window. The latency is taken when the fit is well posed (the bytes vary relative to
  // the rounds: the normal matrix' determinant is at least `min_spread` of its diagonal
  // product) and gives a positive bandwidth, at most the least time per round of a sample.
  // Returns whether the window's bytes spread enough for the fit.
  bool fit_latency(const exchange_sample& x) noexcept {
    window_[samples_ % latency_fit_window] = x;
    ++samples_;
    const std::size_t n = std::min<std::size_t>(samples_, latency_fit_window);
    if (n < 6) return true;  // too few to judge yet (a fit of 4 start-up steps overshot)
    double rr = 0, rb = 0, bb = 0, rs = 0, bs = 0, least = std::numeric_limits<double>::max();
    for (std::size_t i = 0; i < n; ++i) {
      const exchange_sample& w = window_[i];
      rr += w.rounds * w.rounds;
      rb += w.rounds * w.bytes;
      bb += w.bytes * w.bytes;
      rs += w.rounds * w.seconds;
      bs += w.bytes * w.seconds;
      least = std::min(least, w.seconds / w.rounds);
    }
    constexpr double min_spread = 0.02;
    const double det = rr * bb - rb * rb;
    if (!(det > min_spread * rr * bb)) return false;
    const double latency = (rs * bb - rb * bs) / det;
    const double per_byte = (rr * bs - rb * rs) / det;
    if (per_byte > 0 && latency >= 0) latency_ = std::min(latency, least);
    return true;
  }
  void restart_fit() noexcept {
    if (samples_ == 0) return;
    window_[0] = window_[(samples_ - 1) % latency_fit_window];
    samples_ = 1;
  }
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
  std::array<exchange_sample, latency_fit_window> window_{};  // [sample % window]
  std::uint64_t samples_ = 0;  // samples since the last restart of the fit
  int since_explored_ = 0;     // observations since the last exploring step
  bool exploring_ = false;     // the next step explores
};

static_assert(density_policy<adaptive_density_controller>);
static_assert(density_policy<fixed_density>);

}  // namespace stellatrain
