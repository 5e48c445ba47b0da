// SPDX-License-Identifier: Apache-2.0
// Local steps: the outer step equals DiLoCo's on the (weighted) mean pseudo-gradient, every
// rank holds the same bits after each outer step (flat and hierarchical, chunked sections
// included), H = 1 is the per-step exchange, and bad use fails with clear errors.
#include <stellatrain/compress/chunked_compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/local_steps.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/pipeline/streaming_local_steps.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/threshold.hpp>
#include <stellatrain/transport/in_process.hpp>
#include <stellatrain/transport/shaping.hpp>

#include "catch.hpp"
#include "pipeline_support.hpp"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::pipeline_test;

namespace {

using params_t = std::vector<std::vector<float>>;

constexpr float inner_lr = 0.05f;

std::vector<std::span<float>> spans_of(params_t& p) {
  std::vector<std::span<float>> s;
  for (auto& t : p) s.emplace_back(t);
  return s;
}

// One inner step of plain SGD on every tensor of `replica`, with rank `rank`'s gradient of
// inner step `step`.
void inner_step(params_t& replica, int rank, std::int64_t step) {
  std::vector<float> g;
  for (std::size_t t = 0; t < replica.size(); ++t) {
    g.resize(replica[t].size());
    gradient(replica[t], rank, step, t, g);
    for (std::size_t i = 0; i < g.size(); ++i) replica[t][i] -= inner_lr * g[i];
  }
}

// Runs `outer_steps` outer steps of H inner steps on this rank; returns the replica after
// each outer step.
template <class Pipeline>
std::vector<params_t> train_local(Pipeline& p, int rank, std::uint32_t h, int outer_steps,
                                  double weight = 0, std::int64_t first_step = 0) {
  params_t replica = shaped_like_sizes();
  const auto spans = spans_of(replica);
  std::vector<params_t> after;
  std::int64_t step = first_step;
  // docs/guide/pipeline.md shows the lines between the "// [local_steps]" lines.
  // [local_steps]
  stellatrain::local_steps loop(p, {.inner_steps = h, .weight = weight});
  for (std::size_t t = 0; t < p.tensor_count(); ++t) p.copy_params(t, spans[t]);
  while (loop.outer_steps() < outer_steps) {
    inner_step(replica, rank, step++);  // forward, backward, the inner optimizer
    if (loop.step(spans)) {             // every H-th: the outer step, replica = outer
      after.push_back(replica);
    }
  }
  // [local_steps]
  return after;
}

void require_same_on_every_rank(const std::vector<std::vector<params_t>>& per_rank) {
  for (std::size_t r = 1; r < per_rank.size(); ++r) {
    REQUIRE(per_rank[r].size() == per_rank[0].size());
    for (std::size_t s = 0; s < per_rank[0].size(); ++s)
      require_same_bits(per_rank[r][s], per_rank[0][s]);
  }
}

// What one rank saw when an outer step threw: the outer step it threw in (from 1), whether its
// replica was left as it was, and the error.
struct outer_failure {
  int step = 0;
  bool replica_kept = false;
  std::string what;
};

// Outer steps of H = 2 on `p` until `outer_steps` are done or one throws, which is recorded in
// `out` and rethrown; `before(outer steps done)` runs before each inner step.
template <class Pipeline, class Before>
void train_until_failure(Pipeline& p, int rank, int outer_steps, outer_failure& out,
                         Before&& before) {
  params_t replica = shaped_like_sizes();
  const auto spans = spans_of(replica);
  for (std::size_t i = 0; i < p.tensor_count(); ++i) p.copy_params(i, spans[i]);
  local_steps loop(p, {.inner_steps = 2});
  std::int64_t step = 0;
  try {
    while (loop.outer_steps() < outer_steps) {
      before(static_cast<int>(loop.outer_steps()));
      inner_step(replica, rank, step++);
      const params_t kept = replica;
      try {
        loop.step(spans);
      } catch (...) {
        out.replica_kept = replica == kept;
        throw;
      }
    }
  } catch (const std::exception& e) {
    out.step = 1 + static_cast<int>(loop.outer_steps());
    out.what = e.what();
    throw;
  }
}

// Runs `ranks` (which must throw on some rank: the test fails otherwise); returns its seconds.
template <class Ranks>
double seconds_until_failure(Ranks&& ranks) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ranks();
    FAIL("no rank failed");
  } catch (const std::exception& e) {
    INFO(e.what());
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("local steps: the outer step is Nesterov SGD on the mean pseudo-gradient",
          "[pipeline][local_steps]") {
  const int ranks = 3;
  const std::uint32_t h = 4;
  const int outer_steps = 3;
  const bool weighted = GENERATE(false, true);
  CAPTURE(weighted);
  const std::vector<double> weights{0.5, 0.3, 0.2};
  const sgd_options outer_sgd{.lr = 0.7f, .momentum = 0.9f, .nesterov = true};
  std::vector<std::vector<params_t>> result(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    // Density 1 with fp32 values: the exchange is exact, the outer step is DiLoCo's.
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer(outer_sgd),
               {.bucket_bytes = 30000,
                .staleness = 0,
                .op = weighted ? reduction::sum : reduction::mean,
                .dense_threshold = 0},
               fixed_density{1.0});
    add_sizes(p, r);
    p.start();
    result[static_cast<std::size_t>(r)] =
        train_local(p, r, h, outer_steps, weighted ? weights[static_cast<std::size_t>(r)] : 0);
  });
  require_same_on_every_rank(result);

  // The reference, in one process: each rank's H inner steps from the outer parameters, the
  // (weighted) mean of outer - replica, one dense Nesterov step.
  sgd_optimizer reference(outer_sgd);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    reference.add_tensor(initial_values(sizes[i], 0, i));
  for (int o = 0; o < outer_steps; ++o) {
    params_t mean = shaped_like_sizes();
    for (int r = 0; r < ranks; ++r) {
      params_t replica;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const auto outer = reference.params(i);
        replica.emplace_back(outer.begin(), outer.end());
      }
      for (std::uint32_t k = 0; k < h; ++k) inner_step(replica, r, o * h + k);
      const float w = weighted ? static_cast<float>(weights[static_cast<std::size_t>(r)])
                               : 1.0f / static_cast<float>(ranks);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const auto outer = reference.params(i);
        for (std::size_t j = 0; j < sizes[i]; ++j) mean[i][j] += w * (outer[j] - replica[i][j]);
      }
    }
    for (std::size_t i = 0; i < sizes.size(); ++i)
      reference.step(i, std::span<const float>(mean[i]));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto want = reference.params(i);
      for (std::size_t j = 0; j < sizes[i]; ++j) {
        // Sums in another order and the pseudo-gradient's cancellation: a few ulps of the
        // parameters per outer step.
        REQUIRE(result[0][static_cast<std::size_t>(o)][i][j] ==
                Approx(want[j]).epsilon(1e-5).margin(1e-5));
      }
    }
  }
  // The outer steps moved the parameters.
  CHECK(result[0].back()[0] != initial_values(sizes[0], 0, 0));
}

