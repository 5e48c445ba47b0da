// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/batch/batch_split.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

using stellatrain::batch_bounds;
using stellatrain::compute_model;
using stellatrain::compute_sample;
using stellatrain::fit_compute_model;
using stellatrain::slowest_seconds;
using stellatrain::split_batch;

TEST_CASE("fit_compute_model recovers a line through noise and outliers") {
  std::mt19937 rng(7);
  std::normal_distribution<double> noise(0.0, 0.002);
  std::vector<compute_sample> samples;
  for (std::uint64_t b = 8; b <= 128; b += 8) {
    samples.push_back({b, 0.010 + 0.0005 * static_cast<double>(b) + noise(rng)});
  }
  // A quarter of the samples wildly off (stalls of 10x the step).
  for (std::size_t i = 0; i < samples.size(); i += 4) samples[i].seconds *= 10;
  const auto m = fit_compute_model(samples);
  CHECK(m.per_example == Approx(0.0005).epsilon(0.1));
  CHECK(m.fixed_seconds == Approx(0.010).margin(0.004));
  CHECK(m.examples_per_second(64) == Approx(64 / (0.010 + 0.032)).epsilon(0.1));
}

TEST_CASE("fit_compute_model falls back to a proportional model") {
  SECTION("one batch size only") {
    const std::vector<compute_sample> s{{32, 0.3}, {32, 0.32}, {32, 0.9}};
    const auto m = fit_compute_model(s);
    CHECK(m.fixed_seconds == 0);
    CHECK(m.per_example == Approx(0.32 / 32));
  }
  SECTION("batch sizes too close to measure a slope") {
    // 32 and 36 examples: the noise alone would make a slope of 0.01 s per example here.
    const std::vector<compute_sample> s{{32, 0.32}, {36, 0.36}, {32, 0.30}, {36, 0.40}};
    const auto m = fit_compute_model(s);
    CHECK(m.fixed_seconds == 0);
    CHECK(m.per_example == Approx(0.01).epsilon(0.02));
  }
  SECTION("a slope that noise made negative") {
    const std::vector<compute_sample> s{{16, 0.5}, {32, 0.4}, {64, 0.3}};
    const auto m = fit_compute_model(s);
    CHECK(m.fixed_seconds == 0);
    CHECK(m.per_example > 0);
  }
}

TEST_CASE("fit_compute_model rejects samples that measured nothing") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(fit_compute_model({}), Contains("no samples"));
  const std::vector<compute_sample> zero_batch{{0, 0.1}};
  CHECK_THROWS_WITH(fit_compute_model(zero_batch), Contains("sample 0"));
  for (double bad : {0.0, -1.0, std::nan(""), HUGE_VAL}) {
    const std::vector<compute_sample> s{{16, 0.1}, {32, bad}};
    CHECK_THROWS_WITH(fit_compute_model(s), Contains("sample 1"));
  }
}

TEST_CASE("split_batch gives a rank twice as slow half the examples") {
  const std::vector<compute_model> models{{0, 0.001}, {0, 0.001}, {0, 0.001}, {0, 0.002}};
  const auto b = split_batch(700, models);
  CHECK(b == std::vector<std::uint64_t>{200, 200, 200, 100});
  // The ideal: the batch over the sum of the throughputs, 700 / 3500 per second.
  CHECK(slowest_seconds(models, b) == Approx(0.2));
  const std::vector<std::uint64_t> equal{175, 175, 175, 175};
  CHECK(slowest_seconds(models, equal) / slowest_seconds(models, b) == Approx(1.75));
  CHECK_THROWS_AS(slowest_seconds(models, std::vector<std::uint64_t>{1, 2}), stellatrain::error);
}

TEST_CASE("split_batch is optimal over every split of a small batch") {
  const std::vector<compute_model> models{{0.003, 0.0011}, {0.010, 0.0004}, {0.0, 0.0023}};
  for (std::uint64_t global = 3; global <= 60; ++global) {
    const auto b = split_batch(global, models);
    REQUIRE(std::accumulate(b.begin(), b.end(), std::uint64_t{0}) == global);
    double best = HUGE_VAL;
    for (std::uint64_t x = 1; x + 2 <= global; ++x) {
      for (std::uint64_t y = 1; x + y + 1 <= global; ++y) {
        const std::vector<std::uint64_t> candidate{x, y, global - x - y};
        best = std::min(best, slowest_seconds(models, candidate));
      }
    }
    CHECK(slowest_seconds(models, b) == Approx(best).epsilon(1e-12));
  }
}

TEST_CASE("split_batch keeps its bounds and equal ranks equal") {
  const std::vector<compute_model> same(4, compute_model{0.01, 0.001});
  CHECK(split_batch(10, same) == std::vector<std::uint64_t>{2, 2, 3, 3});
  const std::vector<compute_model> models{{0, 0.001}, {0, 0.010}};
  // The slow rank would get 9 of 100; its lower bound holds it at 20.
  CHECK(split_batch(100, models, {.min_per_rank = 20}) == std::vector<std::uint64_t>{80, 20});
  CHECK(split_batch(100, models, {.min_per_rank = 1, .max_per_rank = 60}) ==
        std::vector<std::uint64_t>{60, 40});
  // 64-bit batches.
  const std::uint64_t huge = std::uint64_t{1} << 40;
  const auto b = split_batch(huge, same);
  CHECK(std::accumulate(b.begin(), b.end(), std::uint64_t{0}) == huge);
}

TEST_CASE("split_batch rejects what no split can meet") {
  using Catch::Matchers::Contains;
  const std::vector<compute_model> two(2, compute_model{0, 0.001});
  CHECK_THROWS_WITH(split_batch(10, {}), Contains("no ranks"));
  CHECK_THROWS_WITH(split_batch(1, two), Contains("cannot go to 2 ranks"));
  CHECK_THROWS_WITH(split_batch(10, two, {.min_per_rank = 1, .max_per_rank = 4}),
                    Contains("cannot go to 2 ranks"));
  CHECK_THROWS_WITH(split_batch(10, two, {.min_per_rank = 5, .max_per_rank = 4}),
                    Contains("min_per_rank exceeds"));
  for (compute_model bad : {compute_model{0, 0}, compute_model{-1, 0.1},
                            compute_model{0, std::nan("")}, compute_model{0, HUGE_VAL}}) {
    const std::vector<compute_model> models{{0, 0.001}, bad};
    CHECK_THROWS_WITH(split_batch(10, models), Contains("rank 1"));
  }
}
