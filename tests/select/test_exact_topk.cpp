// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/exact_topk.hpp>

#include "select_test_support.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

template <class Arch, class T, class Index = std::uint32_t, class Ex>
std::vector<std::uint64_t> run_exact(Ex& ex, const std::vector<T>& x, std::uint64_t k,
                                     exact_topk_options options = {},
                                     selection_stats* stats = nullptr, std::uint64_t base = 0) {
  exact_topk_selector<Arch> sel(options);
  const std::uint64_t m = std::min<std::uint64_t>(k, x.size());
  std::vector<Index> idx(m + 3);
  std::vector<T> val(m + 3);
  const auto st =
      sel.select(ex, std::span<const T>(x), k, std::span<Index>(idx), std::span<T>(val), base);
  require_valid_selection<T, Index>(x, k, idx, val, st.count, base);
  if (stats) *stats = st;
  return as_u64<Index>(idx, st.count, base);
}

template <class Arch, class T>
void check_against_oracle(const std::vector<T>& x, std::uint64_t k,
                          exact_topk_options options = {}) {
  inline_executor ex;
  selection_stats st;
  const auto got = run_exact<Arch>(ex, x, k, options, &st);
  REQUIRE(st.exact);
  REQUIRE(got == reference_topk_indices<T>(x, k));
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("exact top-k matches the oracle at edge sizes", "[select][exact]",
                        test_archs) {
  for (std::uint64_t n : {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1001}) {
    const auto x = gaussian(n, n + 1);
    for (std::uint64_t k :
         {std::uint64_t{0}, std::uint64_t{1}, n / 3, n / 2, n > 0 ? n - 1 : 0, n, n + 5}) {
      CAPTURE(n, k);
      check_against_oracle<TestType>(x, k);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("exact top-k matches the oracle on 2^20 elements and odd tails",
                        "[select][exact]", test_archs) {
  for (std::uint64_t n : {std::uint64_t{1} << 20, std::uint64_t{1'000'003}}) {
    const auto g = gaussian(n, 7);
    const auto r = row_correlated(n, 8);
    for (std::uint64_t k : {std::uint64_t{1}, std::uint64_t{100}, n / 100}) {
      CAPTURE(n, k);
      check_against_oracle<TestType>(g, k);
      check_against_oracle<TestType>(r, k);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("exact top-k on fp16 and bf16 inputs", "[select][exact]", test_archs) {
  for (std::uint64_t n : {std::uint64_t{17}, std::uint64_t{4099}, std::uint64_t{300'001}}) {
    for (std::uint64_t k : {std::uint64_t{1}, n / 100 + 1, n / 7}) {
      CAPTURE(n, k);
      check_against_oracle<TestType>(gaussian<fp16>(n, 3), k);
      check_against_oracle<TestType>(gaussian<bf16>(n, 4), k);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("exact top-k ranks NaN above inf above finite, ties to the lowest index",
                        "[select][exact]", test_archs) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x(200'000, 0.5f);
  x[150'000] = -nan;
  x[7] = inf;
  x[100'001] = -inf;
  x[3] = 2.0f;
  x[99] = -2.0f;
  x[5] = -0.0f;
  inline_executor ex;
  for (std::uint64_t k : {1, 2, 3, 4, 5, 6, 10, 1000}) {
    CAPTURE(k);
    const auto got = run_exact<TestType>(ex, x, k);
    REQUIRE(got == reference_topk_indices<float>(x, k));
  }
  // k = 6: NaN, two infinities, two 2.0s, and the lowest-index 0.5 (index 0).
  const auto six = run_exact<TestType>(ex, x, 6);
  REQUIRE(six == std::vector<std::uint64_t>{0, 3, 7, 99, 100'001, 150'000});
  // +0 and -0 tie.
  std::vector<float> zeros(40, 0.0f);
  zeros[2] = -0.0f;
  zeros[30] = -0.0f;
  REQUIRE(run_exact<TestType>(ex, zeros, 3) == std::vector<std::uint64_t>{0, 1, 2});
}

TEMPLATE_LIST_TEST_CASE("exact top-k stays exact when the sampled bound fails", "[select][exact]",
                        test_archs) {
  inline_executor ex;
  const std::uint64_t n = std::uint64_t{1} << 20;
  SECTION("massive ties: store overflows, full radix passes with per-chunk tie quotas") {
    std::vector<float> x(n, 1.0f);
    for (std::uint64_t i = 0; i < n; i += 1000) x[i] = 3.0f;
    selection_stats st;
    for (std::uint64_t k : {std::uint64_t{500}, std::uint64_t{2000}, n / 3}) {
      CAPTURE(k);
      const auto got = run_exact<TestType>(ex, x, k, {}, &st);
      REQUIRE(got == reference_topk_indices<float>(x, k));
      if (k > 1049) REQUIRE(st.fallback);
    }
  }
  SECTION("bound set too high on purpose: fallback recounts and finishes from candidates") {
    const auto x = gaussian(n, 11);
    selection_stats st;
    const auto got = run_exact<TestType>(ex, x, n / 100, {.margin_sigmas = -50.0}, &st);
    REQUIRE(st.fallback);
    REQUIRE(got == reference_topk_indices<float>(x, n / 100));
  }
  SECTION("mostly zeros: the lowest-index zeros fill in, still one pass") {
    std::vector<float> x(n, 0.0f);
    for (std::uint64_t i = 5; i < n; i += 211) x[i] = static_cast<float>(i % 17) - 8.0f;
    selection_stats st;
    const std::uint64_t k = n / 50;
    const auto got = run_exact<TestType>(ex, x, k, {}, &st);
    REQUIRE(got == reference_topk_indices<float>(x, k));
    REQUIRE_FALSE(st.fallback);
    REQUIRE(st.passes == 1);
  }
  SECTION("all zeros") {
    std::vector<float> x(n, 0.0f);
    REQUIRE(run_exact<TestType>(ex, x, 1000) == reference_topk_indices<float>(x, 1000));
  }
}

TEST_CASE("exact top-k gives the same result on any number of threads", "[select][exact]") {
  const std::uint64_t n = 2'000'017;
  const auto x = row_correlated(n, 5);
  inline_executor one;
  thread_pool pool(3);
  for (std::uint64_t k : {std::uint64_t{10}, n / 100, n / 20}) {
    CAPTURE(k);
    const auto a = run_exact<xsimd::default_arch>(one, x, k);
    const auto b = run_exact<xsimd::default_arch>(pool, x, k);
    REQUIRE(a == b);
    REQUIRE(a == reference_topk_indices<float>(x, k));
  }
}

TEST_CASE("exact top-k: ties at the k-th key spread over every thread's share", "[select][exact]") {
  // Values on a grid of 1/8: thousands of elements share the k-th key, in every group of
  // segments that a thread emits, so the ties must go to the lowest indices across groups.
  const std::uint64_t n = 4'000'037;
  auto x = gaussian(n, 21);
  for (auto& v : x) v = std::round(v * 8.0f) / 8.0f;
  inline_executor one;
  thread_pool pool(3);
  for (std::uint64_t k : {std::uint64_t{1}, n / 100, n / 100 + 777, n / 25}) {
    CAPTURE(k);
    const auto expected = reference_topk_indices<float>(x, k);
    REQUIRE(run_exact<xsimd::default_arch>(one, x, k) == expected);
    REQUIRE(run_exact<xsimd::default_arch>(pool, x, k) == expected);
  }
}

TEST_CASE("exact top-k: 64-bit indices through an offset view past 2^32",
          "[select][exact][index64]") {
  const std::uint64_t base = (std::uint64_t{1} << 32) + 12345;
  const auto x = gaussian(1 << 20, 9);
  inline_executor ex;
  const std::uint64_t k = 5000;
  const auto got =
      run_exact<xsimd::default_arch, float, std::uint64_t>(ex, x, k, {}, nullptr, base);
  REQUIRE(got == reference_topk_indices<float>(x, k));
  // A 32-bit index cannot hold base + i.
  exact_topk_selector<> sel;
  std::vector<std::uint32_t> idx(k);
  std::vector<float> val(k);
  REQUIRE_THROWS_AS(
      sel.select(ex, std::span<const float>(x), k, std::span(idx), std::span(val), base), error);
  // Too short an output.
  REQUIRE_THROWS_AS(
      sel.select(ex, std::span<const float>(x), k + 1, std::span(idx), std::span(val)), error);
}

TEST_CASE("exact top-k into a sparse_buffer reuses its storage", "[select][exact]") {
  const auto x = gaussian(100'000, 12);
  exact_topk_selector<> sel;
  sparse_buffer<float, std::uint32_t> out(x.size(), 10);
  inline_executor ex;
  for (std::uint64_t k : {5, 1000, 200}) {
    const auto st = sel.select(ex, std::span<const float>(x), k, out);
    REQUIRE(st.count == k);
    REQUIRE(out.size() == k);
    REQUIRE(as_u64<std::uint32_t>(out.indices(), k) == reference_topk_indices<float>(x, k));
  }
}
