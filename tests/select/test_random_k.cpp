// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/random_k.hpp>

#include "select_test_support.hpp"

#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

template <class Index = std::uint32_t, class T = float>
std::vector<std::uint64_t> run_random(random_k_selector<>& sel, random_key key,
                                      const std::vector<T>& x, std::uint64_t k,
                                      std::uint64_t base = 0) {
  inline_executor ex;
  const std::uint64_t m = std::min<std::uint64_t>(k, x.size());
  std::vector<Index> idx(m);
  std::vector<T> val(m);
  const auto st =
      sel.select(ex, key, std::span<const T>(x), k, std::span(idx), std::span(val), base);
  require_valid_selection<T, Index>(x, k, idx, val, st.count, base);
  REQUIRE(st.exact == (m == x.size() || m == 0));
  return as_u64<Index>(idx, st.count, base);
}

}  // namespace

TEST_CASE("random-k: the receiver regenerates the indices from the key", "[select][random]") {
  random_k_selector<> sel;
  for (std::uint64_t n : {0, 1, 7, 8, 9, 1000, 1 << 20}) {
    const auto x = gaussian(n, n);
    for (std::uint64_t k : {std::uint64_t{0}, std::uint64_t{1}, n / 100, n / 2 + 1, n, n + 3}) {
      CAPTURE(n, k);
      const random_key key{.seed = 99, .step = 4, .tensor = 2};
      const auto got = run_random(sel, key, x, k);
      const std::uint64_t m = std::min(n, k);
      std::vector<std::uint32_t> regen(m);
      std::vector<std::uint64_t> ws(sample_indices_workspace_words(n));
      sample_sorted_indices<std::uint32_t>(key, n, m, regen, ws);
      REQUIRE(got == as_u64<std::uint32_t>(regen, m));
    }
  }
}

TEST_CASE("random-k: different every step, the same on every rank", "[select][random]") {
  const auto x = gaussian(100'000, 3);
  random_k_selector<> rank0;
  random_k_selector<> rank1;
  const auto a = run_random(rank0, {.seed = 5, .step = 1, .tensor = 0}, x, 1000);
  const auto b = run_random(rank1, {.seed = 5, .step = 1, .tensor = 0}, x, 1000);
  const auto c = run_random(rank0, {.seed = 5, .step = 2, .tensor = 0}, x, 1000);
  const auto d = run_random(rank0, {.seed = 5, .step = 1, .tensor = 1}, x, 1000);
  REQUIRE(a == b);
  REQUIRE(a != c);
  REQUIRE(a != d);
}

TEST_CASE("random-k is uniform over the elements (chi-square)", "[select][random]") {
  const std::uint64_t n = 64;
  const std::uint64_t k = 8;
  const auto x = gaussian(n, 1);
  random_k_selector<> sel;
  std::vector<double> counts(n, 0.0);
  const std::uint32_t steps = 8000;
  for (std::uint32_t s = 0; s < steps; ++s) {
    for (auto i : run_random(sel, {.seed = 11, .step = s, .tensor = 7}, x, k)) counts[i] += 1;
  }
  const double expected =
      static_cast<double>(steps) * static_cast<double>(k) / static_cast<double>(n);
  double chi2 = 0;
  for (double c : counts) chi2 += (c - expected) * (c - expected) / expected;
  // 99.9% quantile of chi-square with 63 degrees of freedom is 103.4.
  CHECK(chi2 < 103.4);
}

TEST_CASE("random-k with 64-bit indices past 2^32 and fp16 values", "[select][random][index64]") {
  const auto x = gaussian<fp16>(50'000, 2);
  random_k_selector<> sel;
  const std::uint64_t base = (std::uint64_t{1} << 32) + 7;
  const random_key key{.seed = 1, .step = 2, .tensor = 3};
  const auto got = run_random<std::uint64_t>(sel, key, x, 500, base);
  std::vector<std::uint32_t> regen(500);
  std::vector<std::uint64_t> ws(sample_indices_workspace_words(x.size()));
  sample_sorted_indices<std::uint32_t>(key, x.size(), 500, regen, ws);
  REQUIRE(got == as_u64<std::uint32_t>(regen, 500));
  inline_executor ex;
  std::vector<std::uint32_t> idx32(500);
  std::vector<fp16> val(500);
  REQUIRE_THROWS_AS(
      sel.select(ex, key, std::span<const fp16>(x), 500, std::span(idx32), std::span(val), base),
      error);
}
