// SPDX-License-Identifier: Apache-2.0
// The pipeline over 4 in-process ranks: bit-identical parameters on every rank with messages
// delivered in shuffled order, identity compression equal to plain data-parallel training,
// checkpoint and restore, failures that reach every rank, and the zero-copy hand-over.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"
#include "pipeline_support.hpp"
#include "shuffling_transport.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

using namespace stellatrain;

using namespace stellatrain::pipeline_test;

TEST_CASE("4 ranks hold bit-identical parameters after 50 steps with shuffled delivery",
          "[pipeline]") {
  const int ranks = 4;
  std::vector<std::vector<std::vector<float>>> result(ranks);
  std::vector<std::vector<step_measurement>> observed(ranks);
  const int staleness = GENERATE(0, 1);
  run_in_process(ranks, [&](in_process_transport& raw) {
    const int r = raw.rank();
    test::shuffling_transport<in_process_transport> t(
        std::move(raw), 99 + static_cast<std::uint64_t>(r), std::chrono::microseconds(800));
    thread_pool pool{2};
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-3f}),
               {.bucket_bytes = 20000, .staleness = staleness, .exchange_threads = 2},
               observing_density{0.05, &observed[static_cast<std::size_t>(r)]});
    // Every tensor id is the application's (the step reports travel in a control section).
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto id = i + 1 == sizes.size() ? 0xFFFFFFFFu : static_cast<std::uint32_t>(10 + i);
      p.add_tensor(id, initial_values(sizes[i], r, i));
    }
    p.start();
    CHECK(p.bucket_count() > 1);
    auto params = shaped_like_sizes();
    train(p, r, 50, params);
    CHECK(p.stats().steps_applied == 50);
    result[static_cast<std::size_t>(r)] = std::move(params);
  });
  for (int r = 1; r < ranks; ++r) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      REQUIRE(std::memcmp(result[0][t].data(), result[static_cast<std::size_t>(r)][t].data(),
                          sizes[t] * sizeof(float)) == 0);
    }
  }
  // Training moved the parameters away from rank 0's initial values.
  CHECK(result[0][0] != initial_values(sizes[0], 0, 0));
  // Every rank's policy observed the same measurements, nearly every step (the reports of the
  // last steps would travel in messages of steps that never come).
  CHECK(observed[0].size() >= 45);
  for (int r = 1; r < ranks; ++r) {
    const auto& o = observed[static_cast<std::size_t>(r)];
    REQUIRE(o.size() == observed[0].size());
    for (std::size_t i = 0; i < o.size(); ++i) {
      CHECK(o[i].comm_seconds == observed[0][i].comm_seconds);
      CHECK(o[i].compute_seconds == observed[0][i].compute_seconds);
      CHECK(o[i].link_bytes == observed[0][i].link_bytes);
    }
  }
}

// An evaluation between steps is no compute: the density policy sees the steps' compute
// without the time the application excludes, and with it where it does not. Steps with and
// without the exclusion alternate in one run, so that a loaded machine slows both alike.
TEST_CASE("pipeline: time excluded from compute does not reach the policy", "[pipeline]") {
  const auto pause = std::chrono::milliseconds(100);
  const int steps = 12;
  std::vector<std::vector<step_measurement>> observed(2);
  run_in_process(2, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 20000, .staleness = 0},
               observing_density{0.05, &observed[static_cast<std::size_t>(r)]});
    add_sizes(p, r);
    p.start();
    auto params = shaped_like_sizes();
    for (int step = 0; step < steps; ++step) {
      train(p, r, 1, params);
      const auto t0 = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(pause);  // the evaluation
      if (step % 2 == 0) {
        p.exclude_from_compute(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
  });
  // Observation j is of step j, whose compute began when step j - 1 was handed over: after an
  // excluded pause for odd j, after a counted one for even j > 0.
  std::vector<double> excluded, counted;
  for (std::size_t j = 1; j < observed[0].size(); ++j)
    (j % 2 == 1 ? excluded : counted).push_back(observed[0][j].compute_seconds);
  REQUIRE(excluded.size() >= 4);
  REQUIRE(counted.size() >= 4);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  CAPTURE(excluded, counted);
  CHECK(median(counted) >= 0.1);
  CHECK(median(counted) - median(excluded) >= 0.08);
}