TEST_CASE("local steps: every rank holds the same bits after each outer step",
          "[pipeline][local_steps]") {
  const bool hierarchical = GENERATE(false, true);
  CAPTURE(hierarchical);
  const std::uint32_t h = 3;
  const int outer_steps = 4;
  const sgd_options outer_sgd{.lr = 0.7f, .momentum = 0.9f, .nesterov = true};
  const pipeline_options opt{.bucket_bytes = 20000, .staleness = 1, .dense_threshold = 0};
  using compressor_t = error_feedback_compressor<threshold_selector<>, bf16>;
  std::vector<std::vector<params_t>> result(4);
  if (hierarchical) {
    const auto topo = cluster_topology::parse("2,2");
    run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
      const int r = wan.rank();
      thread_pool pool{1};
      pipeline p(hierarchical_links<in_process_transport>{lan, wan, topo}, pool, compressor_t(),
                 sgd_optimizer(outer_sgd), opt, fixed_density{0.05});
      add_sizes(p, r);
      p.start();
      result[static_cast<std::size_t>(r)] = train_local(p, r, h, outer_steps);
    });
  } else {
    run_in_process(4, [&](in_process_transport& t) {
      const int r = t.rank();
      thread_pool pool{1};
      pipeline p(t, pool, compressor_t(), sgd_optimizer(outer_sgd), opt, fixed_density{0.05});
      add_sizes(p, r);
      p.start();
      result[static_cast<std::size_t>(r)] = train_local(p, r, h, outer_steps);
    });
  }
  REQUIRE(result[0].size() == static_cast<std::size_t>(outer_steps));
  require_same_on_every_rank(result);
  // Each outer step changed the parameters.
  CHECK(result[0][0][0] != initial_values(sizes[0], 0, 0));
  for (int o = 1; o < outer_steps; ++o)
    CHECK(result[0][static_cast<std::size_t>(o)][0] !=
          result[0][static_cast<std::size_t>(o - 1)][0]);
}

