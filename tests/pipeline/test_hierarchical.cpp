// SPDX-License-Identifier: Apache-2.0
// The hierarchical pipeline (clusters joined by a WAN) over in-process ranks: bit-identical
// parameters on every rank of every cluster, the same training as the flat pipeline without
// compression, the edge cases of the topology (one cluster, one rank per cluster, clusters of
// unequal size, buckets smaller than a cluster), set-up checks and failures that reach every
// rank without a hang.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"
#include "pipeline_support.hpp"
#include "shuffling_transport.hpp"

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::pipeline_test;

namespace {

using params_t = std::vector<std::vector<float>>;

// Trains `steps` steps of the toy model on every rank of `topo`, hierarchically; returns every
// rank's final parameters (by global rank) and each rank's pipeline stats.
template <class Compressor>
std::vector<params_t> train_hierarchical(const cluster_topology& topo, Compressor (*make)(),
                                         double density, std::int64_t steps, pipeline_options opt,
                                         const std::vector<std::uint64_t>& tensor_sizes = sizes,
                                         std::vector<pipeline_stats>* stats = nullptr,
                                         std::size_t wan_chunk_bytes = std::size_t{256} << 10) {
  std::vector<params_t> result(static_cast<std::size_t>(topo.ranks()));
  if (stats) stats->assign(static_cast<std::size_t>(topo.ranks()), {});
  run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
    const int r = wan.rank();
    test::shuffling_transport<in_process_transport> shuffled(
        std::move(wan), 17 + static_cast<std::uint64_t>(r), std::chrono::microseconds(300),
        wan_chunk_bytes);
    using T = test::shuffling_transport<in_process_transport>;
    // Both tiers of one type: the LAN shuffled too.
    T shuffled_lan(std::move(lan), 71 + static_cast<std::uint64_t>(r),
                   std::chrono::microseconds(100));
    thread_pool pool{1};
    pipeline p(hierarchical_links<T>{shuffled_lan, shuffled, topo}, pool, make(),
               adam_optimizer({.lr = 1e-3f}), opt, fixed_density{density});
    for (std::size_t i = 0; i < tensor_sizes.size(); ++i)
      p.add_tensor(static_cast<std::uint32_t>(100 + i), initial_values(tensor_sizes[i], r, i));
    p.start();
    CHECK(p.ranks() == topo.ranks());
    params_t params;
    for (auto n : tensor_sizes) params.emplace_back(n);
    train(p, r, steps, params);
    result[static_cast<std::size_t>(r)] = std::move(params);
    if (stats) (*stats)[static_cast<std::size_t>(r)] = p.stats();
  });
  return result;
}

error_feedback_compressor<exact_topk_selector<>, float> exact_float() { return {}; }

void require_identical(const std::vector<params_t>& result) {
  for (std::size_t r = 1; r < result.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(result[r] == result[0]);
  }
}

}  // namespace

TEST_CASE("hierarchical: every rank of 2 clusters of 2 holds bit-identical parameters",
          "[pipeline][hierarchical]") {
  const int staleness = GENERATE(0, 1);
  CAPTURE(staleness);
  std::vector<pipeline_stats> stats;
  const auto result = train_hierarchical(
      cluster_topology::parse("2,2"),
      +[] { return error_feedback_compressor<threshold_selector<>, bf16>(); }, 0.05, 30,
      {.bucket_bytes = 20000, .staleness = staleness, .exchange_threads = 2}, sizes, &stats);
  require_identical(result);
  // The parameters moved from rank 0's initial values.
  CHECK(result[0][0] != initial_values(sizes[0], 0, 0));
  for (const auto& s : stats) {
    CHECK(s.steps_applied == 30);
    CHECK(s.elements_sent > 0);
    CHECK(s.link_bytes > 0);
  }
}

TEST_CASE("hierarchical: the WAN messages in chunks give the same parameters as whole",
          "[pipeline][hierarchical]") {
  // Chunks of 100 bytes cut every selection into several (and one not a multiple of the
  // chunk); 0 sends each whole. Staleness 0: with 1 the forward pass may read a step's update
  // or not, as timing has it, and two runs need not agree.
  const auto run = [](std::size_t chunk) {
    return train_hierarchical(
        cluster_topology::parse("2,2"),
        +[] { return error_feedback_compressor<threshold_selector<>, bf16>(); }, 0.05, 12,
        {.bucket_bytes = 20000, .staleness = 0, .exchange_threads = 2}, sizes, nullptr, chunk);
  };
  const auto whole = run(0);
  require_identical(whole);
  const auto chunked = run(100);
  require_identical(chunked);
  CHECK(chunked[0] == whole[0]);
}

