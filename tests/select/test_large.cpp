// SPDX-License-Identifier: Apache-2.0
// Opt-in: a real tensor past 2^32 elements (bf16, 8 GiB). Run with
//   test_select "[.large]"
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/threshold.hpp>

#include "select_test_support.hpp"

#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

TEST_CASE("selection on a tensor of more than 2^32 elements", "[.large][select][index64]") {
  const std::uint64_t n = (std::uint64_t{1} << 32) + 4099;
  thread_pool pool(2);
  aligned_buffer<bf16> x(n, {.prefault = true}, pool);  // all +0
  // Plant values on both sides of 2^32; their order is the planted index order reversed.
  std::vector<std::uint64_t> planted;
  for (std::uint64_t i = 17; i < n; i += n / 97) planted.push_back(i);
  planted.push_back((std::uint64_t{1} << 32) - 1);
  planted.push_back(std::uint64_t{1} << 32);
  planted.push_back(n - 1);
  std::sort(planted.begin(), planted.end());
  for (std::size_t j = 0; j < planted.size(); ++j)
    x[planted[j]] = bf16(-1.0f - static_cast<float>(j));
  const std::uint64_t k = planted.size();
  std::vector<std::uint64_t> idx(k + 10);
  std::vector<bf16> val(k + 10);

  exact_topk_selector<> exact;
  auto st = exact.select(pool, std::span<const bf16>(x.span()), k, std::span(idx), std::span(val));
  REQUIRE(st.count == k);
  REQUIRE(std::vector<std::uint64_t>(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k)) ==
          planted);
  for (std::size_t j = 0; j < k; ++j) REQUIRE(to_float(val[j]) == -1.0f - static_cast<float>(j));

  // Ties: k + 10 takes the 10 lowest-index zeros.
  st = exact.select(pool, std::span<const bf16>(x.span()), k + 10, std::span(idx), std::span(val));
  REQUIRE(st.count == k + 10);
  REQUIRE(idx[0] == 0);

  threshold_selector<> threshold;
  threshold_state state;
  for (int step = 0; step < 2; ++step) {
    st = threshold.select(pool, state, std::span<const bf16>(x.span()), k, std::span(idx),
                          std::span(val));
    REQUIRE(std::vector<std::uint64_t>(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k)) ==
            planted);
  }

  random_k_selector<> random;
  std::vector<std::uint64_t> ridx(100'000);
  std::vector<bf16> rval(100'000);
  random.select(pool, {.seed = 3}, std::span<const bf16>(x.span()), ridx.size(), std::span(ridx),
                std::span(rval));
  REQUIRE(ridx.back() > (std::uint64_t{1} << 32));
  REQUIRE(std::is_sorted(ridx.begin(), ridx.end()));
}