// SparseLoCo's exchange: the chunked compressor (16 of every 256, 2-bit values, feedback decay
// 0.95) and a plain outer SGD of rate 1. The sections travel chunked: fewer bytes than the same
// density as bf16 values with delta indices.
TEST_CASE("local steps: chunked 2-bit sections, every rank the same bits",
          "[pipeline][local_steps]") {
  const std::uint32_t h = 3;
  const int outer_steps = 4;
  const double density = 16.0 / 256;
  const pipeline_options opt{.bucket_bytes = 20000, .staleness = 0};
  std::vector<std::vector<params_t>> chunked(4);
  std::vector<pipeline_stats> chunked_stats(4), bf16_stats(4);
  run_in_process(4, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    {
      pipeline p(
          t, pool,
          chunked_compressor<>({.chunk_bits = 8, .bits = chunk_value_bits::two, .decay = 0.95f}),
          sgd_optimizer({.lr = 1.0f}), opt, fixed_density{density});
      add_sizes(p, r);
      p.start();
      chunked[static_cast<std::size_t>(r)] = train_local(p, r, h, outer_steps);
      chunked_stats[static_cast<std::size_t>(r)] = p.stats();
    }
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               sgd_optimizer({.lr = 1.0f}),
               {.bucket_bytes = 20000, .staleness = 0, .tag_base = 30000}, fixed_density{density});
    add_sizes(p, r);
    p.start();
    train_local(p, r, h, outer_steps);
    bf16_stats[static_cast<std::size_t>(r)] = p.stats();
  });
  require_same_on_every_rank(chunked);
  for (int o = 1; o < outer_steps; ++o)
    CHECK(chunked[0][static_cast<std::size_t>(o)][4] !=
          chunked[0][static_cast<std::size_t>(o - 1)][4]);
  // 16 of every 256 in each tensor (all of a shorter last chunk's up to 16).
  CHECK(chunked_stats[0].elements_sent > 0);
  const double chunked_bytes = static_cast<double>(chunked_stats[0].bytes_sent);
  const double bf16_bytes = static_cast<double>(bf16_stats[0].bytes_sent);
  INFO("bytes per outer step: chunked " << chunked_bytes / outer_steps << ", bf16 top-k "
                                        << bf16_bytes / outer_steps);
  CHECK(chunked_bytes < 0.75 * bf16_bytes);
}

// The chunked compressor without its wire section: its selections travel as pairs, as any
// compressor's do.
struct chunked_as_pairs {
  using value_type = float;
  using index_type = std::uint32_t;
  chunked_compressor<> inner;
  template <executor E>
  void add_tensor(E& ex, std::uint32_t id, std::uint64_t n) {
    inner.add_tensor(ex, id, n);
  }
  template <executor E>
  selection_stats compress(E& ex, std::uint32_t id, std::span<const float> g, std::uint64_t k,
                           sparse_buffer<float>& out) {
    return inner.compress(ex, id, g, k, out);
  }
  [[nodiscard]] std::span<const float> residual(std::uint32_t id) const {
    return inner.residual(id);
  }
  [[nodiscard]] std::vector<std::byte> save_state() const { return inner.save_state(); }
  template <executor E>
  void load_state(E& ex, std::span<const std::byte> saved) {
    inner.load_state(ex, saved);
  }
};
static_assert(compressor<chunked_as_pairs> && !detail::packs_chunked<chunked_as_pairs>);

