// SPDX-License-Identifier: Apache-2.0
// The density controller against a simulated link whose bandwidth follows 100 -> 20 -> 500
// Mbit/s: within 5 steps of each change the exchange time settles between 80% and 110% of
// the compute time (unless a density bound is reached), and the density holds still in
// steady state.
#include <stellatrain/pipeline/density_controller.hpp>

#include "catch.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

using namespace stellatrain;

namespace {

struct simulated_link {
  exchange_cost_model model;
  double latency;  // one-way, seconds
  std::uint64_t noise_state = 12345;
  double noise = 0.03;  // +-3% jitter on the transfer time

  double jitter() {
    noise_state = noise_state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(noise_state >> 11) / 9007199254740992.0;  // [0, 1)
    return 1.0 + noise * (2.0 * u - 1.0);
  }
  step_measurement step(double density, double bits_per_second, double compute,
                        bool report_throughput) {
    const double bandwidth = bits_per_second / 8.0;
    const double bytes = model.link_bytes(density);
    const double transfer = bytes / bandwidth * jitter();
    return {.compute_seconds = compute,
            .comm_seconds = transfer + model.latency_rounds * latency,
            .link_bytes = static_cast<std::uint64_t>(bytes),
            .link_bytes_per_second = report_throughput ? bytes / transfer : 0.0};
  }
};

// `settle`: steps after each change from which the exchange must take 80-110% of the compute.
void run_schedule(bool report_throughput, double latency_option, int settle) {
  const exchange_cost_model model{.elements = 10'000'000,
                                  .ranks = 4,
                                  .bytes_per_element = 5.0,
                                  .header_bytes = 200,
                                  .latency_rounds = 3};
  simulated_link link{model, 0.010};
  adaptive_density_controller controller(model, {.min_density = 1e-4,
                                                 .max_density = 0.1,
                                                 .initial_density = 0.01,
                                                 .latency_seconds = latency_option});
  const double compute = 0.1;
  const std::vector<double> schedule{100e6, 20e6, 500e6};
  const int steps_per_phase = 40;
  for (std::size_t phase = 0; phase < schedule.size(); ++phase) {
    std::vector<double> densities;
    for (int s = 0; s < steps_per_phase; ++s) {
      // An exploring step runs at another density on purpose: the checks are of the chosen one.
      const bool exploring = controller.exploring();
      const double d = controller.density();
      const auto m = link.step(d, schedule[phase], compute, report_throughput);
      controller.observe(m);
      densities.push_back(exploring && !densities.empty() ? densities.back() : d);
      if (s >= settle && !exploring) {
        const bool at_bound = d == 1e-4 || d == 0.1;
        INFO("phase " << phase << " step " << s << " density " << d << " comm " << m.comm_seconds);
        if (!at_bound) {
          CHECK(m.comm_seconds >= 0.8 * compute);
          CHECK(m.comm_seconds <= 1.1 * compute);
        }
      }
    }
    // Steady state: the last 20 steps change the density at most once, and by little.
    int changes = 0;
    for (int s = steps_per_phase - 20; s < steps_per_phase; ++s) {
      if (densities[s] != densities[s - 1]) {
        ++changes;
        CHECK(std::fabs(densities[s] / densities[s - 1] - 1.0) < 0.1);
      }
    }
    CHECK(changes <= 1);
  }
}

}  // namespace

TEST_CASE("controller follows 100 -> 20 -> 500 Mbit/s with link throughput reported",
          "[controller]") {
  run_schedule(true, 0.0, 5);
}

TEST_CASE("controller follows 100 -> 20 -> 500 Mbit/s from wall times and a known latency",
          "[controller]") {
  run_schedule(false, 0.010, 5);
}

// With the latency unknown the controller counts it as transfer time until the first 6 steps'
// different sizes let it fit the latency; it settles within 7 steps (counting the latency as
// transfer for good, it took 10).
TEST_CASE("controller follows 100 -> 20 -> 500 Mbit/s from wall times alone", "[controller]") {
  run_schedule(false, 0.0, 7);
}

