// SPDX-License-Identifier: Apache-2.0
// A pipeline's book of its steps: what each step selected, sent and waited, the totals, this
// rank's step reports for the others, and what the density policy learns from every rank's
// reports (pipeline/step_reports.hpp). The pipeline calls it with its lock held (`take`
// takes it).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/detail/step_accounting.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/pipeline/step_reports.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace stellatrain::detail {

template <density_policy Policy>
class step_book {
 public:
  explicit step_book(Policy policy) : policy_(std::move(policy)) {}

  [[nodiscard]] Policy& policy() noexcept { return policy_; }
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }

  // The exchange's shape and report sources, the model's sizes: once, at start.
  void start(const exchange_shape& shape, std::vector<int> sources, std::uint64_t elements,
             std::size_t buckets, std::size_t tensors, int exchange_threads) {
    shape_ = shape;
    sources_ = std::move(sources);
    elements_ = elements;
    buckets_ = buckets;
    tensors_ = tensors;
    exchange_threads_ = exchange_threads;
    restart(0);
    if constexpr (requires { policy_.set_model(exchange_cost_model{}); }) {
      policy_.set_model(cost_model(8.0));
    }
  }

  // The reports from `first_step` on (at start, and after a checkpoint is loaded).
  void restart(std::int64_t first_step) {
    reports_.start(static_cast<int>(sources_.size()), first_step);
  }

  // ---- the application's time

  // Time the application waited in the pipeline's gates, or spent on work it excludes from
  // the step's compute.
  void waited(double seconds) noexcept {
    gate_wait_in_step_ += seconds;
    stats_.gate_wait_seconds += seconds;
  }
  void exclude(double seconds) noexcept { gate_wait_in_step_ += seconds; }

  // Every bucket of `step` is handed over: the step's compute time is the time since the
  // previous step was, less the time the application waited in gates.
  void handed_over(std::int64_t step) {
    const auto now = transport_clock::now();
    if (last_step_time_ != transport_clock::time_point{}) {
      const double interval = std::chrono::duration<double>(now - last_step_time_).count();
      records_[step].compute_seconds = std::max(0.0, interval - gate_wait_in_step_);
    }
    last_step_time_ = now;
    gate_wait_in_step_ = 0;
  }

  [[nodiscard]] std::size_t& pushed_buckets(std::int64_t step) {
    return records_[step].pushed_buckets;
  }

  // ---- the buckets' phases

  // The density of `step`: the policy's, fixed at the first bucket that asks.
  double density_of(std::int64_t step) {
    step_record& r = records_[step];
    if (r.density < 0) r.density = std::clamp(static_cast<double>(policy_.density()), 0.0, 1.0);
    return r.density;
  }

  void encoded(std::int64_t step, const exchange_traffic& t, double density) {
    account(step, t);
    stats_.last_density = density;
  }

  // Once every bucket of `step` is exchanged, this rank's view of it goes to every rank's
  // policy with its next messages.
  void exchanged(std::int64_t step, const exchange_traffic& t) {
    account(step, t);
    stats_.stage_cpu_seconds += t.cpu_seconds;
    step_record& r = records_[step];
    if (++r.exchanged_buckets == buckets_) reports_.add_own(r.report(shape_.rounds));
  }

  // Returns whether every bucket of `step` is applied.
  bool applied(std::int64_t step) { return ++records_[step].applied_buckets == buckets_; }

  void add_cpu(double seconds) noexcept { stats_.stage_cpu_seconds += seconds; }

  // ---- the reports

  // This rank's latest reports, written into `scratch` (empty before the first).
  [[nodiscard]] std::span<const std::byte> own_payload(std::vector<std::byte>& scratch) const {
    return reports_.own_payload(scratch);
  }

  // Rank `from`'s reports from its message of `step` (checked, then taken under `lock`);
  // every step whose reports are then complete is observed by the policy, with the cost
  // model of the bytes per element the ranks measured.
  void take(int from, std::int64_t step, std::span<const std::byte> payload, std::mutex& lock) {
    std::array<rank_report, step_reports_layout::max_reports> in{};
    const std::size_t n =
        read_step_reports(payload, step, in, "pipeline: rank " + std::to_string(from));
    std::lock_guard guard(lock);
    reports_.take(source_slot(from), std::span<const rank_report>(in.data(), n),
                  [&](const rank_report& agg) {
                    if constexpr (requires { policy_.set_model(exchange_cost_model{}); }) {
                      if (agg.bytes_per_element > 0)
                        policy_.set_model(cost_model(agg.bytes_per_element));
                    }
                    observation_.measurement = {.compute_seconds = agg.compute_seconds,
                                                .comm_seconds = agg.exchange_seconds,
                                                .link_bytes = agg.link_bytes,
                                                .latency_rounds = agg.latency_rounds};
                    policy_.observe(observation_.measurement);
                    ++observation_.steps;
                  });
  }

  [[nodiscard]] pipeline_stats stats(std::int64_t applied_step) const {
    pipeline_stats s = stats_;
    s.steps_applied = static_cast<std::uint64_t>(applied_step + 1);
    return s;
  }
  [[nodiscard]] const pipeline_observation& observation() const noexcept { return observation_; }

 private:
  void account(std::int64_t step, const exchange_traffic& t) {
    records_[step].add(t);
    stats_.bytes_sent += t.sent_bytes;
    stats_.elements_sent += t.elements;
    stats_.link_bytes += t.link_bytes;
    stats_.exchange_seconds += std::chrono::duration<double>(t.link_end - t.link_begin).count();
  }

  [[nodiscard]] exchange_cost_model cost_model(double bytes_per_element) const {
    return cost_model_of(shape_, elements_, buckets_, tensors_, exchange_threads_,
                         bytes_per_element);
  }

  // The place of `rank` among the strategy's report sources.
  [[nodiscard]] int source_slot(int rank) const {
    const auto it = std::lower_bound(sources_.begin(), sources_.end(), rank);
    if (it == sources_.end() || *it != rank) {
      throw_error(errc::malformed_message, "pipeline: step reports from rank " +
                                               std::to_string(rank) +
                                               ", which sends this rank none");
    }
    return static_cast<int>(it - sources_.begin());
  }

  Policy policy_;
  exchange_shape shape_{};
  std::vector<int> sources_;  // the ranks whose reports arrive, ascending
  std::uint64_t elements_ = 0;
  std::size_t buckets_ = 0;
  std::size_t tensors_ = 0;
  int exchange_threads_ = 1;
  step_records records_;
  pipeline_stats stats_;
  step_report_book reports_;
  pipeline_observation observation_;
  transport_clock::time_point last_step_time_{};
  double gate_wait_in_step_ = 0;
};

}  // namespace stellatrain::detail