// The hierarchical exchange sends chunked sections between owners of the same shard (2,2) and
// pairs where shards overlap in part (3,1): every rank holds the same bits, the same as when
// every selection travels as pairs, and with fewer bytes over the WAN.
TEST_CASE("local steps: chunked sections in the hierarchical exchange", "[pipeline][local_steps]") {
  const char* clusters = GENERATE("2,2", "3,1");
  CAPTURE(clusters);
  const std::uint32_t h = 2;
  const int outer_steps = 3;
  const double density = 16.0 / 256;
  const chunked_compressor_options codec{
      .chunk_bits = 8, .bits = chunk_value_bits::two, .decay = 0.95f};
  const auto topo = cluster_topology::parse(clusters);
  std::vector<std::vector<params_t>> chunked(4), pairs(4);
  std::vector<pipeline_stats> chunked_stats(4), pairs_stats(4);
  run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
    const auto r = static_cast<std::size_t>(wan.rank());
    thread_pool pool{1};
    const hierarchical_links<in_process_transport> links{lan, wan, topo};
    {
      pipeline p(links, pool, chunked_compressor<>(codec), sgd_optimizer({.lr = 1.0f}),
                 {.bucket_bytes = 20000, .staleness = 0}, fixed_density{density});
      add_sizes(p, wan.rank());
      p.start();
      chunked[r] = train_local(p, wan.rank(), h, outer_steps);
      chunked_stats[r] = p.stats();
    }
    pipeline p(links, pool, chunked_as_pairs{chunked_compressor<>(codec)},
               sgd_optimizer({.lr = 1.0f}),
               {.bucket_bytes = 20000, .staleness = 0, .tag_base = 30000}, fixed_density{density});
    add_sizes(p, wan.rank());
    p.start();
    pairs[r] = train_local(p, wan.rank(), h, outer_steps);
    pairs_stats[r] = p.stats();
  });
  require_same_on_every_rank(chunked);
  for (int o = 0; o < outer_steps; ++o) {
    const auto at = static_cast<std::size_t>(o);
    require_same_bits(chunked[0][at], pairs[0][at]);
  }
  CHECK(chunked[0][1][4] != chunked[0][0][4]);
  const double chunked_bytes = static_cast<double>(chunked_stats[0].bytes_sent);
  const double pair_bytes = static_cast<double>(pairs_stats[0].bytes_sent);
  INFO("WAN bytes of rank 0: chunked " << chunked_bytes << ", pairs " << pair_bytes);
  if (topo.size_of(0) == topo.size_of(1)) {
    CHECK(chunked_bytes < 0.5 * pair_bytes);
  } else {
    CHECK(chunked_bytes == pair_bytes);
  }
}

// A hostile peer in the hierarchical exchange: once armed, it states one more element for a
// piece than the piece has. Its section is consistent in itself (the sender's checks pass: the
// same chunks, the same k per chunk, every index in range), so only the receiver, which knows
// each piece's length, can refuse it.
struct forging_chunked : chunked_compressor<> {
  using chunked_compressor<>::chunked_compressor;
  std::shared_ptr<std::atomic<bool>> armed = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<int>> forged = std::make_shared<std::atomic<int>>(0);
  [[nodiscard]] chunked_section wire_section(std::uint32_t id) const {
    chunked_section s = chunked_compressor<>::wire_section(id);
    const std::uint64_t chunk = std::uint64_t{1} << s.chunk_bits;
    const std::uint64_t last = s.dense_size % chunk;  // a partial last chunk of >= k elements
    int none = 0;  // the buckets' sections are written by several threads: forge one
    if (*armed && last != 0 && last >= s.k && forged->compare_exchange_strong(none, 1)) {
      ++s.dense_size;
    }
    return s;
  }
};
static_assert(compressor<forging_chunked> && detail::packs_chunked<forging_chunked>);

TEST_CASE("local steps: a forged piece from a peer fails every rank, nothing applied",
          "[pipeline][local_steps][validation]") {
  const auto topo = cluster_topology::parse("2,2");
  const int hostile = 2;  // in cluster 1; the owner of its shard in cluster 0 is rank 0
  std::vector<outer_failure> failures(4);
  int forged = 0;
  const double seconds = seconds_until_failure([&] {
    run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
      const int r = wan.rank();
      thread_pool pool{1};
      const hierarchical_links<in_process_transport> links{lan, wan, topo};
      forging_chunked c({.chunk_bits = 8, .bits = chunk_value_bits::two});
      const auto armed = c.armed;
      const auto count = c.forged;
      pipeline p(links, pool, std::move(c), sgd_optimizer({.lr = 1.0f}),
                 {.bucket_bytes = 20000, .staleness = 0, .timeout = std::chrono::seconds(20)},
                 fixed_density{16.0 / 256});
      add_sizes(p, r);
      p.start();
      try {
        train_until_failure(p, r, 4, failures[static_cast<std::size_t>(r)], [&](int done) {
          if (r == hostile && done == 1) *armed = true;
        });
      } catch (...) {
        if (r == hostile) forged = *count;
        throw;
      }
    });
  });
  CHECK(seconds < 20.0);
  CHECK(forged == 1);
  // The receiving cluster (ranks 0 and 1) fails in the second outer step with its replicas
  // kept. The hostile rank's cluster received whole, valid messages of that step and may
  // complete it before the failure reaches it (the exchange has no commit round), then fails
  // in the next one, again applying nothing of it.
  for (std::size_t r = 0; r < failures.size(); ++r) {
    const outer_failure& f = failures[r];
    CAPTURE(r, f.what);
    if (topo.cluster_of(static_cast<int>(r)) == 0) {
      CHECK(f.step == 2);
    } else {
      CHECK((f.step == 2 || f.step == 3));
    }
    CHECK(f.replica_kept);
  }
  // The receiver says what was wrong and who sent it.
  CHECK(failures[0].what.find("rank 2") != std::string::npos);
  CHECK(failures[0].what.find("size mismatch") != std::string::npos);
}

