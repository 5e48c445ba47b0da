// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/sampled_threshold.hpp>

#include "select_test_support.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

TEST_CASE("slice_of: at every step the ranks cover disjoint slices that tile the tensor",
          "[select][partitioned]") {
  for (std::uint64_t n : {0, 1, 15, 16, 17, 1000, 1'000'003}) {
    for (std::uint32_t parts : {1u, 2u, 3u, 4u, 7u}) {
      for (std::uint64_t k : {std::uint64_t{0}, std::uint64_t{5}, n / 100 + 3}) {
        for (std::uint64_t step = 0; step < 2 * parts; ++step) {
          CAPTURE(n, parts, k, step);
          std::vector<partition_slice> s;
          for (std::uint32_t r = 0; r < parts; ++r)
            s.push_back(slice_of({.rank = r, .parts = parts}, n, k, step));
          std::sort(s.begin(), s.end(), [](auto& a, auto& b) { return a.slice < b.slice; });
          std::uint64_t next = 0;
          std::uint64_t total_k = 0;
          for (std::uint32_t j = 0; j < parts; ++j) {
            REQUIRE(s[j].slice == j);
            REQUIRE(s[j].begin == next);
            REQUIRE(s[j].end >= s[j].begin);
            if (j + 1 < parts) REQUIRE(s[j].end % 16 == 0);
            next = s[j].end;
            total_k += s[j].k;
          }
          REQUIRE(next == n);
          REQUIRE(total_k == k);
        }
      }
    }
  }
  // Each rank visits every slice in P steps.
  std::vector<std::uint32_t> seen;
  for (std::uint64_t step = 0; step < 5; ++step)
    seen.push_back(slice_of({.rank = 3, .parts = 5}, 100, 10, step).slice);
  std::sort(seen.begin(), seen.end());
  REQUIRE(seen == std::vector<std::uint32_t>{0, 1, 2, 3, 4});
  REQUIRE_THROWS_AS(slice_of({.rank = 2, .parts = 2}, 10, 1, 0), error);
  REQUIRE_THROWS_AS(slice_of({.rank = 0, .parts = 0}, 10, 1, 0), error);
}

TEMPLATE_LIST_TEST_CASE("partitioned selection: each rank's exact top k/P of its slice, disjoint",
                        "[select][partitioned]", test_archs) {
  const std::uint64_t n = 1'000'003;
  const std::uint64_t k = 10'000;
  const std::uint32_t parts = 3;
  const auto x = row_correlated(n, 31);
  inline_executor ex;
  for (std::uint64_t step = 0; step < 3; ++step) {
    std::vector<std::uint64_t> all;
    for (std::uint32_t r = 0; r < parts; ++r) {
      const partition p{.rank = r, .parts = parts};
      partitioned_selector<exact_topk_selector<TestType>> sel(p);
      const auto s = slice_of(p, n, k, step);
      std::vector<std::uint32_t> idx(s.k);
      std::vector<float> val(s.k);
      const auto st =
          sel.select(ex, step, std::span<const float>(x), k, std::span(idx), std::span(val));
      REQUIRE(st.count == s.k);
      require_valid_selection<float, std::uint32_t>(x, s.k, idx, val, st.count);
      const std::vector<float> slice(x.begin() + static_cast<std::ptrdiff_t>(s.begin),
                                     x.begin() + static_cast<std::ptrdiff_t>(s.end));
      auto expected = reference_topk_indices<float>(slice, s.k);
      for (auto& i : expected) i += s.begin;
      REQUIRE(as_u64<std::uint32_t>(idx, st.count) == expected);
      all.insert(all.end(), expected.begin(), expected.end());
    }
    std::sort(all.begin(), all.end());
    REQUIRE(std::adjacent_find(all.begin(), all.end()) == all.end());
    REQUIRE(all.size() == k);
  }
  STATIC_REQUIRE(selector<sampled_threshold_selector<>>);
  partitioned_selector<sampled_threshold_selector<TestType>> sampled({.rank = 1, .parts = 2});
  std::vector<std::uint32_t> idx(k);
  std::vector<float> val(k);
  REQUIRE(
      sampled.select(ex, 0, std::span<const float>(x), k, std::span(idx), std::span(val)).count ==
      k / 2);
  REQUIRE_THROWS_AS(partitioned_selector<>({.rank = 2, .parts = 2}), error);
}
