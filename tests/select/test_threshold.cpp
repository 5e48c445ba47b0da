// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/threshold.hpp>

#include "select_test_support.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

// A gradient that drifts slowly: x_{t+1} = 0.95 x_t + 0.31 noise, with a scale that wanders
// by about 2% a step.
class drifting_gradient {
 public:
  drifting_gradient(std::uint64_t n, std::uint64_t seed) : x_(n), rng_(seed) {
    for (auto& v : x_) v = dist_(rng_);
  }
  const std::vector<float>& next() {
    scale_ *= 1.0f + 0.02f * dist_(rng_);
    for (auto& v : x_) v = 0.95f * v + 0.31f * scale_ * dist_(rng_);
    return x_;
  }

 private:
  std::vector<float> x_;
  std::mt19937_64 rng_;
  std::normal_distribution<float> dist_{0.0f, 1.0f};
  float scale_ = 1.0f;
};

template <class Arch, class T, class Ex>
std::vector<std::uint64_t> run_threshold(threshold_selector<Arch>& sel, Ex& ex,
                                         threshold_state& state, const std::vector<T>& x,
                                         std::uint64_t k, selection_stats* stats = nullptr) {
  const std::uint64_t m = std::min<std::uint64_t>(k, x.size());
  std::vector<std::uint32_t> idx(m);
  std::vector<T> val(m);
  const auto st = sel.select(ex, state, std::span<const T>(x), k, std::span(idx), std::span(val));
  require_valid_selection<T, std::uint32_t>(x, k, idx, val, st.count);
  if (stats) *stats = st;
  return as_u64<std::uint32_t>(idx, st.count);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("threshold selection is exact at edge sizes and on the first call",
                        "[select][threshold]", test_archs) {
  inline_executor ex;
  for (std::uint64_t n : {0, 1, 3, 4, 5, 7, 8, 9, 16, 17, 1000, 70'001}) {
    const auto x = gaussian(n, n + 3);
    for (std::uint64_t k :
         {std::uint64_t{0}, std::uint64_t{1}, n / 3, n > 0 ? n - 1 : 0, n, n + 2}) {
      CAPTURE(n, k);
      threshold_selector<TestType> sel;
      threshold_state state;
      REQUIRE(run_threshold(sel, ex, state, x, k) == reference_topk_indices<float>(x, k));
      // Same input again: the persistent bound gives the exact answer in one pass.
      selection_stats st;
      REQUIRE(run_threshold(sel, ex, state, x, k, &st) == reference_topk_indices<float>(x, k));
      REQUIRE(st.exact);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("threshold selection stays exact on a slowly drifting gradient",
                        "[select][threshold]", test_archs) {
  const std::uint64_t n = 300'007;
  const std::uint64_t k = 3000;
  drifting_gradient grad(n, 21);
  threshold_selector<TestType> sel;
  threshold_state state;
  inline_executor ex;
  for (int step = 0; step < 40; ++step) {
    CAPTURE(step);
    const auto& x = grad.next();
    selection_stats st;
    const auto got = run_threshold(sel, ex, state, x, k, &st);
    REQUIRE(st.passes == 1);
    REQUIRE(st.exact);
    REQUIRE(got == reference_topk_indices<float>(x, k));
  }
  REQUIRE(state.bootstraps == 1);
  REQUIRE(state.deficits == 0);
  REQUIRE(state.fallbacks == 0);
  REQUIRE(state.calls == 40);
}

TEST_CASE("threshold selection keeps >= 0.99 of the top-k energy on i.i.d. Gaussian gradients",
          "[select][threshold]") {
  const std::uint64_t n = 1 << 20;
  const std::uint64_t k = n / 100;
  threshold_selector<> sel;
  threshold_state state;
  thread_pool pool(2);
  for (std::uint64_t step = 0; step < 12; ++step) {
    const auto x = gaussian(n, 100 + step);
    const auto got = run_threshold(sel, pool, state, x, k);
    const auto best = reference_topk_indices<float>(x, k);
    const double e = energy_fraction<float, std::uint64_t>(x, got) /
                     energy_fraction<float, std::uint64_t>(x, best);
    CAPTURE(step, e);
    REQUIRE(e >= 0.99);
  }
}

TEMPLATE_LIST_TEST_CASE("threshold selection returns exactly k through sudden changes",
                        "[select][threshold]", test_archs) {
  const std::uint64_t n = 200'003;
  const std::uint64_t k = 2000;
  threshold_selector<TestType> sel;
  threshold_state state;
  inline_executor ex;
  auto x = gaussian(n, 5);
  run_threshold(sel, ex, state, x, k);
  SECTION("magnitudes shrink 3x: one approximate call without an extra pass, then exact again") {
    for (auto& v : x) v *= 0.3f;
    selection_stats st;
    const auto got = run_threshold(sel, ex, state, x, k, &st);
    REQUIRE(st.deficit);
    REQUIRE_FALSE(st.exact);
    REQUIRE(st.passes == 1);
    REQUIRE(got.size() == k);
    // The band's elements are all in; the counts below the band put the bound right.
    int calls = 0;
    do {
      REQUIRE(++calls <= 3);
      run_threshold(sel, ex, state, x, k, &st);
    } while (!st.exact);
    REQUIRE(run_threshold(sel, ex, state, x, k, &st) == reference_topk_indices<float>(x, k));
    REQUIRE(st.exact);
  }
  SECTION("magnitudes grow 20x: the band overflows, exact by full passes") {
    for (auto& v : x) v *= 20.0f;
    selection_stats st;
    REQUIRE(run_threshold(sel, ex, state, x, k, &st) == reference_topk_indices<float>(x, k));
    REQUIRE(st.fallback);
    REQUIRE(state.fallbacks == 1);
    REQUIRE(run_threshold(sel, ex, state, x, k, &st) == reference_topk_indices<float>(x, k));
    REQUIRE_FALSE(st.fallback);
  }
  SECTION("k grows beyond the band: bootstrap again") {
    selection_stats st;
    REQUIRE(run_threshold(sel, ex, state, x, 3 * k, &st) ==
            reference_topk_indices<float>(x, 3 * k));
    REQUIRE(state.bootstraps == 2);
    REQUIRE(run_threshold(sel, ex, state, x, k / 2, &st) ==
            reference_topk_indices<float>(x, k / 2));
    REQUIRE(state.bootstraps == 2);
  }
  SECTION("another tensor size bootstraps again") {
    const auto y = gaussian(n / 2, 6);
    REQUIRE(run_threshold(sel, ex, state, y, k) == reference_topk_indices<float>(y, k));
    REQUIRE(state.bootstraps == 2);
    REQUIRE(state.tensor_size == n / 2);
  }
  SECTION("an all-zero gradient: the zeros of lowest index") {
    std::vector<float> z(n, 0.0f);
    selection_stats st;
    REQUIRE(run_threshold(sel, ex, state, z, k, &st) == reference_topk_indices<float>(z, k));
    REQUIRE(run_threshold(sel, ex, state, z, k, &st) == reference_topk_indices<float>(z, k));
    REQUIRE(st.exact);
  }
}

TEST_CASE("threshold selection on fp16 and bf16 gradients", "[select][threshold]") {
  inline_executor ex;
  const std::uint64_t n = 150'001;
  for (std::uint64_t k : {std::uint64_t{10}, std::uint64_t{1500}}) {
    threshold_selector<> sel;
    threshold_state s16;
    threshold_state sb16;
    for (std::uint64_t step = 0; step < 4; ++step) {
      const auto h = gaussian<fp16>(n, 40 + step);
      const auto b = gaussian<bf16>(n, 50 + step);
      REQUIRE(run_threshold(sel, ex, s16, h, k) == reference_topk_indices<fp16>(h, k));
      REQUIRE(run_threshold(sel, ex, sb16, b, k) == reference_topk_indices<bf16>(b, k));
    }
    // A state bootstrapped on fp16 keys re-bootstraps for float input.
    const auto f = gaussian(n, 60);
    REQUIRE(run_threshold(sel, ex, s16, f, k) == reference_topk_indices<float>(f, k));
    REQUIRE(s16.element == dtype::f32);
  }
}

TEST_CASE("threshold selection: scalar and SIMD paths and thread counts agree; state copies resume",
          "[select][threshold]") {
  const std::uint64_t n = 400'009;
  const std::uint64_t k = 4000;
  drifting_gradient g1(n, 77);
  threshold_selector<scalar_arch> scalar;
  threshold_selector<> simd;
  threshold_state a;
  threshold_state b;
  inline_executor one;
  thread_pool pool(2);
  threshold_state saved;
  std::vector<std::vector<std::uint64_t>> after;
  for (int step = 0; step < 12; ++step) {
    const auto& x = g1.next();
    const auto ra = run_threshold(scalar, one, a, x, k);
    const auto rb = run_threshold(simd, pool, b, x, k);
    REQUIRE(ra == rb);
    REQUIRE(a.low_key == b.low_key);
    if (step == 5) saved = b;
    if (step > 5) after.push_back(rb);
  }
  // Replay from the saved state with a fresh selector: identical results.
  drifting_gradient g2(n, 77);
  for (int step = 0; step <= 5; ++step) g2.next();
  threshold_selector<> fresh;
  for (const auto& expected : after)
    REQUIRE(run_threshold(fresh, pool, saved, g2.next(), k) == expected);
}

TEST_CASE("threshold selection: ties at the k-th key spread over every thread's share",
          "[select][threshold]") {
  // Values on a grid of 1/8 that shift slightly from call to call: thousands of elements
  // share the k-th key, in every group of segments that a thread emits.
  const std::uint64_t n = 4'000'037;
  drifting_gradient g(n, 31);
  threshold_selector<> one_sel;
  threshold_selector<> pool_sel;
  threshold_state a;
  threshold_state b;
  inline_executor one;
  thread_pool pool(3);
  const std::uint64_t k = n / 100 + 777;
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    auto x = g.next();
    for (auto& v : x) v = std::round(v * 8.0f) / 8.0f;
    selection_stats st;
    const auto ra = run_threshold(one_sel, one, a, x, k);
    const auto rb = run_threshold(pool_sel, pool, b, x, k, &st);
    REQUIRE(ra == rb);
    REQUIRE(st.exact);
    REQUIRE(rb == reference_topk_indices<float>(x, k));
  }
  REQUIRE(b.bootstraps == 1);
}
