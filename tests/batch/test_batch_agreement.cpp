// SPDX-License-Identifier: Apache-2.0
// The batch split that ranks of different speeds agree on (4 in-process ranks): the same split
// on every rank from the same step, weighted averaging equal to the global batch's gradient,
// bad measurements and bad messages, and the sampler that follows the split.
#include <stellatrain/batch/batch_split_agreement.hpp>
#include <stellatrain/batch/split_sampler.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/in_process.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

using stellatrain::batch_split_agreement;
using stellatrain::batch_split_options;
using stellatrain::batch_weight;
using stellatrain::equal_split;
using stellatrain::in_process_transport;
using stellatrain::run_in_process;
using stellatrain::split_sampler;

namespace {

// What each rank saw after each step: the split of the next step, and whether it changed.
struct trace {
  std::vector<std::vector<std::uint64_t>> splits;
  std::vector<bool> changed;
};

// Ranks whose compute takes fixed + b * per_example[rank] seconds (with a little noise of
// their own), for `steps` steps.
std::vector<trace> simulate(const std::vector<double>& per_example, std::uint64_t steps,
                            const batch_split_options& o, double fixed = 0.002) {
  const int ranks = static_cast<int>(per_example.size());
  std::vector<trace> traces(per_example.size());
  run_in_process(ranks, [&](in_process_transport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    batch_split_agreement agreement(t, o);
    std::mt19937 rng(static_cast<unsigned>(r) + 11);
    std::uniform_real_distribution<double> noise(0.97, 1.03);
    for (std::uint64_t s = 0; s < steps; ++s) {
      const auto b = static_cast<double>(agreement.my_batch());
      const bool changed = agreement.end_step((fixed + b * per_example[r]) * noise(rng));
      traces[r].splits.push_back(agreement.split());
      traces[r].changed.push_back(changed);
    }
  });
  return traces;
}

}  // namespace

TEST_CASE("equal_split and batch_weight") {
  CHECK(equal_split(10, 4) == std::vector<std::uint64_t>{3, 3, 2, 2});
  CHECK(equal_split(8, 4) == std::vector<std::uint64_t>{2, 2, 2, 2});
  CHECK_THROWS(equal_split(8, 0));
  const std::vector<std::uint64_t> split{48, 48, 48, 16};
  CHECK(batch_weight(split, 0) == Approx(48.0 * 4 / 160));
  CHECK(batch_weight(split, 3) == Approx(16.0 * 4 / 160));
  CHECK(batch_weight(std::vector<std::uint64_t>{8, 8}, 1) == 1.0);
  CHECK_THROWS(batch_weight(split, 4));
  CHECK_THROWS(batch_weight(std::vector<std::uint64_t>{0, 0}, 0));
}

TEST_CASE("weighted averaging gives the gradient of the global batch") {
  // Per-example gradients of a 3-element model; each rank holds the mean over its examples.
  const std::vector<std::uint64_t> split{5, 1, 9, 3};
  const std::uint64_t total = 18;
  auto example_grad = [](std::uint64_t e, std::size_t k) {
    return std::sin(static_cast<double>(e * 3 + k)) * 2.0;
  };
  std::vector<double> want(3, 0.0);
  for (std::uint64_t e = 0; e < total; ++e)
    for (std::size_t k = 0; k < 3; ++k) want[k] += example_grad(e, k) / static_cast<double>(total);
  std::vector<std::vector<double>> got(split.size());
  run_in_process(4, [&](in_process_transport& t) {
    const auto r = static_cast<std::size_t>(t.rank());
    const std::uint64_t first = std::accumulate(split.begin(), split.begin() + t.rank(), 0ull);
    std::vector<double> g(3, 0.0);
    for (std::uint64_t e = first; e < first + split[r]; ++e)
      for (std::size_t k = 0; k < 3; ++k)
        g[k] += example_grad(e, k) / static_cast<double>(split[r]);
    const double w = batch_weight(split, r);
    for (auto& v : g) v *= w;
    stellatrain::dense_allreduce(t, std::span<double>(g), {.average = true});
    got[r] = g;
  });
  for (const auto& g : got)
    for (std::size_t k = 0; k < 3; ++k) CHECK(g[k] == Approx(want[k]).margin(1e-12));
  // Without the weights the plain mean of the ranks' means is another vector.
  double unweighted = 0;
  for (std::size_t r = 0, first = 0; r < split.size(); first += split[r], ++r) {
    double m = 0;
    for (std::uint64_t e = first; e < first + split[r]; ++e) m += example_grad(e, 0);
    unweighted += m / static_cast<double>(split[r]) / 4;
  }
  CHECK(std::fabs(unweighted - want[0]) > 1e-3);
}