// With H = 1, an inner SGD of rate lr and a plain outer SGD of rate 1, the outer step applies
// the compressed mean of lr * g: the per-step exchange with SGD of rate lr. Random-k picks the
// same indices in both runs (a function of the step and tensor), so that rounding alone
// differs; with top-k, rounding could swap near-equal elements in and out of the selection.
TEST_CASE("local steps: H = 1 is the per-step exchange with SGD", "[pipeline][local_steps]") {
  const int ranks = 3;
  const int steps = 8;
  const double density = GENERATE(1.0, 0.1);
  CAPTURE(density);
  using compressor_t = error_feedback_compressor<random_k_selector<>, float>;
  std::vector<params_t> per_step(ranks);
  std::vector<std::vector<params_t>> local(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    {
      pipeline p(t, pool, compressor_t(random_k_selector<>(11)), sgd_optimizer({.lr = inner_lr}),
                 {.bucket_bytes = 30000, .staleness = 0}, fixed_density{density});
      add_sizes(p, r);
      p.start();
      params_t params = shaped_like_sizes();
      train(p, r, steps, params);
      per_step[static_cast<std::size_t>(r)] = std::move(params);
    }
    pipeline p(t, pool, compressor_t(random_k_selector<>(11)), sgd_optimizer({.lr = 1.0f}),
               {.bucket_bytes = 30000, .staleness = 0, .tag_base = 30000}, fixed_density{density});
    add_sizes(p, r);
    p.start();
    local[static_cast<std::size_t>(r)] = train_local(p, r, 1, steps);
  });
  require_same_on_every_rank(local);
  const params_t& got = local[0].back();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t j = 0; j < sizes[i]; ++j) {
      // outer - (outer - lr g) is lr g up to an ulp of the parameters, every step.
      REQUIRE(got[i][j] == Approx(per_step[0][i][j]).epsilon(1e-5).margin(1e-5));
    }
  }
}

TEST_CASE("local steps: bad use fails with clear errors", "[pipeline][local_steps]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    using compressor_t = error_feedback_compressor<exact_topk_selector<>, float>;
    pipeline unstarted(t, pool, compressor_t(), sgd_optimizer(), {}, fixed_density{1.0});
    add_sizes(unstarted, 0);
    auto what = [&](auto&& f) {
      try {
        f();
      } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        return std::string(e.what());
      }
      FAIL("no error");
      return std::string();
    };
    CHECK_THAT(what([&] { local_steps l(unstarted, {}); }),
               Catch::Matchers::Contains("start the outer pipeline first"));
    pipeline p(t, pool, compressor_t(), sgd_optimizer(), {.tag_base = 30000}, fixed_density{1.0});
    add_sizes(p, 0);
    p.start();
    CHECK_THAT(what([&] { local_steps l(p, {.inner_steps = 0}); }),
               Catch::Matchers::Contains("inner_steps"));
    CHECK_THAT(what([&] { local_steps l(p, {.weight = 0.5}); }),
               Catch::Matchers::Contains("reduction::sum"));
    local_steps loop(p, {.inner_steps = 2});
    params_t replica = shaped_like_sizes();
    replica.pop_back();
    CHECK_THAT(what([&] { loop.step(spans_of(replica)); }), Catch::Matchers::Contains("tensors"));
    replica = shaped_like_sizes();
    replica[2].resize(3);
    CHECK_THAT(what([&] { loop.step(spans_of(replica)); }),
               Catch::Matchers::Contains("tensor 2 of the replica has 3 elements"));
    CHECK(loop.inner_steps_done() == 0);
    p.flush();
  });
}

using failing_chunked = failing<chunked_compressor<>>;
static_assert(compressor<failing_chunked>);