TEST_CASE("hierarchical: without compression it trains as the flat pipeline does",
          "[pipeline][hierarchical]") {
  const std::int64_t steps = 10;
  const pipeline_options opt{.bucket_bytes = 30000, .staleness = 0};
  const auto hier =
      train_hierarchical(cluster_topology::parse("2,2"), exact_float, 1.0, steps, opt);
  require_identical(hier);
  params_t flat;
  run_in_process(4, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               adam_optimizer({.lr = 1e-3f}), opt, fixed_density{1.0});
    for (std::size_t i = 0; i < sizes.size(); ++i)
      p.add_tensor(static_cast<std::uint32_t>(100 + i), initial_values(sizes[i], t.rank(), i));
    p.start();
    auto params = shaped_like_sizes();
    train(p, t.rank(), steps, params);
    if (t.rank() == 0) flat = std::move(params);
  });
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (std::size_t j = 0; j < sizes[i]; ++j) {
      // Sums of four gradients in another order: a few ulps, through Adam's normalisation.
      REQUIRE(hier[0][i][j] == Approx(flat[i][j]).epsilon(1e-4).margin(1e-5));
    }
  }
}

TEST_CASE("hierarchical: one cluster, one rank per cluster, unequal clusters, tiny buckets",
          "[pipeline][hierarchical]") {
  const std::string shape = GENERATE("4", "1,1,1,1", "3,1", "1,3", "2,1,3");
  CAPTURE(shape);
  const auto topo = cluster_topology::parse(shape);
  std::vector<pipeline_stats> stats;
  // Buckets of one tensor each; tensors of 1 and 2 elements have fewer elements than ranks.
  const std::vector<std::uint64_t> tensor_sizes{1000, 1, 2, 777, 5};
  const auto result = train_hierarchical(
      topo, +[] { return error_feedback_compressor<exact_topk_selector<>, fp16>(); }, 0.1, 12,
      {.bucket_bytes = 0, .staleness = 1, .min_k = 1}, tensor_sizes, &stats);
  require_identical(result);
  for (int r = 0; r < topo.ranks(); ++r) {
    INFO("rank " << r);
    if (topo.clusters() == 1) {
      CHECK(stats[static_cast<std::size_t>(r)].link_bytes == 0);  // nothing crosses a WAN
    }
  }
  // Every element of the 1-element tensor got an update (min_k): it moved.
  CHECK(result[0][1][0] != initial_values(1, 0, 1)[0]);
}

TEST_CASE("hierarchical: WAN bytes per cluster are those of one selection",
          "[pipeline][hierarchical]") {
  // Equal density, 2 clusters of 2: a flat rank sends its selection to the 2 ranks of the
  // other cluster, so a cluster's uplink carries 4 selections; hierarchically each owner sends
  // its half-bucket selection once, so the uplink carries 1.
  std::vector<pipeline_stats> hier;
  const std::vector<std::uint64_t> big{200000, 100000};
  (void)train_hierarchical(cluster_topology::parse("2,2"), exact_float, 0.01, 4,
                           {.bucket_bytes = 0, .staleness = 0}, big, &hier);
  std::vector<std::uint64_t> flat_bytes(4);
  run_in_process(4, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, float>(),
               adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 0, .staleness = 0},
               fixed_density{0.01});
    for (std::size_t i = 0; i < big.size(); ++i)
      p.add_tensor(static_cast<std::uint32_t>(100 + i), initial_values(big[i], t.rank(), i));
    p.start();
    params_t params;
    for (auto n : big) params.emplace_back(n);
    train(p, t.rank(), 4, params);
    flat_bytes[static_cast<std::size_t>(t.rank())] = p.stats().bytes_sent;
  });
  // Cluster 0's uplink: ranks 0 and 1, each sending to the other cluster's 2 ranks.
  const double flat_uplink = 2.0 * static_cast<double>(flat_bytes[0] + flat_bytes[1]);
  const double hier_uplink = static_cast<double>(hier[0].link_bytes + hier[1].link_bytes);
  CHECK(hier_uplink <= flat_uplink / 2 + 4 * 200.0);  // at most 1/G, plus headers
  CHECK(hier_uplink >= flat_uplink / 4 * 0.9);        // and about 1/G^2 here
}