TEST_CASE("every rank applies the same split from the same step, and it follows the speeds") {
  // Rank 3 computes 2x slower: the balanced split gives it half the others' batch.
  const std::vector<double> per_example{1e-3, 1e-3, 1e-3, 2e-3};
  const batch_split_options o{.global_batch = 128, .interval = 5, .window = 16};
  const auto traces = simulate(per_example, 40, o);
  for (std::size_t r = 1; r < traces.size(); ++r) {
    CHECK(traces[r].splits == traces[0].splits);
    CHECK(traces[r].changed == traces[0].changed);
  }
  for (std::size_t s = 0; s < traces[0].splits.size(); ++s) {
    const auto& split = traces[0].splits[s];
    CHECK(std::accumulate(split.begin(), split.end(), 0ull) == 128);
    // A change only ever comes with a decision step, and says so.
    const bool differs = s > 0 ? split != traces[0].splits[s - 1] : split != equal_split(128, 4);
    CHECK(differs == traces[0].changed[s]);
    // Decisions after 3 steps (first_decision), then every 5.
    if (differs) CHECK((s + 1 == 3 || (s + 1 > 3 && (s + 1 - 3) % o.interval == 0)));
  }
  // The first decision, after 3 steps, already balances the batches.
  CHECK(traces[0].changed[2]);
  const auto& last = traces[0].splits.back();
  // fixed + b * per_example equal on all ranks: 36.6/18.3 -> 37, 37, 36, 18 (or close).
  CHECK(last[3] >= 17);
  CHECK(last[3] <= 20);
  for (std::size_t r = 0; r < 3; ++r) CHECK(last[r] >= 35);
}

TEST_CASE("decisions come after first_decision steps, then every interval") {
  run_in_process(2, [&](in_process_transport& t) {
    auto decision_steps = [&](batch_split_options o) {
      batch_split_agreement agreement(t, o);
      std::vector<std::uint64_t> out;
      for (std::uint64_t s = 1; s <= 14; ++s) {
        if (agreement.is_decision_step(s)) out.push_back(s);
      }
      return out;
    };
    using v = std::vector<std::uint64_t>;
    CHECK(decision_steps({.global_batch = 8, .interval = 5}) == v{3, 8, 13});
    CHECK(decision_steps({.global_batch = 8, .interval = 5, .first_decision = 0}) == v{5, 10});
    CHECK(decision_steps({.global_batch = 8, .interval = 4, .first_decision = 6}) ==
          v{4, 8, 12});  // never later than the interval
    CHECK(decision_steps({.global_batch = 8, .interval = 1}) ==
          v{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14});
    // end_step makes its collective exactly in those steps.
    batch_split_agreement agreement(t, {.global_batch = 8, .interval = 5});
    for (int s = 0; s < 14; ++s) agreement.end_step(0.01);
    CHECK(agreement.decisions() == 3);
  });
}

TEST_CASE("equal ranks keep the equal split through noise") {
  const std::vector<double> per_example(4, 1e-3);
  const auto traces = simulate(per_example, 60, {.global_batch = 128, .interval = 5});
  for (const auto& split : traces[0].splits) CHECK(split == equal_split(128, 4));
}

TEST_CASE("a rank that reports no progress leaves the split as it is") {
  run_in_process(3, [&](in_process_transport& t) {
    batch_split_agreement agreement(t, {.global_batch = 30, .interval = 2});
    for (int s = 0; s < 8; ++s) {
      // Rank 2 measures nothing usable: zero, negative, NaN, infinite times.
      const double bad[] = {0.0, -1.0, std::nan(""), INFINITY};
      const double seconds = t.rank() == 2 ? bad[s % 4] : 0.01 * (1 + t.rank());
      CHECK_FALSE(agreement.end_step(seconds));
      CHECK(agreement.split() == equal_split(30, 3));
    }
    CHECK(agreement.steps() == 8);
    CHECK(agreement.rejected_samples() == (t.rank() == 2 ? 8u : 0u));
    CHECK(agreement.decisions() == 4);
    CHECK(agreement.models().empty());
  });
}