// A checkpoint taken right after an outer step holds all the outer loop's state: the outer
// parameters and the outer optimizer's momentum, the chunked compressor's feedback.
TEST_CASE("local steps: a checkpoint after an outer step resumes bit-identically",
          "[pipeline][local_steps]") {
  const int ranks = 3;
  const std::uint32_t h = 2;
  auto make = [](in_process_transport& t, thread_pool& pool) {
    return pipeline(t, pool, chunked_compressor<>({.chunk_bits = 8, .decay = 0.95f}),
                    sgd_optimizer({.lr = 0.7f, .momentum = 0.9f, .nesterov = true}),
                    {.bucket_bytes = 20000, .staleness = 0, .dense_threshold = 0},
                    fixed_density{16.0 / 256});
  };
  std::vector<std::vector<std::byte>> saved(ranks);
  std::vector<std::vector<params_t>> straight(ranks), restored(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto p = make(t, pool);
    add_sizes(p, r);
    p.start();
    train_local(p, r, h, 2);
    saved[static_cast<std::size_t>(r)] = p.save_checkpoint();
    straight[static_cast<std::size_t>(r)] = train_local(p, r, h, 3, 0, 2 * h);
  });
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto p = make(t, pool);
    add_sizes(p, 2 - r);
    p.start();
    p.load_checkpoint(saved[static_cast<std::size_t>(r)]);
    restored[static_cast<std::size_t>(r)] = train_local(p, r, h, 3, 0, 2 * h);
  });
  for (std::size_t r = 0; r < straight.size(); ++r) {
    REQUIRE(restored[r].size() == straight[r].size());
    for (std::size_t o = 0; o < straight[r].size(); ++o)
      require_same_bits(straight[r][o], restored[r][o]);
  }
}

// A rank that fails in its outer exchange makes every rank's outer step throw, well within
// the timeout, and no rank's replica takes anything of that exchange.
TEST_CASE("local steps: a rank failing in the outer exchange fails every rank",
          "[pipeline][local_steps]") {
  const int ranks = 3;
  std::vector<outer_failure> failures(ranks);
  const double seconds = seconds_until_failure([&] {
    run_in_process(ranks, [&](in_process_transport& t) {
      const int r = t.rank();
      thread_pool pool{1};
      failing_chunked c({.chunk_bits = 8});
      c.rank = r;
      c.fail_rank = 1;
      c.fail_at = 2 * static_cast<int>(sizes.size()) + 1;  // in the third outer step
      pipeline p(t, pool, std::move(c), sgd_optimizer({.lr = 1.0f}),
                 {.bucket_bytes = 20000, .staleness = 0, .timeout = std::chrono::seconds(20)},
                 fixed_density{0.1});
      add_sizes(p, r);
      p.start();
      train_until_failure(p, r, 5, failures[static_cast<std::size_t>(r)], [](int) {});
    });
  });
  CHECK(seconds < 20.0);
  for (const outer_failure& f : failures) {
    CAPTURE(f.what);
    CHECK(f.step == 3);  // in the third outer step (2 done)
    CHECK(f.replica_kept);
  }
}

TEST_CASE("local steps: inner_steps_for", "[pipeline][local_steps]") {
  // x (1 - f) / (f c): 0.1 s of exchange at 10% next to 10 ms steps: 90 steps.
  CHECK(inner_steps_for(0.1, 0.01, 0.1, 1, 500, 7) == 90);
  CHECK(inner_steps_for(0.1, 0.01, 0.5, 1, 500, 7) == 10);
  CHECK(inner_steps_for(0.1, 0.03, 0.5, 1, 500, 7) == 4);  // 3.33 rounds up
  CHECK(inner_steps_for(0.1, 0.01, 0.1, 1, 50, 7) == 50);
  CHECK(inner_steps_for(0.0, 0.01, 0.1, 2, 50, 7) == 2);
  CHECK(inner_steps_for(0.1, 0.0, 0.1, 2, 50, 7) == 7);  // no compute measured
  CHECK(inner_steps_for(0.1, 0.0, 0.1, 8, 50, 7) == 8);
  CHECK(inner_steps_for(std::numeric_limits<double>::infinity(), 0.01, 0.1, 1, 50, 7) == 7);
}

