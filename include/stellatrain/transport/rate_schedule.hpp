// SPDX-License-Identifier: Apache-2.0
// A link rate that changes over time, for emulating a fluctuating uplink with the shaped
// transports (shaping.hpp): which rate holds at a given time since the start.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <charconv>
#include <cmath>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

/// From `seconds` on (since the schedule's start) the link runs at `bits_per_second`.
struct rate_change {
  double seconds = 0;
  double bits_per_second = 0;
};

/// Phases of a link's rate: before the first change the link keeps the rate it was made with;
/// from each change's time on, that change's rate. The caller applies `rate_at(t)` to the link
/// (`cluster_links::set_rate`, `shaped_transport::set_rate`) as its clock advances, for
/// example once per training step, with t on whatever clock the experiment counts.
class rate_schedule {
 public:
  rate_schedule() = default;

  /// Throws stellatrain::error(invalid_argument) unless the times are finite, >= 0 and
  /// strictly increasing and the rates finite and > 0.
  explicit rate_schedule(std::vector<rate_change> changes) : changes_(std::move(changes)) {
    for (std::size_t i = 0; i < changes_.size(); ++i) {
      const auto& c = changes_[i];
      if (!std::isfinite(c.seconds) || c.seconds < 0 ||
          (i > 0 && !(c.seconds > changes_[i - 1].seconds))) {
        throw error(errc::invalid_argument,
                    "rate_schedule: change " + std::to_string(i) +
                        " needs a finite time >= 0, later than the change before it");
      }
      if (!std::isfinite(c.bits_per_second) || !(c.bits_per_second > 0)) {
        throw error(errc::invalid_argument,
                    "rate_schedule: change " + std::to_string(i) + " needs a finite rate > 0");
      }
    }
  }

  /// Parses "T:R,T:R,..." (the form of wan-emu's --schedule): T seconds since the start, R the
  /// rate, either with a unit of tc (bit, kbit, mbit, gbit: "20:50mbit,40:200mbit") or a plain
  /// number in units of `unit_bits_per_second` (Mbit/s by default: "20:50,40:200"). Throws
  /// stellatrain::error(invalid_argument) naming the part that does not parse.
  [[nodiscard]] static rate_schedule parse(std::string_view text,
                                           double unit_bits_per_second = 1e6) {
    std::vector<rate_change> changes;
    while (!text.empty()) {
      const auto comma = text.find(',');
      const std::string_view part = text.substr(0, comma);
      const auto colon = part.find(':');
      rate_change c;
      std::string_view rate = colon == std::string_view::npos ? part : part.substr(colon + 1);
      double unit = unit_bits_per_second;
      for (const auto& [suffix, bits] : {std::pair<std::string_view, double>{"gbit", 1e9},
                                         {"mbit", 1e6},
                                         {"kbit", 1e3},
                                         {"bit", 1.0}}) {
        if (rate.ends_with(suffix)) {
          rate.remove_suffix(suffix.size());
          unit = bits;
          break;
        }
      }
      if (colon == std::string_view::npos || !whole(part.substr(0, colon), c.seconds) ||
          !whole(rate, c.bits_per_second)) {
        throw error(errc::invalid_argument,
                    "rate_schedule: '" + std::string(part) + "' is not SECONDS:RATE");
      }
      c.bits_per_second *= unit;
      changes.push_back(c);
      if (comma == std::string_view::npos) break;
      text.remove_prefix(comma + 1);
      if (text.empty()) throw error(errc::invalid_argument, "rate_schedule: a trailing comma");
    }
    return rate_schedule(std::move(changes));
  }

  [[nodiscard]] const std::vector<rate_change>& changes() const noexcept { return changes_; }
  [[nodiscard]] bool empty() const noexcept { return changes_.empty(); }

  /// The rate at `seconds` since the start; `initial` before the first change.
  [[nodiscard]] double rate_at(double seconds, double initial) const noexcept {
    double rate = initial;
    for (const auto& c : changes_) {
      if (c.seconds > seconds) break;
      rate = c.bits_per_second;
    }
    return rate;
  }

 private:
  static bool whole(std::string_view s, double& v) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    return ec == std::errc() && p == s.data() + s.size();
  }
  std::vector<rate_change> changes_;
};

}  // namespace stellatrain