TEST_CASE("pipeline: exclude_from_compute rejects a negative time", "[pipeline]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 20000}, fixed_density{0.05});
    CHECK_THROWS_AS(p.exclude_from_compute(-1.0), stellatrain::error);
    CHECK_THROWS_AS(p.exclude_from_compute(std::nan("")), stellatrain::error);
    p.exclude_from_compute(0.5);
  });
}

// Staleness 0: each forward reads exactly the updates through the step before, so two runs
// compute the same gradients (with 1 a forward may or may not see the latest update).
TEST_CASE("zero-copy hand-over trains exactly as the copying one", "[pipeline]") {
  const int ranks = 4;
  auto run = [&](handover mode) {
    std::vector<std::vector<float>> rank0;
    run_in_process(ranks, [&](in_process_transport& t) {
      const int r = t.rank();
      thread_pool pool{1};
      pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
                 adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 20000, .staleness = 0},
                 fixed_density{0.05});
      add_sizes(p, r);
      p.start();
      auto params = shaped_like_sizes();
      train(p, r, 20, params, mode);
      CHECK(p.stats().steps_applied == 20);
      if (r == 0) rank0 = std::move(params);
    });
    return rank0;
  };
  const auto copied = run(handover::copy);
  const auto zero_copy = run(handover::zero_copy);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    REQUIRE(std::memcmp(copied[t].data(), zero_copy[t].data(), sizes[t] * sizeof(float)) == 0);
  }
  CHECK(copied[0] != initial_values(sizes[0], 0, 0));
}

TEST_CASE("identity compression equals plain data-parallel SGD on the averaged gradient",
          "[pipeline]") {
  const int ranks = 4;
  const std::int64_t steps = 12;
  const sgd_options sgd{.lr = 0.05f, .momentum = 0.9f, .nesterov = true};
  std::vector<std::vector<std::vector<float>>> result(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer(sgd), {.bucket_bytes = 30000, .staleness = 0}, fixed_density{1.0});
    add_sizes(p, r);
    p.start();
    auto params = shaped_like_sizes();
    train(p, r, steps, params);
    result[static_cast<std::size_t>(r)] = std::move(params);
  });
  // The reference: one process, the mean of the four ranks' gradients, the same optimizer.
  sgd_optimizer reference(sgd);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    reference.add_tensor(initial_values(sizes[i], 0, i));
  for (std::int64_t s = 0; s < steps; ++s) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto params = reference.params(i);
      std::vector<float> mean(sizes[i], 0.0f), g(sizes[i]);
      for (int r = 0; r < ranks; ++r) {
        gradient(params, r, s, i, g);
        for (std::size_t j = 0; j < g.size(); ++j) mean[j] += g[j];
      }
      for (auto& x : mean) x *= 0.25f;
      reference.step(i, std::span<const float>(mean));
    }
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto want = reference.params(i);
    for (std::size_t j = 0; j < sizes[i]; ++j) {
      // The pipeline sums the four gradients in another association order than the loop
      // above: a few ulps per step, compounded over 12 steps of momentum.
      REQUIRE(result[0][i][j] == Approx(want[j]).epsilon(1e-4).margin(1e-6));
    }
  }
}

namespace {

// The learning rate of step s in the schedule tests: changes every step, by up to 3x.
float scheduled_rate(std::int64_t s) { return 0.01f * static_cast<float>(1 + s % 3); }

// A gradient that does not read the parameters, so that the result of a schedule does not
// depend on which version a forward of staleness 1 saw: init - sum_s lr_s * mean_r g(r, s).
void fixed_gradient(int rank, std::int64_t step, std::size_t t, std::span<float> g) {
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = 0.001f * static_cast<float>((static_cast<std::int64_t>(i) * 7 + step * 13 + rank * 5 +
                                        static_cast<std::int64_t>(t)) %
                                       17) -
           0.008f;
  }
}

