// SPDX-License-Identifier: Apache-2.0
// The pipeline's density controller, fed by the pipeline (4 ranks, 2M elements) under a link
// schedule of 100 -> 20 -> 500 Mbit/s: within 5 steps of each change it settles on a density
// whose exchange takes 80% to 110% of the compute time (unless a density bound is reached),
// and it does not oscillate in steady state. The link is a model, not the wall clock: each
// step's time on the link is the bytes the pipeline measured it sending over the rate of the
// schedule, plus a latency, and its compute is the configured one. What is under test is the
// loop (the step reports, the pipeline's cost model against its real bytes, the controller's
// decisions taking effect) and it holds on any machine, however loaded; how close the real
// exchange comes to that model is bench_pipeline's job (step_over_bound). Staleness 0 keeps the
// ranks in step, so that each step's measurement reaches the policy one step later.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace stellatrain;

namespace {

struct observation {
  double density;  // the density the step was selected with
  step_measurement m;
  bool exploring = false;  // the density was an exploring step's, not the controller's choice
};

// The modelled link and compute of the schedule's steps: observation k (in step order) is of
// a step of phase k / steps_per_phase.
struct link_model {
  std::vector<double> bits_per_second;
  int steps_per_phase = 0;
  double latency_seconds = 0;
  double compute_seconds = 0;

  [[nodiscard]] double rate(std::size_t k) const {
    const std::size_t phase =
        std::min(k / static_cast<std::size_t>(steps_per_phase), bits_per_second.size() - 1);
    return bits_per_second[phase];
  }
  // What the link needs for `bytes` at observation k's rate, one latency included.
  [[nodiscard]] double comm_seconds(std::size_t k, std::uint64_t bytes) const {
    return static_cast<double>(bytes) * 8.0 / rate(k) + latency_seconds;
  }
};

// Replaces the measured times by the model's and forwards to an adaptive controller; records
// what it saw.
struct recording_policy {
  adaptive_density_controller inner;
  const link_model* link = nullptr;
  std::vector<observation>* log = nullptr;
  std::size_t observed = 0;

  [[nodiscard]] double density() const noexcept { return inner.density(); }
  void observe(const step_measurement& measured) {
    const step_measurement m{.compute_seconds = link->compute_seconds,
                             .comm_seconds = link->comm_seconds(observed, measured.link_bytes),
                             .link_bytes = measured.link_bytes,
                             .latency_rounds = 1};
    ++observed;
    if (log != nullptr) log->push_back({last_density, m, last_exploring});
    inner.observe(m);
    if (log != nullptr && std::getenv("STELLATRAIN_TEST_TRACE")) {
      std::fprintf(stderr,
                   "obs %zu: d=%.5f comm=%.4f compute=%.4f bytes=%llu -> bw=%.3g Mbit/s lat=%.4f "
                   "next d=%.5f\n",
                   log->size() - 1, last_density, m.comm_seconds, m.compute_seconds,
                   (unsigned long long)m.link_bytes, inner.bandwidth() * 8e-6, inner.latency(),
                   inner.density());
    }
    last_density = inner.density();
    last_exploring = inner.exploring();
  }
  void set_model(const exchange_cost_model& model) { inner.set_model(model); }
  double last_density = 0;
  bool last_exploring = false;
};

}  // namespace

TEST_CASE("the controller follows a 100 -> 20 -> 500 Mbit/s schedule of a modelled link",
          "[pipeline][controller]") {
  const int ranks = 4;
  const std::uint64_t n = 2'000'000;  // elements, in 4 tensors / buckets
  const std::vector<double> schedule{100e6, 20e6, 500e6};
  const int steps_per_phase = 24;
  const link_model model{.bits_per_second = schedule,
                         .steps_per_phase = steps_per_phase,
                         .latency_seconds = 0.002,
                         .compute_seconds = 0.060};
  // At 500 Mbit/s the best density lies beyond this bound, so the controller must settle on it.
  const double max_density = 0.05;
  std::vector<observation> log;  // rank 0's
  std::vector<double> phase_start_density;

  run_in_process(ranks, [&](in_process_transport& raw) {
    in_process_transport& t = raw;
    const int r = t.rank();
    thread_pool pool{1};
    recording_policy policy{
        adaptive_density_controller(
            {.min_density = 1e-4, .max_density = max_density, .initial_density = 0.01}),
        &model, r == 0 ? &log : nullptr};
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
               sgd_optimizer({.lr = 0.01f}),
               {.bucket_bytes = n, .staleness = 0, .exchange_threads = 2}, policy);
    for (std::uint32_t i = 0; i < 4; ++i) p.add_tensor(i, std::vector<float>(n / 4, 0.5f));
    p.start();
    std::vector<float> g(n / 4);
    std::mt19937 rng(static_cast<std::uint32_t>(r));
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& x : g) x = d(rng);
    for (int s = 0; s < steps_per_phase * static_cast<int>(schedule.size()); ++s) {
      for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
      for (std::size_t i = 4; i-- > 0;) p.push_gradient(i, g);
    }
    p.flush();
  });

  // Rank 0's observations, one per step, in step order, except the last (its reports would
  // travel in messages of a step that never comes).
  REQUIRE(log.size() >= schedule.size() * steps_per_phase - 4);
  log.resize(schedule.size() * steps_per_phase, log.back());
  // The density the controller settles on is judged by the median over the steps from the
  // fifth after each change, and it must hold still around that median (no oscillation).
  for (std::size_t phase = 0; phase < schedule.size(); ++phase) {
    std::vector<double> ratios;
    std::vector<double> densities;
    bool at_bound = false;
    for (int s = 5; s < steps_per_phase; ++s) {
      const auto& o = log[phase * steps_per_phase + static_cast<std::size_t>(s)];
      if (o.exploring) continue;  // the checks are of the densities the controller chose
      // What the link needs for this step's bytes, against the compute.
      ratios.push_back(o.m.comm_seconds / model.compute_seconds);
      densities.push_back(o.density);
      at_bound = at_bound || o.density <= 1e-4 * 1.0001 || o.density >= max_density * 0.9999;
      UNSCOPED_INFO("phase " << phase << " step " << s << " density " << o.density << " link bytes "
                             << o.m.link_bytes << " true comm/compute " << ratios.back());
    }
    auto median = [](std::vector<double> v) {
      std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
      return v[v.size() / 2];
    };
    const double settled = median(densities);
    if (!at_bound) {
      CHECK(median(ratios) >= 0.8);
      CHECK(median(ratios) <= 1.1);
    }
    if (schedule[phase] == 500e6) CHECK(settled >= max_density * 0.9999);
    int strays = 0;
    for (double d : densities) strays += std::fabs(d / settled - 1.0) > 0.15 ? 1 : 0;
    CHECK(strays <= 2);
  }
}
