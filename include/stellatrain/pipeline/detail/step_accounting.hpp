// SPDX-License-Identifier: Apache-2.0
// A pipeline's accounting of its steps: what each step selected, sent and when its exchanges
// kept the link busy, turned into this rank's step report; and the cost model of the density
// policy, from the exchange's shape and the wire format's own sizes.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/step_reports.hpp>
#include <stellatrain/transport/concept.hpp>

#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace stellatrain::detail {

// CPU time of the calling thread, for the stages' CPU seconds.
inline double thread_cpu_seconds() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// What the buckets of one step did on this rank.
struct step_record {
  std::int64_t step = -1;
  std::size_t pushed_buckets = 0;
  std::size_t exchanged_buckets = 0;
  std::size_t applied_buckets = 0;
  double density = -1;
  double compute_seconds = 0;
  // [begin, end) of each bucket's time on the link, for the link's busy time of the step.
  std::vector<std::pair<transport_clock::time_point, transport_clock::time_point>> spans;
  std::uint64_t link_bytes = 0;
  std::uint64_t message_bytes = 0;
  std::uint64_t elements = 0;

  void add(const exchange_traffic& t) {
    message_bytes += t.message_bytes;
    elements += t.elements;
    link_bytes += t.link_bytes;
    if (t.link_end > t.link_begin) spans.emplace_back(t.link_begin, t.link_end);
  }

  // This rank's report of the step (pipeline/step_reports.hpp), once every bucket is
  // exchanged. The time the spans cover together, and how many disjoint groups they form:
  // buckets whose exchanges overlap share the link and their latencies; one that starts after
  // the others ended (its gradients came later) waits its own, and the gap is compute.
  [[nodiscard]] rank_report report(double rounds_per_exchange) {
    std::sort(spans.begin(), spans.end());
    double busy = 0;
    double groups = 0;
    for (std::size_t i = 0; i < spans.size();) {
      auto [begin, end] = spans[i];
      for (++i; i < spans.size() && spans[i].first <= end; ++i)
        end = std::max(end, spans[i].second);
      busy += std::chrono::duration<double>(end - begin).count();
      groups += 1;
    }
    return {
        .step = step,
        .exchange_seconds = busy,
        .compute_seconds = compute_seconds,
        .link_bytes = link_bytes,
        .bytes_per_element =
            elements > 0 ? static_cast<double>(message_bytes) / static_cast<double>(elements) : 0.0,
        .latency_rounds = groups * rounds_per_exchange};
  }
};

// The records of the steps in flight (at most staleness + 2 of them, with room to spare).
class step_records {
 public:
  step_record& operator[](std::int64_t step) {
    step_record& r = records_[static_cast<std::size_t>(step) % records_.size()];
    if (r.step != step) {
      auto spans = std::move(r.spans);  // keeps its capacity: no allocation per step
      spans.clear();
      r = step_record{};
      r.step = step;
      r.spans = std::move(spans);
    }
    return r;
  }

 private:
  std::array<step_record, 8> records_{};
};

// Wire bytes of one bucket's message beyond its pairs: the message header and trailer and the
// step-reports section (once its reports exist), and of each tensor's section header.
inline constexpr double message_overhead_bytes =
    wire::message_header_bytes + wire::message_trailer_bytes + wire::section_header_bytes +
    step_reports_bytes(step_report_book::sent);
inline constexpr double section_overhead_bytes = wire::section_header_bytes;

// The density policy's model of one step's exchange on this rank's link.
inline exchange_cost_model cost_model_of(const exchange_shape& shape, std::uint64_t elements,
                                         std::size_t buckets, std::size_t tensors,
                                         int exchange_threads, double bytes_per_element) {
  // Buckets' exchanges overlap across the exchange threads: their latencies do too.
  const double threads = static_cast<double>(
      std::max<std::size_t>(std::min(static_cast<std::size_t>(exchange_threads), buckets), 1));
  const double share = static_cast<double>(shape.share);
  return {.elements = static_cast<std::uint64_t>(std::ceil(static_cast<double>(elements) / share)),
          .ranks = shape.ranks,
          .bytes_per_element = bytes_per_element,
          .header_bytes = message_overhead_bytes * static_cast<double>(buckets) +
                          section_overhead_bytes * static_cast<double>(tensors) / share,
          .latency_rounds = shape.rounds * std::ceil(static_cast<double>(buckets) / threads)};
}

}  // namespace stellatrain::detail