TEST_CASE("controller respects its bounds and validates options", "[controller]") {
  const exchange_cost_model model{.elements = 1000, .ranks = 2, .bytes_per_element = 8};
  adaptive_density_controller fast(model, {.min_density = 0.001, .max_density = 0.05});
  for (int i = 0; i < 10; ++i) {
    fast.observe({.compute_seconds = 1.0,
                  .comm_seconds = 1e-6,
                  .link_bytes = 400,
                  .link_bytes_per_second = 1e12});
  }
  CHECK(fast.density() == 0.05);
  adaptive_density_controller slow(model, {.min_density = 0.001, .max_density = 0.05});
  for (int i = 0; i < 10; ++i) {
    slow.observe({.compute_seconds = 1e-3,
                  .comm_seconds = 10.0,
                  .link_bytes = 400,
                  .link_bytes_per_second = 1.0});
  }
  CHECK(slow.density() == 0.001);
  CHECK_THROWS_AS(adaptive_density_controller(model, {.min_density = 0.5, .max_density = 0.1}),
                  error);
  CHECK_THROWS_AS(adaptive_density_controller(model, {.smoothing = 0}), error);
  CHECK_THROWS_AS(adaptive_density_controller(model, {.latency_bound_share = 1.5}), error);
  CHECK_THROWS_AS(adaptive_density_controller(model, {.latency_bound_share = -0.1}), error);
}

namespace {

// 1M elements between 2 ranks, 5 bytes a pair, 100 bytes of headers, one latency per exchange.
constexpr exchange_cost_model latency_model{.elements = 1'000'000,
                                            .ranks = 2,
                                            .bytes_per_element = 5.0,
                                            .header_bytes = 100,
                                            .latency_rounds = 1};
constexpr density_controller_options latency_options{
    .min_density = 1e-4, .max_density = 0.1, .latency_seconds = 0.010};
// The transfer gets half of 0.95 * 5 ms at 12.5 MB/s: 29.7 kB, (29.7k - 100) / 5M = 0.0059.
constexpr double latency_bound_expected = (0.5 * 0.95 * 0.005 * 12.5e6 - 100) / (1e6 * 5.0);

// Runs a controller for 60 steps of a 100 Mbit/s link with 10 ms latency and 5 ms of compute
// (the latency alone exceeds the compute); the link's exchanges went through `measured_rounds`
// rounds of latency (0: as the model says). Returns the density it holds at the end.
double latency_bound_density(density_controller_options o, double measured_rounds,
                             double* latency_estimate = nullptr) {
  const exchange_cost_model& model = latency_model;
  adaptive_density_controller c(model, o);
  const double rounds = measured_rounds > 0 ? measured_rounds : model.latency_rounds;
  for (int i = 0; i < 60; ++i) {
    const double bytes = model.link_bytes(c.density());
    c.observe({.compute_seconds = 0.005,
               .comm_seconds = rounds * 0.010 + bytes / 12.5e6,
               .link_bytes = static_cast<std::uint64_t>(bytes),
               .latency_rounds = measured_rounds});
  }
  if (latency_estimate) *latency_estimate = c.latency();
  return c.density();
}

}  // namespace

TEST_CASE("controller: a latency above the compute leaves the transfer its share", "[controller]") {
  CHECK(latency_bound_density(latency_options, 0) == Approx(latency_bound_expected).epsilon(0.06));
  // Without the share the density falls to its floor, as no density hides the exchange.
  auto none = latency_options;
  none.latency_bound_share = 0;
  CHECK(latency_bound_density(none, 0) == 1e-4);
}

