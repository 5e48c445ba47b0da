// SPDX-License-Identifier: Apache-2.0
// The optimizer concepts, both ways.
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/optimizer_concepts.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "catch.hpp"

#include <cstdint>
#include <span>
#include <vector>

using namespace stellatrain;

namespace {

// The example of the concept's documentation: dense only.
struct plain_sgd {
  float lr = 0.1f;
  std::vector<std::vector<float>> p;
  std::size_t add_tensor(std::span<const float> x) {
    p.emplace_back(x.begin(), x.end());
    return p.size() - 1;
  }
  std::size_t tensor_count() const { return p.size(); }
  std::span<const float> params(std::size_t t) const { return p[t]; }
  template <executor E>
  step_report step(std::size_t t, std::span<const float> g, E&) {
    for (std::size_t i = 0; i < g.size(); ++i) p[t][i] -= lr * g[i];
    return {.updated = g.size()};
  }
};

// Sparse steps for 32-bit indices only: not a sparse_optimizer.
struct narrow_sparse : plain_sgd {
  using plain_sgd::step;
  template <executor E>
  step_report step(std::size_t, const sparse_view<const float, const std::uint32_t>&, E&) {
    return {};
  }
};

// Returns the wrong type from step.
struct void_step {
  std::size_t add_tensor(std::span<const float>) { return 0; }
  std::size_t tensor_count() const { return 0; }
  std::span<const float> params(std::size_t) const { return {}; }
  template <executor E>
  void step(std::size_t, std::span<const float>, E&) {}
};

// Has no way to read the parameters.
struct no_params {
  std::size_t add_tensor(std::span<const float>) { return 0; }
  std::size_t tensor_count() const { return 0; }
  template <executor E>
  step_report step(std::size_t, std::span<const float>, E&) {
    return {};
  }
};

}  // namespace

TEST_CASE("the shipped optimizers model both concepts", "[optim][concepts]") {
  STATIC_REQUIRE(dense_optimizer<sgd_optimizer>);
  STATIC_REQUIRE(sparse_optimizer<sgd_optimizer>);
  STATIC_REQUIRE(dense_optimizer<adam_optimizer>);
  STATIC_REQUIRE(sparse_optimizer<adam_optimizer>);
}

TEST_CASE("archetypes that miss a requirement do not model the concepts", "[optim][concepts]") {
  STATIC_REQUIRE(dense_optimizer<plain_sgd>);
  STATIC_REQUIRE_FALSE(sparse_optimizer<plain_sgd>);
  STATIC_REQUIRE(dense_optimizer<narrow_sparse>);
  STATIC_REQUIRE_FALSE(sparse_optimizer<narrow_sparse>);
  STATIC_REQUIRE_FALSE(dense_optimizer<void_step>);
  STATIC_REQUIRE_FALSE(dense_optimizer<no_params>);
  STATIC_REQUIRE_FALSE(dense_optimizer<int>);
  // The documented example works as written.
  plain_sgd opt;
  const auto t = opt.add_tensor(std::vector<float>{1.0f, 2.0f});
  inline_executor ex;
  opt.step(t, std::span<const float>(std::vector<float>{1.0f, 1.0f}), ex);
  CHECK(opt.params(t)[0] == 0.9f);
}
