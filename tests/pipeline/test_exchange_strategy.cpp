// SPDX-License-Identifier: Apache-2.0
// The exchange-strategy concept: the shipped strategies model it, a type missing one
// requirement does not, the minimal model of its documentation drives a pipeline, the one
// selection rule, and the run-time choice gives the same bits as the strategy it holds.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/pipeline/runtime_exchange.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"
#include "pipeline_support.hpp"

#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::pipeline_test;

namespace {

using topk = error_feedback_compressor<exact_topk_selector<>, float>;

// The minimal model of exchange_strategy.hpp: one rank that steps with its own gradient.
struct alone {
  using compressor_type = topk;
  using transport_type = in_process_transport;
  using value_type = float;
  using index_type = std::uint32_t;
  static constexpr bool takes_selections = false;

  explicit alone(in_process_transport& transport) : t(&transport) {}
  transport_type& transport() { return *t; }
  compressor_type& compressor() { return c; }
  void start(const pipeline_options&) {}
  template <class E>
  void add_bucket(std::span<const bucket_tensor> ts, E&) {
    buckets.emplace_back(ts.begin(), ts.end());
    grads.emplace_back();
  }
  template <class E>
  exchange_traffic encode(std::size_t b, std::int64_t, const bucket_input<float, std::uint32_t>& in,
                          E&) {
    grads[b].assign(in.gradient.begin(), in.gradient.end());
    return {};
  }
  template <class E>
  exchange_traffic exchange(std::size_t, std::int64_t, const bucket_input<float, std::uint32_t>&,
                            E&, report_sink) {
    return {};
  }
  template <class E>
  void decode(std::size_t, std::int64_t, E&, report_sink) {}
  template <class E>
  merged_update<std::uint32_t> update(std::size_t b, std::int64_t, std::size_t i, E&) {
    const auto& ts = buckets[b][i];
    return {.kind = aggregate_kind::dense,
            .dense = std::span<const float>(grads[b]).subspan(ts.offset, ts.size)};
  }
  exchange_shape shape() const { return {}; }
  std::vector<int> report_sources() const { return {0}; }
  void abort(std::string_view) noexcept {}

  in_process_transport* t;
  topk c;
  std::vector<std::vector<bucket_tensor>> buckets;
  std::vector<std::vector<float>> grads;
};

template <class P>
concept takes_selections = requires(P& p, sparse_view<const float, const std::uint32_t> v) {
  p.push_selection(0, v);
};

// The minimal model without `update`.
struct without_update : alone {
  template <class E>
  void update(std::size_t, std::int64_t, std::size_t, E&) = delete;
};

// The minimal model whose `abort` may throw.
struct throwing_abort : alone {
  void abort(std::string_view) {}
};

}  // namespace

TEST_CASE("exchange_strategy: the shipped strategies model it, an archetype does not",
          "[pipeline][strategy]") {
  STATIC_REQUIRE(exchange_strategy<flat_exchange<in_process_transport, topk>>);
  STATIC_REQUIRE(exchange_strategy<hierarchical_exchange<in_process_transport, topk>>);
  STATIC_REQUIRE(exchange_strategy<runtime_exchange<in_process_transport, topk>>);
  STATIC_REQUIRE(exchange_strategy<alone>);
  STATIC_REQUIRE_FALSE(exchange_strategy<without_update>);
  STATIC_REQUIRE_FALSE(exchange_strategy<throwing_abort>);
  STATIC_REQUIRE_FALSE(exchange_strategy<in_process_transport>);
  // The first constructor argument picks the strategy.
  STATIC_REQUIRE(std::is_same_v<exchange_for<in_process_transport, topk>::type,
                                flat_exchange<in_process_transport, topk>>);
  STATIC_REQUIRE(std::is_same_v<exchange_for<hierarchical_links<in_process_transport>, topk>::type,
                                hierarchical_exchange<in_process_transport, topk>>);
  // Selections handed over need a strategy that exchanges them as they are.
  STATIC_REQUIRE(takes_selections<
                 pipeline<flat_exchange<in_process_transport, topk>, thread_pool, sgd_optimizer>>);
  STATIC_REQUIRE_FALSE(
      takes_selections<
          pipeline<hierarchical_exchange<in_process_transport, topk>, thread_pool, sgd_optimizer>>);
}

TEST_CASE("exchange_strategy: the minimal model drives a pipeline (plain SGD on one rank)",
          "[pipeline][strategy]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(alone(t), pool, sgd_optimizer({.lr = 0.5f}), {.bucket_bytes = 16000, .staleness = 0},
               fixed_density{1.0});
    add_sizes(p, 0);
    p.start();
    REQUIRE(p.bucket_count() > 1);
    auto params = shaped_like_sizes();
    train(p, 0, 6, params);
    // Bit-identical to the same steps on the flat exchange with every element sent: one rank,
    // density 1, no quantisation, so the merged update is the gradient itself (staleness 0:
    // what a forward reads does not depend on timing).
    std::vector<std::vector<float>> flat_params = shaped_like_sizes();
    run_in_process(1, [&](in_process_transport& t2) {
      thread_pool pool2{1};
      pipeline q(t2, pool2, topk(), sgd_optimizer({.lr = 0.5f}),
                 {.bucket_bytes = 16000, .staleness = 0}, fixed_density{1.0});
      add_sizes(q, 0);
      q.start();
      train(q, 0, 6, flat_params);
    });
    require_same_bits(params, flat_params);
  });
}

TEST_CASE("selection_rule: one rule for every strategy", "[pipeline][strategy]") {
  const selection_rule r{.density = 0.01, .min_k = 5, .send_all_below = 100};
  CHECK(r.k(100, 100) == 100);   // small tensors go whole
  CHECK(r.k(100, 40) == 40);     // ... and so do their pieces
  CHECK(r.k(1000, 1000) == 10);  // ceil(density n)
  CHECK(r.k(1000, 250) == 5);    // at least min_k
  CHECK(r.k(1000, 3) == 3);      // at most n
  CHECK(r.k(100'000, 1001) == 11);
  const selection_rule all{.density = 1.0};
  CHECK(all.k(7, 7) == 7);
}

TEST_CASE("runtime_exchange: the same bits as the strategy it holds", "[pipeline][strategy]") {
  const auto topo = cluster_topology::parse("2,2");
  std::vector<std::vector<std::vector<float>>> direct(4), chosen(4);
  for (int way = 0; way < 2; ++way) {
    run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
      const int r = wan.rank();
      thread_pool pool{1};
      // Staleness 0: what a forward reads does not depend on timing, so two runs compare.
      const pipeline_options o{.bucket_bytes = 16000, .staleness = 0};
      auto params = shaped_like_sizes();
      if (way == 0) {
        pipeline p(hierarchical_links<in_process_transport>{lan, wan, topo}, pool, topk(),
                   sgd_optimizer({.lr = 0.1f}), o, fixed_density{0.1});
        add_sizes(p, r);
        p.start();
        train(p, r, 8, params);
        direct[static_cast<std::size_t>(r)] = params;
      } else {
        using exchange = runtime_exchange<in_process_transport, topk>;
        pipeline p(exchange(hierarchical_links<in_process_transport>{lan, wan, topo}, topk()), pool,
                   sgd_optimizer({.lr = 0.1f}), o, fixed_density{0.1});
        CHECK(p.exchange().hierarchical_setting());
        add_sizes(p, r);
        p.start();
        train(p, r, 8, params);
        chosen[static_cast<std::size_t>(r)] = params;
      }
    });
  }
  for (std::size_t r = 0; r < 4; ++r) require_same_bits(direct[r], chosen[r]);
}