TEST_CASE("hierarchical: a topology that differs between ranks fails on every rank at start",
          "[pipeline][hierarchical]") {
  std::vector<std::string> errors(4);
  const auto topo = cluster_topology::parse("2,2");
  run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
    const int r = wan.rank();
    thread_pool pool{1};
    // Rank 1 believes in clusters of 3 and 1.
    const auto mine = r == 1 ? cluster_topology::parse("3,1") : topo;
    pipeline p(hierarchical_links<in_process_transport>{lan, wan, mine}, pool,
               error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer({.lr = 0.1f}), {.timeout = std::chrono::milliseconds(20000)},
               fixed_density{0.1});
    p.add_tensor(1, std::vector<float>(100, 1.0f));
    try {
      p.start();
    } catch (const error& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    CHECK(errors[static_cast<std::size_t>(r)].find("rank 1 has the clusters 3,1, rank 0 2,2") !=
          std::string::npos);
  }
  // A topology of another world size: a clear error on that rank, a peer failure elsewhere.
  std::vector<std::string> errors2(4);
  run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
    const int r = wan.rank();
    thread_pool pool{1};
    const auto mine = r == 3 ? cluster_topology::parse("2,3") : topo;
    pipeline p(hierarchical_links<in_process_transport>{lan, wan, mine}, pool,
               error_feedback_compressor<exact_topk_selector<>, float>(),
               sgd_optimizer({.lr = 0.1f}), {.timeout = std::chrono::milliseconds(20000)},
               fixed_density{0.1});
    p.add_tensor(1, std::vector<float>(100, 1.0f));
    try {
      p.start();
    } catch (const error& e) {
      errors2[static_cast<std::size_t>(r)] = e.what();
    }
  });
  CHECK(errors2[3].find("the clusters 2,3 hold 5 ranks, the WAN transport has 4") !=
        std::string::npos);
  for (int r = 0; r < 3; ++r) CHECK_FALSE(errors2[static_cast<std::size_t>(r)].empty());
}

TEST_CASE("hierarchical: a rank that dies in either tier fails every rank, without a hang",
          "[pipeline][hierarchical]") {
  const auto topo = cluster_topology::parse("2,2");
  const int dying = GENERATE(0, 3);
  CAPTURE(dying);
  std::vector<std::string> errors(4);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS(
      run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
        const int r = wan.rank();
        thread_pool pool{1};
        pipeline p(
            hierarchical_links<in_process_transport>{lan, wan, topo}, pool,
            error_feedback_compressor<exact_topk_selector<>, float>(), sgd_optimizer({.lr = 0.1f}),
            {.bucket_bytes = 16000, .staleness = 1, .timeout = std::chrono::milliseconds(20000)},
            fixed_density{0.1});
        for (std::size_t i = 0; i < sizes.size(); ++i)
          p.add_tensor(static_cast<std::uint32_t>(i), initial_values(sizes[i], r, i));
        p.start();
        auto params = shaped_like_sizes();
        try {
          train(p, r, 5, params);
          if (r == dying) throw std::runtime_error("rank died");  // its transports are aborted
          train(p, r, 25, params);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
          throw;
        }
      }));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(seconds < 15.0);  // well inside the 20 s timeout: the abort reached every rank
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << errors[static_cast<std::size_t>(r)]);
    CHECK_FALSE(errors[static_cast<std::size_t>(r)].empty());
  }
}

TEST_CASE("cluster_topology: parsing, numbering and bad input", "[pipeline][hierarchical]") {
  const auto t = cluster_topology::parse("3,1,2");
  CHECK(t.clusters() == 3);
  CHECK(t.ranks() == 6);
  CHECK(t.to_string() == "3,1,2");
  CHECK(t.cluster_of(0) == 0);
  CHECK(t.cluster_of(3) == 1);
  CHECK(t.cluster_of(5) == 2);
  CHECK(t.local_rank(5) == 1);
  CHECK(t.global_rank(2, 0) == 4);
  CHECK(t.first_rank(1) == 3);
  CHECK(cluster_topology::flat(3) == cluster_topology::parse("1,1,1"));
  CHECK(cluster_topology::single(4).clusters() == 1);
  for (const char* bad : {"", ",", "2,", ",2", "2,,2", "2x", "2 2", "0,2", "-1,2", "99999999999"})
    CHECK_THROWS_AS(cluster_topology::parse(bad), error);
  CHECK_THROWS_AS(cluster_topology(std::vector<int>{}), error);
  CHECK_THROWS_AS(t.cluster_of(6), error);
  CHECK_THROWS_AS(t.global_rank(1, 1), error);
  CHECK_THROWS_AS(t.check_world(5), error);
  CHECK_NOTHROW(t.check_world(6));
  CHECK(cluster_topology::from_environment(3, "STELLATRAIN_TEST_UNSET_VARIABLE") ==
        cluster_topology::flat(3));
  ::setenv("STELLATRAIN_TEST_CLUSTERS", "2,2", 1);
  CHECK(cluster_topology::from_environment(4, "STELLATRAIN_TEST_CLUSTERS") ==
        cluster_topology::parse("2,2"));
  CHECK_THROWS_WITH(cluster_topology::from_environment(5, "STELLATRAIN_TEST_CLUSTERS"),
                    Catch::Contains("hold 4 ranks, the world has 5"));
  ::setenv("STELLATRAIN_TEST_CLUSTERS", "2;2", 1);
  CHECK_THROWS_WITH(cluster_topology::from_environment(4, "STELLATRAIN_TEST_CLUSTERS"),
                    Catch::Contains("STELLATRAIN_TEST_CLUSTERS"));
}
