// SPDX-License-Identifier: Apache-2.0
// The pipeline's in-band measurement protocol: each rank's view of its last completed steps,
// carried in a control section of every message it sends (docs/wire-format.md, "Step
// reports"), and the rule that turns all ranks' reports of a step into one observation, the
// same on every rank.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace stellatrain {

/// One rank's measurements of one completed step, as the step-reports control section carries
/// them.
struct rank_report {
  std::int64_t step = -1;        ///< the step (-1: none)
  double exchange_seconds = 0;   ///< wall time with one of its exchanges in flight
  double compute_seconds = 0;    ///< the rank's compute time of the step
  std::uint64_t link_bytes = 0;  ///< bytes its link carried in the step, by the cost model
  double bytes_per_element = 0;  ///< packed bytes per selected element in the step
  /// Sequential latencies its exchanges waited: the disjoint spans they formed in time
  /// (overlapping exchanges count once) times the rounds of one exchange (P - 1 for a ring);
  /// the link's transfer time is exchange_seconds less that many latencies.
  double latency_rounds = 0;
};

/// Layout constants of the step-reports control section (`control_type::step_reports`).
namespace step_reports_layout {
inline constexpr std::uint16_t version = 2;
inline constexpr std::size_t header_bytes = 8;
inline constexpr std::size_t report_bytes = 48;
/// Reports one section may carry.
inline constexpr std::size_t max_reports = 8;
}  // namespace step_reports_layout

/// Bytes of a step-reports payload holding `count` reports.
[[nodiscard]] constexpr std::size_t step_reports_bytes(std::size_t count) noexcept {
  return step_reports_layout::header_bytes + count * step_reports_layout::report_bytes;
}

/// Writes `reports` (1 to `max_reports`, steps ascending) as a step-reports payload to the
/// front of `out` (at least `step_reports_bytes(reports.size())` bytes); returns that part.
inline std::span<std::byte> write_step_reports(std::span<const rank_report> reports,
                                               std::span<std::byte> out) {
  namespace layout = step_reports_layout;
  const std::size_t bytes = step_reports_bytes(reports.size());
  if (reports.empty() || reports.size() > layout::max_reports || out.size() < bytes) {
    throw_error(errc::invalid_argument, "write_step_reports: " + std::to_string(reports.size()) +
                                            " reports into " + std::to_string(out.size()) +
                                            " bytes");
  }
  std::byte* p = out.data();
  detail::store_le<std::uint16_t>(p, layout::version);
  detail::store_le<std::uint16_t>(p + 2, static_cast<std::uint16_t>(reports.size()));
  detail::store_le<std::uint32_t>(p + 4, 0);
  p += layout::header_bytes;
  for (const auto& r : reports) {
    detail::store_le<std::uint64_t>(p, static_cast<std::uint64_t>(r.step));
    detail::store_le<std::uint64_t>(p + 8, std::bit_cast<std::uint64_t>(r.exchange_seconds));
    detail::store_le<std::uint64_t>(p + 16, std::bit_cast<std::uint64_t>(r.compute_seconds));
    detail::store_le<std::uint64_t>(p + 24, r.link_bytes);
    detail::store_le<std::uint64_t>(p + 32, std::bit_cast<std::uint64_t>(r.bytes_per_element));
    detail::store_le<std::uint64_t>(p + 40, std::bit_cast<std::uint64_t>(r.latency_rounds));
    p += layout::report_bytes;
  }
  return out.first(bytes);
}

/// Reads a step-reports payload of a message whose own step is `message_step` into the front
/// of `out` (room for `max_reports`); returns how many. Throws `errc::malformed_message`,
/// prefixed with `who`, for a payload that breaks the layout (size, version, count, steps not
/// ascending or not before `message_step`, a time or size that is negative or not finite).
inline std::size_t read_step_reports(std::span<const std::byte> payload, std::int64_t message_step,
                                     std::span<rank_report> out, const std::string& who) {
  namespace layout = step_reports_layout;
  auto fail = [&](const std::string& what) {
    throw_error(errc::malformed_message, who + ": step reports: " + what);
  };
  if (payload.size() < layout::header_bytes)
    fail(std::to_string(payload.size()) + " bytes, no header");
  const std::byte* p = payload.data();
  const auto version = detail::load_le<std::uint16_t>(p);
  const std::size_t count = detail::load_le<std::uint16_t>(p + 2);
  if (version != layout::version) fail("layout version " + std::to_string(version));
  if (detail::load_le<std::uint32_t>(p + 4) != 0) fail("reserved bytes are not zero");
  if (count == 0 || count > layout::max_reports || count > out.size())
    fail(std::to_string(count) + " reports");
  if (payload.size() != step_reports_bytes(count)) {
    fail(std::to_string(payload.size()) + " bytes for " + std::to_string(count) + " reports");
  }
  auto seconds = [&](const std::byte* q, const char* field) {
    const double v = std::bit_cast<double>(detail::load_le<std::uint64_t>(q));
    if (!std::isfinite(v) || v < 0) fail(std::string(field) + " " + std::to_string(v));
    return v;
  };
  p += layout::header_bytes;
  std::int64_t previous = -1;
  for (std::size_t i = 0; i < count; ++i, p += layout::report_bytes) {
    const auto step = detail::load_le<std::uint64_t>(p);
    if (step >= static_cast<std::uint64_t>(message_step) ||
        static_cast<std::int64_t>(step) <= previous) {
      fail("report of step " + std::to_string(step) + " in a message of step " +
           std::to_string(message_step) +
           (i > 0 ? " after step " + std::to_string(previous) : std::string()));
    }
    previous = static_cast<std::int64_t>(step);
    out[i] = {.step = previous,
              .exchange_seconds = seconds(p + 8, "exchange seconds"),
              .compute_seconds = seconds(p + 16, "compute seconds"),
              .link_bytes = detail::load_le<std::uint64_t>(p + 24),
              .bytes_per_element = seconds(p + 32, "bytes per element"),
              .latency_rounds = seconds(p + 40, "latency rounds")};
  }
  return count;
}