// The controller on a link that changes: inner steps of 20 ms on a fast link need few of them
// per exchange, then the link drops to 3 Mbit/s (an exchange of the toy model's dense fp32
// pseudo-gradients then takes about 0.45 s, 11 steps of 40 ms, of 20 ms on a quiet machine)
// and H rises to its bound within three outer steps.
// Every rank chooses the same H at every outer step.
TEST_CASE("local steps: the controller follows the link, every rank alike",
          "[pipeline][local_steps]") {
  const int ranks = 3;
  const int fast_steps = 5;
  const int slow_steps = 4;
  std::vector<std::vector<std::uint32_t>> chosen(ranks);
  run_in_process(ranks, [&](in_process_transport& raw) {
    const int r = raw.rank();
    shaped_transport<in_process_transport> t(std::move(raw), {.bits_per_second = 0});
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer({.lr = 1.0f}), {.bucket_bytes = 1 << 20, .staleness = 0},
               fixed_density{1.0});
    add_sizes(p, r);
    p.start();
    params_t replica = shaped_like_sizes();
    const auto spans = spans_of(replica);
    for (std::size_t i = 0; i < p.tensor_count(); ++i) p.copy_params(i, spans[i]);
    local_steps loop(
        p, {.inner_steps = 4, .min_inner_steps = 1, .max_inner_steps = 8, .exchange_share = 0.5});
    std::int64_t step = 0;
    auto& mine = chosen[static_cast<std::size_t>(r)];
    while (loop.outer_steps() < fast_steps + slow_steps) {
      inner_step(replica, r, step++);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (loop.step(spans)) {
        mine.push_back(loop.inner_steps());
        if (loop.outer_steps() == fast_steps) t.set_rate(3e6);
      }
    }
  });
  for (int r = 1; r < ranks; ++r) CHECK(chosen[static_cast<std::size_t>(r)] == chosen[0]);
  INFO("H after each outer step: " << Catch::Detail::stringify(chosen[0]));
  REQUIRE(chosen[0].size() == static_cast<std::size_t>(fast_steps + slow_steps));
  // On the fast link an exchange takes milliseconds against 20 ms per inner step.
  CHECK(chosen[0][fast_steps - 1] <= 3);
  // Each rank sends 2 x 83 KB at 3 Mbit/s: about 0.45 s against steps of 20 to 40 ms.
  CHECK(chosen[0].back() == 8);
  CHECK(chosen[0][fast_steps + 2] == 8);
}

// With F = 1, tau = 0 and mix 0, streaming is local steps, to the bit.
TEST_CASE("streaming local steps: one fragment, no delay, are local steps",
          "[pipeline][local_steps][streaming]") {
  const int ranks = 3;
  const std::uint32_t h = 3;
  std::vector<params_t> plain(ranks), streamed(ranks);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto make = [&](tag_type tag_base) {
      return pipeline(
          t, pool, chunked_compressor<>({.chunk_bits = 8, .decay = 0.95f}),
          sgd_optimizer({.lr = 0.7f, .momentum = 0.9f, .nesterov = true}),
          {.bucket_bytes = 20000, .staleness = 0, .tag_base = tag_base, .dense_threshold = 0},
          fixed_density{16.0 / 256});
    };
    {
      auto p = make(4096);
      add_sizes(p, r);
      p.start();
      plain[static_cast<std::size_t>(r)] = train_local(p, r, h, 4).back();
    }
    auto p = make(30000);
    add_sizes(p, r);
    p.start();
    params_t replica = shaped_like_sizes();
    const auto spans = spans_of(replica);
    for (std::size_t i = 0; i < p.tensor_count(); ++i) p.copy_params(i, spans[i]);
    decltype(&p) fragments[] = {&p};
    streaming_local_steps loop(std::span<decltype(&p) const>(fragments), {.inner_steps = h});
    std::int64_t step = 0;
    while (loop.merges() < 4) {
      inner_step(replica, r, step++);
      loop.step(spans);
    }
    streamed[static_cast<std::size_t>(r)] = replica;
  });
  for (int r = 0; r < ranks; ++r)
    require_same_bits(streamed[static_cast<std::size_t>(r)], plain[static_cast<std::size_t>(r)]);
}