TEST_CASE("controller: an unknown latency is fitted from the steps' bytes and times",
          "[controller]") {
  // Not told the 10 ms, the controller first takes them for transfer time and lowers the
  // density; the steps' different sizes then separate latency from bandwidth, and it ends
  // where the told controller does instead of at its floor.
  auto unknown = latency_options;
  unknown.latency_seconds = 0;
  double latency = 0;
  CHECK(latency_bound_density(unknown, 0, &latency) ==
        Approx(latency_bound_expected).epsilon(0.06));
  CHECK(latency == Approx(0.010).epsilon(0.01));
  // The same over 3 measured rounds (a ring of 4).
  CHECK(latency_bound_density(unknown, 3, &latency) ==
        Approx(latency_bound_expected).epsilon(0.06));
  CHECK(latency == Approx(0.010).epsilon(0.01));
}

TEST_CASE("controller: measured latency rounds keep the bandwidth estimate right", "[controller]") {
  // Buckets whose exchanges did not overlap wait two latencies where the model counts one; the
  // bandwidth estimate, and with it the density, must not fall for it. Two rounds of 10 ms
  // exceed the compute as well: the transfer still gets its share.
  CHECK(latency_bound_density(latency_options, 2) == Approx(latency_bound_expected).epsilon(0.06));
}

TEST_CASE("density policies", "[controller]") {
  struct no_observe {
    double density() const noexcept { return 1; }
  };
  STATIC_REQUIRE(density_policy<adaptive_density_controller>);
  STATIC_REQUIRE(density_policy<fixed_density>);
  STATIC_REQUIRE_FALSE(density_policy<no_observe>);
  const exchange_cost_model model{.elements = 1'000'000,
                                  .ranks = 4,
                                  .bytes_per_element = 4,
                                  .header_bytes = 100,
                                  .latency_rounds = 3};
  // The model inverts itself.
  const double t = model.comm_seconds(0.02, 1e7, 0.01);
  CHECK(model.density_for(t, 1e7, 0.01) == Approx(0.02));
}

TEST_CASE("controller: a saved and restored controller decides as the original would",
          "[controller]") {
  // Mid-run with the latency being fitted (window, exploring countdown, held samples): the
  // restored copy must choose the same densities from the same measurements.
  const exchange_cost_model& model = latency_model;
  density_controller_options o = latency_options;
  o.latency_seconds = 0;
  adaptive_density_controller original(model, o);
  // Jitter for the first steps, then none: the density settles and the steps explore.
  auto measure = [&](double density, int i) {
    const double bytes = model.link_bytes(density);
    const double jitter = i < 23 ? 1.0 : 0.0;
    return step_measurement{.compute_seconds = 0.005 + jitter * 0.0002 * (i % 3),
                            .comm_seconds = 0.010 + bytes / 12.5e6 + jitter * 0.0003 * (i % 5),
                            .link_bytes = static_cast<std::uint64_t>(bytes)};
  };
  int i = 0;
  for (; i < 23; ++i) original.observe(measure(original.density(), i));
  // On to 20 steps after an exploring one: its sample has left the window (16) and the
  // countdown to the next exploring step is under way.
  int after = -1;
  for (; after < 20 && i < 200; ++i) {
    if (after >= 0) ++after;
    if (original.exploring()) after = 0;
    original.observe(measure(original.density(), i));
  }
  REQUIRE(after == 20);
  const state_kind kind = state_kind::of("TESTCTRL", 1);
  const auto bytes = save_state_bytes(
      kind, [&](state_writer& w) { w.record("POLI", [&](auto& r) { original.save(r); }); });
  adaptive_density_controller restored(model, o);
  state_reader rd(bytes, kind, "test");
  auto record = rd.next("POLI");
  restored.load(record);
  record.finish();
  rd.finish();
  int explored = 0;
  for (const int end = i + 60; i < end; ++i) {
    INFO("step " << i);
    explored += original.exploring() ? 1 : 0;
    REQUIRE(restored.density() == original.density());
    REQUIRE(restored.exploring() == original.exploring());
    REQUIRE(restored.latency() == original.latency());
    const auto m = measure(original.density(), i);
    original.observe(m);
    restored.observe(m);
  }
  CHECK(explored >= 2);
}