namespace detail {

// How long an exchange takes on one rank includes waiting for ranks that are still computing
// or that started the step later, and a rank that starts late finds the others' messages
// already under way: one rank's exchange time is not the link's, and the shortest of them
// can be near zero. What holds on every rank is the period: in steady state each rank's step
// takes the same time, its compute plus the time it waited on the exchange. So the mean over
// the ranks of (exchange + compute), less the slowest compute, is the exchange time that the
// step exposes beyond its slowest compute (with staleness 0), and with staleness 1 the time
// from the slowest rank's hand-over to the last arrival when the ranks start together (a
// skew of starts adds to it, which makes the controller err on the side of less traffic).
// Every rank therefore sends its view of its last completed steps with each message
// (step_report_book), and every rank observes, in step order, the same aggregate once all
// ranks' reports of a step are in (report_aggregate).

// The combination of one step's reports, one per rank: the mean over the ranks of (exchange +
// compute) less the slowest compute (at least 0), the slowest compute, and the means of link
// bytes, bytes per element and latency rounds. Add every rank's report, then take `result`.
class report_aggregate {
 public:
  void add(const rank_report& r) noexcept {
    compute_ = std::max(compute_, r.compute_seconds);
    spans_ += r.exchange_seconds + r.compute_seconds;
    bytes_ += static_cast<double>(r.link_bytes);
    per_element_ += r.bytes_per_element;
    rounds_ += r.latency_rounds;
    n_ += 1;
  }
  [[nodiscard]] rank_report result(std::int64_t step) const noexcept {
    rank_report agg{.step = step, .compute_seconds = compute_};
    if (n_ == 0) return agg;
    agg.exchange_seconds = std::max(0.0, spans_ / n_ - compute_);
    agg.link_bytes = static_cast<std::uint64_t>(std::llround(bytes_ / n_));
    agg.bytes_per_element = per_element_ / n_;
    agg.latency_rounds = rounds_ / n_;
    return agg;
  }

 private:
  double compute_ = 0, spans_ = 0, bytes_ = 0, per_element_ = 0, rounds_ = 0, n_ = 0;
};

// This rank's reports to send, and the reports of every rank until a step's are complete.
class step_report_book {
 public:
  // Latest own reports sent per message.
  static constexpr std::size_t sent = 3;
  // Steps a rank's reports are kept for while others' are missing.
  static constexpr std::size_t window = 8;

  void start(int ranks, std::int64_t first_step) {
    peers_.assign(static_cast<std::size_t>(ranks), {});
    mine_ = {};
    next_ = first_step;
  }

  // This rank completed the exchanges of `r.step` (in step order).
  void add_own(const rank_report& r) {
    std::rotate(mine_.begin(), mine_.begin() + 1, mine_.end());
    mine_.back() = r;
  }

  // The payload of this rank's latest reports, or empty when it has none yet.
  std::span<const std::byte> own_payload(std::vector<std::byte>& scratch) const {
    std::array<rank_report, sent> have{};
    std::size_t n = 0;
    for (const auto& r : mine_) {
      if (r.step >= 0) have[n++] = r;
    }
    if (n == 0) return {};
    scratch.resize(step_reports_bytes(n));
    return write_step_reports(std::span<const rank_report>(have.data(), n), scratch);
  }

  // Stores rank `rank`'s reports, then hands `observe(aggregate)` every step whose reports are
  // complete, in step order. A step whose report of some rank was overwritten before the
  // others' arrived is skipped.
  template <class Observe>
  void take(int rank, std::span<const rank_report> reports, Observe&& observe) {
    auto& table = peers_[static_cast<std::size_t>(rank)];
    for (const auto& r : reports) table[static_cast<std::size_t>(r.step) % window] = r;
    for (;; ++next_) {
      bool complete = true;
      bool lost = false;
      for (const auto& t : peers_) {
        const std::int64_t step = t[static_cast<std::size_t>(next_) % window].step;
        if (step > next_) lost = true;
        if (step != next_) complete = false;
      }
      if (lost) continue;
      if (!complete) return;
      const rank_report agg = aggregate();
      observe(agg);
    }
  }

  // The aggregate of step next_, all of whose reports are in.
  [[nodiscard]] rank_report aggregate() const {
    report_aggregate agg;
    for (const auto& t : peers_) agg.add(t[static_cast<std::size_t>(next_) % window]);
    return agg.result(next_);
  }

 private:
  std::array<rank_report, sent> mine_{};
  std::vector<std::array<rank_report, window>> peers_;  // [rank][step % window]
  std::int64_t next_ = 0;                               // the next step to observe
};

}  // namespace detail

}  // namespace stellatrain