// Trains steps [first, last) of the schedule (setting each step's rate, except the first's
// when `rate_of_first` is false), then flushes and copies the parameters (unless `finish` is
// false: then the last steps may still be in flight, and nothing is returned).
template <class Pipeline>
std::vector<std::vector<float>> train_scheduled(Pipeline& p, int rank, std::int64_t first,
                                                std::int64_t last, bool rate_of_first = true,
                                                bool finish = true) {
  std::vector<std::vector<float>> params = shaped_like_sizes();
  std::vector<float> g;
  for (std::int64_t s = first; s < last; ++s) {
    for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
    if (s != first || rate_of_first) p.set_lr(scheduled_rate(s));
    for (std::size_t t = p.tensor_count(); t-- > 0;) {
      g.resize(sizes[t]);
      fixed_gradient(rank, s, t, g);
      p.push_gradient(t, g);
    }
  }
  if (!finish) return {};
  p.flush();
  for (std::size_t t = 0; t < p.tensor_count(); ++t) p.copy_params(t, params[t]);
  return params;
}

}  // namespace

// With staleness 1 the rate of step s + 1 is set while step s is still on the wire or being
// applied (the delivery is delayed and shuffled, the buckets apply on two threads): each step
// must still be applied at its own rate.
TEST_CASE("a learning-rate schedule applies each step at its own rate, steps in flight",
          "[pipeline]") {
  const int ranks = 3;
  const std::int64_t steps = 24;
  const int staleness = GENERATE(0, 1);
  std::vector<std::vector<std::vector<float>>> result(ranks);
  run_in_process(ranks, [&](in_process_transport& raw) {
    const int r = raw.rank();
    test::shuffling_transport<in_process_transport> t(
        std::move(raw), 7 + static_cast<std::uint64_t>(r), std::chrono::microseconds(1500));
    thread_pool pool{2};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer({.lr = 1.0f}),
               {.bucket_bytes = 20000, .staleness = staleness, .exchange_threads = 2},
               fixed_density{1.0});
    add_sizes(p, 0);
    p.start();
    REQUIRE(p.bucket_count() > 1);
    result[static_cast<std::size_t>(r)] = train_scheduled(p, r, 0, steps);
    CHECK(p.optimizer().options().lr == scheduled_rate(steps - 1));
  });
  std::vector<float> g;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    const std::vector<float> init = initial_values(sizes[t], 0, t);
    std::vector<double> want(init.begin(), init.end());
    g.resize(sizes[t]);
    for (std::int64_t s = 0; s < steps; ++s) {
      std::vector<double> mean(sizes[t], 0.0);
      for (int r = 0; r < ranks; ++r) {
        fixed_gradient(r, s, t, g);
        for (std::size_t j = 0; j < g.size(); ++j) mean[j] += g[j] / ranks;
      }
      for (std::size_t j = 0; j < g.size(); ++j) want[j] -= scheduled_rate(s) * mean[j];
    }
    for (int r = 0; r < ranks; ++r) {
      for (std::size_t j = 0; j < sizes[t]; ++j) {
        // One rate off by 0.01 at one step moves an element by up to 1e-4.
        REQUIRE(result[static_cast<std::size_t>(r)][t][j] == Approx(want[j]).margin(1e-5));
      }
    }
  }
}

TEST_CASE("a checkpoint holds the rate set for the step after it", "[pipeline]") {
  const int ranks = 2;
  auto make = [](in_process_transport& t, thread_pool& pool) {
    return pipeline(t, pool, error_feedback_compressor<threshold_selector<>, float>(),
                    adam_optimizer({.lr = 1.0f}), {.bucket_bytes = 20000, .staleness = 1},
                    fixed_density{0.1});
  };
  std::vector<std::vector<std::byte>> saved(ranks);
  std::vector<std::vector<std::vector<float>>> straight(ranks), restored(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{2};
    auto p = make(t, pool);
    add_sizes(p, r);
    p.start();
    (void)train_scheduled(p, r, 0, 7, true, false);
    // The next step's rate, set while step 6 is likely still in flight: saved with the state.
    p.set_lr(scheduled_rate(7));
    saved[static_cast<std::size_t>(r)] = p.save_checkpoint();
    straight[static_cast<std::size_t>(r)] = train_scheduled(p, r, 7, 12, false);
  });
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{2};
    auto p = make(t, pool);
    add_sizes(p, r);
    p.start();
    p.load_checkpoint(saved[static_cast<std::size_t>(r)]);
    restored[static_cast<std::size_t>(r)] = train_scheduled(p, r, 7, 12, false);
  });
  for (std::size_t r = 0; r < straight.size(); ++r) require_same_bits(straight[r], restored[r]);
}