TEST_CASE("a malformed message of the agreement is an error, not a split") {
  using stellatrain::errc;
  const batch_split_options o{.global_batch = 20, .interval = 1};
  // Rank 1 takes part in the all-gather with bytes that are no list of samples.
  const std::vector<std::vector<std::byte>> bad{
      {std::byte{1}, std::byte{2}},        // shorter than a count
      std::vector<std::byte>(8 + 16 + 3),  // count 0, bytes left
      [] {                                 // a sample of batch 0
        std::vector<std::byte> m(8 + 16);
        m[0] = std::byte{1};
        m[16] = std::byte{0x3f};  // some bits of the seconds; the batch stays 0
        return m;
      }()};
  for (const auto& message : bad) {
    run_in_process(2, [&](in_process_transport& t) {
      if (t.rank() == 0) {
        batch_split_agreement agreement(t, o);
        try {
          (void)agreement.end_step(0.01);
          FAIL("no error");
        } catch (const stellatrain::error& e) {
          CHECK(e.code() == errc::malformed_message);
        }
      } else {
        std::vector<stellatrain::message_buffer> got(2);
        stellatrain::sparse_allgather(t, std::span<const std::byte>(message),
                                      std::span<stellatrain::message_buffer>(got),
                                      {.tag = o.tag, .algorithm = o.algorithm});
      }
    });
  }
}

TEST_CASE("batch_split_agreement rejects what it cannot do") {
  run_in_process(4, [&](in_process_transport& t) {
    using stellatrain::error;
    CHECK_THROWS_AS(batch_split_agreement(t, {.global_batch = 3}), error);  // < one per rank
    CHECK_THROWS_AS(batch_split_agreement(t, {.global_batch = 40, .bounds = {.max_per_rank = 9}}),
                    error);
    CHECK_THROWS_AS(batch_split_agreement(t, {.global_batch = 40, .bounds = {.min_per_rank = 11}}),
                    error);
    CHECK_THROWS_AS(batch_split_agreement(t, {.global_batch = 40, .interval = 0}), error);
    CHECK_THROWS_AS(batch_split_agreement(t, {.global_batch = 40, .min_gain = 1}), error);
    batch_split_agreement ok(
        t, {.global_batch = 40, .bounds = {.min_per_rank = 10, .max_per_rank = 10}});
    CHECK(ok.my_batch() == 10);
  });
}

TEST_CASE("split_sampler uses every example once per epoch whatever the splits") {
  const std::uint64_t count = 1000;
  const std::size_t ranks = 4;
  std::vector<split_sampler> samplers(ranks, split_sampler(count, 42));
  std::mt19937 rng(3);
  std::vector<std::uint64_t> seen_in_epoch0;
  std::vector<std::uint64_t> seen_in_epoch1;
  std::vector<std::uint64_t> idx;
  std::uint64_t used = 0;
  while (used < 2 * count) {
    std::vector<std::uint64_t> split(ranks);
    for (auto& b : split) b = 1 + rng() % 60;  // changes every step
    const std::uint64_t total = std::accumulate(split.begin(), split.end(), 0ull);
    for (std::size_t r = 0; r < ranks; ++r) {
      samplers[r].next(split, r, idx);
      REQUIRE(idx.size() == split[r]);
      for (std::size_t i = 0; i < idx.size(); ++i) {
        const std::uint64_t pos =
            used + std::accumulate(split.begin(), split.begin() + r, 0ull) + i;
        if (pos < count)
          seen_in_epoch0.push_back(idx[i]);
        else if (pos < 2 * count)
          seen_in_epoch1.push_back(idx[i]);
      }
    }
    used += total;
  }
  // Each epoch has an order of its own.
  CHECK(seen_in_epoch0 != seen_in_epoch1);
  for (auto* seen : {&seen_in_epoch0, &seen_in_epoch1}) {
    std::sort(seen->begin(), seen->end());
    std::vector<std::uint64_t> all(count);
    std::iota(all.begin(), all.end(), 0);
    CHECK(*seen == all);
  }
  // Each sampler counts the epochs and positions it went through.
  for (const auto& s : samplers) {
    CHECK(s.epoch() == used / count);
    CHECK(s.position() == used % count);
  }
  // Another seed gives another order.
  split_sampler a(count, 42);
  split_sampler b(count, 43);
  std::vector<std::uint64_t> ia;
  std::vector<std::uint64_t> ib;
  const std::vector<std::uint64_t> one{50};
  a.next(one, 0, ia);
  b.next(one, 0, ib);
  CHECK(ia != ib);
  CHECK_THROWS_AS(a.next(std::vector<std::uint64_t>{600, 401}, 0, ia), stellatrain::error);
  CHECK_THROWS_AS(a.next(one, 1, ia), stellatrain::error);
  CHECK_THROWS_AS(split_sampler(0, 1), stellatrain::error);
}
