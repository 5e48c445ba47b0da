// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/sampled_threshold.hpp>

#include "select_test_support.hpp"

#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

template <class Arch, class T, class Ex>
std::vector<std::uint64_t> run_sampled(Ex& ex, const std::vector<T>& x, std::uint64_t k,
                                       sampled_threshold_options options = {},
                                       selection_stats* stats = nullptr) {
  sampled_threshold_selector<Arch> sel(options);
  const std::uint64_t m = std::min<std::uint64_t>(k, x.size());
  std::vector<std::uint32_t> idx(m);
  std::vector<T> val(m);
  const auto st = sel.select(ex, std::span<const T>(x), k, std::span(idx), std::span(val));
  require_valid_selection<T, std::uint32_t>(x, k, idx, val, st.count);
  if (stats) *stats = st;
  return as_u64<std::uint32_t>(idx, st.count);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("sampled threshold: exactly k, exact whenever it says so",
                        "[select][sampled]", test_archs) {
  inline_executor ex;
  for (std::uint64_t n : {0, 1, 5, 8, 9, 17, 1000, 300'007}) {
    const auto g = gaussian(n, n + 9);
    const auto r = row_correlated(n, n + 10);
    for (std::uint64_t k : {std::uint64_t{0}, std::uint64_t{1}, n / 100, n / 10, n + 1}) {
      CAPTURE(n, k);
      for (const auto* x : {&g, &r}) {
        selection_stats st;
        const auto got = run_sampled<TestType>(ex, *x, k, {}, &st);
        if (st.exact) REQUIRE(got == reference_topk_indices<float>(*x, k));
      }
    }
  }
}

TEST_CASE("sampled threshold keeps >= 0.99 of the top-k energy on Gaussian gradients",
          "[select][sampled]") {
  thread_pool pool(2);
  const std::uint64_t n = 1 << 20;
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    const auto x = gaussian(n, 300 + seed);
    const std::uint64_t k = n / 100;
    const auto got = run_sampled<xsimd::default_arch>(pool, x, k);
    const double e = energy_fraction<float, std::uint64_t>(x, got) /
                     energy_fraction<float, std::uint64_t>(x, reference_topk_indices<float>(x, k));
    CAPTURE(seed, e);
    REQUIRE(e >= 0.99);
  }
}

TEMPLATE_LIST_TEST_CASE(
    "sampled threshold corrects to exactly k in one pass when the estimate is too high",
    "[select][sampled]", test_archs) {
  inline_executor ex;
  const std::uint64_t n = 1 << 20;
  const auto x = gaussian(n, 17);
  const std::uint64_t k = n / 100;
  selection_stats st;
  const auto got = run_sampled<TestType>(ex, x, k, {.margin_sigmas = -30.0}, &st);
  REQUIRE(st.deficit);
  REQUIRE_FALSE(st.exact);
  REQUIRE(st.passes == 1);
  REQUIRE(got.size() == k);
  // Every element that reached the too-high threshold is in (they are the largest ones).
  const auto best = reference_topk_indices<float>(x, 20);
  for (auto i : best) REQUIRE(std::binary_search(got.begin(), got.end(), i));
}

TEMPLATE_LIST_TEST_CASE("sampled threshold falls back to exact passes when the store overflows",
                        "[select][sampled]", test_archs) {
  inline_executor ex;
  const std::uint64_t n = 1 << 20;
  std::vector<float> x(n, 0.25f);
  for (std::uint64_t i = 3; i < n; i += 97) x[i] = -4.0f;
  selection_stats st;
  const std::uint64_t k = n / 50;
  REQUIRE(run_sampled<TestType>(ex, x, k, {}, &st) == reference_topk_indices<float>(x, k));
  REQUIRE(st.fallback);
  REQUIRE(st.exact);
}

TEST_CASE("sampled threshold on bf16 and with a 64-bit offset", "[select][sampled][index64]") {
  inline_executor ex;
  const auto b = gaussian<bf16>(200'000, 4);
  REQUIRE(run_sampled<xsimd::default_arch>(ex, b, 2000).size() == 2000);
  const auto x = gaussian(100'000, 8);
  sampled_threshold_selector<> sel;
  std::vector<std::uint64_t> idx(1000);
  std::vector<float> val(1000);
  const std::uint64_t base = std::uint64_t{5} << 32;
  const auto st =
      sel.select(ex, std::span<const float>(x), 1000, std::span(idx), std::span(val), base);
  require_valid_selection<float, std::uint64_t>(x, 1000, idx, val, st.count, base);
  if (st.exact)
    REQUIRE(as_u64<std::uint64_t>(idx, st.count, base) == reference_topk_indices<float>(x, 1000));
}