namespace {

// Flips a bit in the middle of the payload of the first record tagged `tag` of a saved state
// (core/saved_state.hpp) and makes that record's checksum match again, so that only what is
// nested inside the payload can notice.
void corrupt_record_payload(std::vector<std::byte>& state, const char* tag) {
  std::size_t at = 32;
  while (at + 20 <= state.size() - 16) {
    std::uint64_t length;
    std::memcpy(&length, state.data() + at + 8, 8);
    if (std::memcmp(state.data() + at, tag, 4) == 0) {
      state[at + 16 + length / 2] ^= std::byte{1};
      const auto crc = crc32c(std::span<const std::byte>(state).subspan(at, 16 + length));
      std::memcpy(state.data() + at + 16 + length, &crc, 4);
      return;
    }
    at += 16 + length + 4;
  }
  FAIL("no record " << tag);
}

}  // namespace

// The density must not depend on wall-clock measurements here: an adaptive policy decides
// from timings, which differ between any two runs (restored or not).
TEST_CASE("a restored checkpoint continues bit-identically", "[pipeline]") {
  const int ranks = 4;
  auto make = [](in_process_transport& t, thread_pool& pool) {
    return pipeline(
        t, pool,
        error_feedback_compressor<threshold_selector<>, bf16, std::uint32_t, feedback::momentum>(
            {.momentum = 0.5f}),
        adam_optimizer({.lr = 1e-2f, .weight_decay = 0.01f}),
        {.bucket_bytes = 16000, .staleness = 0, .micro_batches = 2}, fixed_density{0.03});
  };
  auto train_micro = [](auto& p, int rank, std::int64_t steps) {
    std::vector<std::vector<float>> params = shaped_like_sizes();
    std::vector<float> g;
    for (std::int64_t s = 0; s < steps; ++s) {
      const std::int64_t step = p.steps_pushed();
      for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
      for (std::size_t t = 0; t < p.tensor_count(); ++t) p.copy_params(t, params[t]);
      for (int micro = 0; micro < 2; ++micro) {
        for (std::size_t t = p.tensor_count(); t-- > 0;) {
          g.resize(params[t].size());
          gradient(params[t], rank + 10 * micro, step, t, g);
          p.push_gradient(t, g);
        }
      }
    }
    p.flush();
    for (std::size_t t = 0; t < p.tensor_count(); ++t) p.copy_params(t, params[t]);
    return params;
  };
  std::vector<std::vector<std::byte>> saved(ranks);
  std::vector<std::vector<std::vector<float>>> straight(ranks), restored(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto p = make(t, pool);
    add_sizes(p, r);
    p.start();
    train_micro(p, r, 8);
    saved[static_cast<std::size_t>(r)] = p.save_checkpoint();
    straight[static_cast<std::size_t>(r)] = train_micro(p, r, 6);
  });
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto p = make(t, pool);
    add_sizes(p, 3 - r);
    p.start();
    // A corrupted blob is refused and changes nothing: neither one the container's checksums
    // catch, nor one whose optimizer state is refused after the compressor's was accepted.
    const auto before = p.save_checkpoint();
    auto bad = saved[static_cast<std::size_t>(r)];
    bad[bad.size() / 2] ^= std::byte{1};
    CHECK_THROWS_AS(p.load_checkpoint(bad), error);
    CHECK(p.save_checkpoint() == before);
    auto bad_optimizer = saved[static_cast<std::size_t>(r)];
    corrupt_record_payload(bad_optimizer, "OPTM");
    CHECK_THROWS_AS(p.load_checkpoint(bad_optimizer), error);
    CHECK(p.save_checkpoint() == before);
    p.load_checkpoint(saved[static_cast<std::size_t>(r)]);
    CHECK(p.steps_pushed() == 8);
    restored[static_cast<std::size_t>(r)] = train_micro(p, r, 6);
  });
  for (std::size_t r = 0; r < straight.size(); ++r) require_same_bits(straight[r], restored[r]);
}

using failing_compressor = failing<error_feedback_compressor<threshold_selector<>, float>>;
static_assert(compressor<failing_compressor>);