// Two fragments (tensors 0-2 and 3-5, a pipeline each) sent in turn every 4 inner steps,
// merged one inner step later with mix 0.25: each merge follows the rule, and every
// fragment's outer parameters are the same bits on every rank.
TEST_CASE("streaming local steps: fragments in turn, merged tau steps later",
          "[pipeline][local_steps][streaming]") {
  const int ranks = 3;
  const std::uint32_t h = 4;
  const std::uint32_t tau = 1;
  const float mix = 0.25f;
  const std::size_t split = 3;  // fragment 0: tensors 0..2, fragment 1: 3..5
  std::vector<std::vector<params_t>> outers(ranks);
  std::vector<int> merges_checked(ranks, 0);
  run_in_process(ranks, [&](in_process_transport& t) {
    const int r = t.rank();
    thread_pool pool{1};
    auto make = [&](tag_type tag_base) {
      return pipeline(
          t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
          sgd_optimizer({.lr = 0.7f, .momentum = 0.9f, .nesterov = true}),
          {.bucket_bytes = 20000, .staleness = 0, .tag_base = tag_base, .dense_threshold = 0},
          fixed_density{0.1});
    };
    auto p0 = make(4096);
    auto p1 = make(30000);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto& p = i < split ? p0 : p1;
      p.add_tensor(static_cast<std::uint32_t>(i), initial_values(sizes[i], r, i));
    }
    p0.start();
    p1.start();
    params_t replica = shaped_like_sizes();
    const auto spans = spans_of(replica);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      (i < split ? p0 : p1).copy_params(i < split ? i : i - split, spans[i]);
    decltype(&p0) fragments[] = {&p0, &p1};
    streaming_local_steps loop(std::span<decltype(&p0) const>(fragments),
                               {.inner_steps = h, .delay = tau, .mix = mix});
    CHECK(loop.offset(1) == 2);
    auto& mine = outers[static_cast<std::size_t>(r)];
    for (std::int64_t step = 0; step < 6 * static_cast<std::int64_t>(h); ++step) {
      inner_step(replica, r, step);
      const params_t before = replica;
      const std::int64_t t_next = step + 1;  // the inner step loop.step counts
      // Fragment f is sent when t = offset(f) (mod h), merged tau steps later.
      std::vector<std::size_t> due;
      for (std::size_t f = 0; f < 2; ++f) {
        if (t_next > tau && (t_next - tau) % h == loop.offset(f) % h) due.push_back(f);
      }
      CHECK(loop.step(spans) == due.size());
      for (std::size_t f : due) {
        auto& p = f == 0 ? p0 : p1;
        params_t outer;
        for (std::size_t i = 0; i < p.tensor_count(); ++i) {
          outer.emplace_back(p.tensor_size(i));
          p.copy_params(i, outer.back());
          const std::size_t g = f * split + i;
          for (std::size_t j = 0; j < outer.back().size(); ++j) {
            REQUIRE(replica[g][j] ==
                    Approx((1.0f - mix) * outer.back()[j] + mix * before[g][j]).epsilon(1e-6));
          }
        }
        mine.push_back(std::move(outer));
        ++merges_checked[static_cast<std::size_t>(r)];
      }
    }
    p0.flush();
    p1.flush();
  });
  require_same_on_every_rank(outers);
  CHECK(merges_checked[0] >= 10);
}

TEST_CASE("streaming local steps: bad use fails with clear errors",
          "[pipeline][local_steps][streaming]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    using compressor_t = error_feedback_compressor<exact_topk_selector<>, float>;
    pipeline p(t, pool, compressor_t(), sgd_optimizer(), {}, fixed_density{1.0});
    add_sizes(p, 0);
    p.start();
    decltype(&p) one[] = {&p};
    const std::span<decltype(&p) const> fragments(one);
    auto what = [&](streaming_options o) {
      try {
        streaming_local_steps l(fragments, o);
      } catch (const error& e) {
        CHECK(e.code() == errc::invalid_argument);
        return std::string(e.what());
      }
      FAIL("no error");
      return std::string();
    };
    CHECK_THAT(what({.inner_steps = 0}), Catch::Matchers::Contains("inner_steps"));
    CHECK_THAT(what({.inner_steps = 4, .delay = 4}), Catch::Matchers::Contains("delay"));
    CHECK_THAT(what({.inner_steps = 4, .mix = 1.0f}), Catch::Matchers::Contains("mix"));
    CHECK_THAT(what({.weight = 0.5}), Catch::Matchers::Contains("reduction::sum"));
    streaming_local_steps loop(fragments, {.inner_steps = 2});
    params_t replica = shaped_like_sizes();
    replica[1].resize(2);
    CHECK_THROWS_WITH(loop.step(spans_of(replica)),
                      Catch::Matchers::Contains("tensor 1 of the replica has 2 elements"));
    p.flush();
  });
}