TEST_CASE("a failure in one rank's stage reaches every rank as an error, without a hang",
          "[pipeline]") {
  const int ranks = 4;
  std::vector<std::string> errors(ranks);
  std::vector<int> steps_done(ranks, 0);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    failing_compressor c;
    c.rank = r;
    c.fail_rank = 2;
    c.fail_at = 9;
    pipeline p(t, pool, std::move(c), sgd_optimizer({.lr = 0.1f}),
               {.bucket_bytes = 16000, .staleness = 1, .timeout = std::chrono::milliseconds(20000)},
               fixed_density{0.1});
    add_sizes(p, r);
    p.start();
    auto params = shaped_like_sizes();
    try {
      train(p, r, 30, params);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
    steps_done[static_cast<std::size_t>(r)] = static_cast<int>(p.stats().steps_applied);
  });
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    CHECK_FALSE(errors[static_cast<std::size_t>(r)].empty());
    CHECK(steps_done[static_cast<std::size_t>(r)] < 30);
  }
  CHECK(errors[2].find("injected failure") != std::string::npos);
}

TEST_CASE("pipeline rejects bad use with clear errors", "[pipeline]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    CHECK_THROWS_AS(pipeline(t, pool, error_feedback_compressor<threshold_selector<>, float>(),
                             sgd_optimizer(), {.staleness = 2}, fixed_density{}),
                    error);
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, float>(), sgd_optimizer(),
               {}, fixed_density{0.5});
    std::vector<float> init(10, 1.0f);
    CHECK_THROWS_AS(p.push_gradient(0, init), error);  // not started
    CHECK_THROWS_AS((void)p.gradient_buffer(0), error);
    CHECK_THROWS_AS(p.push_gradient_buffer(0), error);
    p.add_tensor(7, init);
    CHECK_THROWS_AS(p.add_tensor(7, init), error);  // duplicate id
    p.start();
    CHECK_THROWS_AS(p.add_tensor(8, init), error);  // after start
    std::vector<float> wrong(9);
    CHECK_THROWS_AS(p.push_gradient(0, wrong), error);
    CHECK_THROWS_AS(p.set_lr(-0.1f), error);
    CHECK_THROWS_AS(p.set_lr(std::nanf("")), error);
    p.push_gradient(0, init);
    p.flush();
    std::vector<float> out(10);
    p.copy_params(0, out);
    CHECK(out[0] != 1.0f);  // one SGD step on a single rank
  });
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<threshold_selector<>, float>(), sgd_optimizer(),
               {.micro_batches = 2}, fixed_density{0.5});
    p.add_tensor(7, std::vector<float>(10, 1.0f));
    p.start();
    CHECK_THROWS_AS((void)p.gradient_buffer(0), error);  // zero-copy needs one micro-batch
    CHECK_THROWS_AS(p.push_gradient_buffer(0), error);
    p.push_gradient(0, std::vector<float>(10, 1.0f));
    CHECK_THROWS_AS(p.set_lr(0.5f), error);  // in the middle of a step
    p.push_gradient(0, std::vector<float>(10, 1.0f));
    p.set_lr(0.5f);
    p.flush();
  });
}

TEST_CASE("pipeline: step reports count the latencies of the all-gather that runs",
          "[pipeline][reports]") {
  // 3 ranks: `automatic` runs the ring (above direct_max_ranks), P - 1 = 2 latencies in
  // sequence per exchange; `direct` one. One bucket, so one exchange span per step.
  for (const auto algorithm : {allgather_algorithm::automatic, allgather_algorithm::direct}) {
    const double expected = algorithm == allgather_algorithm::direct ? 1.0 : 2.0;
    std::vector<double> rounds(3, -1.0);
    run_in_process(3, [&](in_process_transport& t) {
      const int r = t.rank();
      thread_pool pool{1};
      pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
                 adam_optimizer({.lr = 1e-3f}),
                 {.bucket_bytes = std::uint64_t{1} << 30, .staleness = 0, .algorithm = algorithm},
                 fixed_density{0.1});
      add_sizes(p, r);
      p.start();
      REQUIRE(p.bucket_count() == 1);
      std::vector<std::vector<float>> params;
      for (auto n : sizes) params.emplace_back(n);
      train(p, r, 6, params);
      const auto [m, observed] = p.last_measurement();
      CHECK(observed > 0);
      rounds[static_cast<std::size_t>(r)] = m.latency_rounds;
    });
    for (const double x : rounds) CHECK(x == expected);
  }
}
