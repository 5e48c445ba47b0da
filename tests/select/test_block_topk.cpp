// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/block_topk.hpp>

#include "select_test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

template <class Arch, class T, class Ex>
std::vector<std::uint64_t> run_block(Ex& ex, const std::vector<T>& x, std::uint64_t k,
                                     block_topk_options options = {},
                                     block_selection_stats* stats = nullptr) {
  block_topk_selector<Arch> sel(options);
  const std::uint64_t m = std::min<std::uint64_t>(k, x.size());
  std::vector<std::uint32_t> idx(m);
  std::vector<T> val(m);
  const auto st = sel.select(ex, std::span<const T>(x), k, std::span(idx), std::span(val));
  require_valid_selection<T, std::uint32_t>(x, k, idx, val, st.count);
  if (stats) *stats = st;
  return as_u64<std::uint32_t>(idx, st.count);
}

// Checks a block selection against scores computed in double: whole blocks except at most
// one, truncated to its largest elements; no left-out block scores clearly above a selected
// one; the reported energies are the sums of squares.
template <class T>
void check_blocks(const std::vector<T>& x, std::uint64_t k, const std::vector<std::uint64_t>& got,
                  block_score score, const block_selection_stats& st) {
  const std::uint64_t b = 64 / sizeof(T);
  const std::uint64_t n = x.size();
  const std::uint64_t nb = (n + b - 1) / b;
  std::vector<double> s(nb, 0.0);
  double total = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    const double v = to_float(x[i]);
    s[i / b] += score == block_score::l1 ? std::abs(v) : v * v;
    total += v * v;
  }
  std::vector<std::uint64_t> count(nb, 0);
  double kept = 0;
  for (auto i : got) {
    ++count[i / b];
    kept += static_cast<double>(to_float(x[i])) * to_float(x[i]);
  }
  int partial = 0;
  double min_full = std::numeric_limits<double>::infinity();
  double max_out = -1;
  for (std::uint64_t j = 0; j < nb; ++j) {
    const std::uint64_t size = std::min(b, n - j * b);
    if (count[j] == size) min_full = std::min(min_full, s[j]);
    if (count[j] == 0) max_out = std::max(max_out, s[j]);
    if (count[j] > 0 && count[j] < size) {
      ++partial;
      // The block's largest elements.
      std::vector<std::uint32_t> in, out;
      for (std::uint64_t l = 0; l < size; ++l) {
        const std::uint64_t i = j * b + l;
        (std::binary_search(got.begin(), got.end(), i) ? in : out).push_back(magnitude_key(x[i]));
      }
      REQUIRE(*std::min_element(in.begin(), in.end()) >= *std::max_element(out.begin(), out.end()));
    }
  }
  REQUIRE(partial <= 1);
  REQUIRE(got.size() == k);
  if (max_out >= 0) REQUIRE(max_out <= min_full * (1 + 1e-5) + 1e-30);
  REQUIRE(st.kept_energy == Approx(kept).epsilon(1e-6).margin(1e-20));
  REQUIRE(st.total_energy == Approx(total).epsilon(1e-5).margin(1e-20));
  REQUIRE_FALSE(st.exact);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("block selection: whole cache lines, exactly k", "[select][block]",
                        test_archs) {
  inline_executor ex;
  for (std::uint64_t n : {1, 15, 16, 17, 31, 100, 163, 4096, 100'003, 1 << 20}) {
    const auto x = row_correlated(n, n + 1);
    for (std::uint64_t k :
         {std::uint64_t{1}, std::uint64_t{16}, std::uint64_t{17}, n / 100 + 5, n / 3, n - 1, n}) {
      if (k == 0 || k > n) continue;
      for (block_score score : {block_score::l1, block_score::l2}) {
        CAPTURE(n, k, static_cast<int>(score));
        block_selection_stats st;
        const auto got = run_block<TestType>(ex, x, k, {.score = score}, &st);
        if (k < n) check_blocks(x, k, got, score, st);
      }
    }
  }
}

TEMPLATE_LIST_TEST_CASE("block selection: L1 scores agree bit for bit across architectures",
                        "[select][block]", test_archs) {
  thread_pool pool(2);
  const auto x = gaussian(1'000'003, 8);
  for (std::uint64_t k : {std::uint64_t{1000}, std::uint64_t{10'007}}) {
    CAPTURE(k);
    block_selection_stats a, b;
    REQUIRE(run_block<TestType>(pool, x, k, {}, &a) == run_block<scalar_arch>(pool, x, k, {}, &b));
    REQUIRE(a.kept_energy == Approx(b.kept_energy).epsilon(1e-12));
  }
}

TEST_CASE("block selection: a short last block among the best, and the block after it",
          "[select][block]") {
  inline_executor ex;
  // 10 full blocks and a last block of 3 huge values: k = 16 takes the 3, then the 13
  // largest of the best full block (block 4, scaled up).
  std::vector<float> x = gaussian(163, 2);
  for (std::uint64_t i = 160; i < 163; ++i) x[i] = 100.0f;
  for (std::uint64_t i = 64; i < 80; ++i) x[i] *= 10.0f;
  block_selection_stats st;
  const auto got = run_block<xsimd::default_arch>(ex, x, 16, {}, &st);
  REQUIRE(st.blocks == 2);
  REQUIRE(std::count_if(got.begin(), got.end(), [](auto i) { return i >= 160; }) == 3);
  REQUIRE(std::count_if(got.begin(), got.end(), [](auto i) { return i >= 64 && i < 80; }) == 13);
  check_blocks(x, 16, got, block_score::l1, st);
  // k = 19: the short block and one whole block.
  const auto g19 = run_block<xsimd::default_arch>(ex, x, 19, {}, &st);
  REQUIRE(st.blocks == 2);
  check_blocks(x, 19, g19, block_score::l1, st);
}

TEST_CASE("block selection on fp16 / bf16 uses 32-element blocks", "[select][block]") {
  inline_executor ex;
  const auto h = row_correlated<fp16>(10'000, 4);
  const auto b = row_correlated<bf16>(10'001, 5);
  block_selection_stats st;
  check_blocks(h, 320, run_block<xsimd::default_arch>(ex, h, 320, {}, &st), block_score::l1, st);
  REQUIRE(st.blocks == 10);
  check_blocks(b, 100, run_block<xsimd::default_arch>(ex, b, 100, {.score = block_score::l2}, &st),
               block_score::l2, st);
}

TEST_CASE("block selection ranks NaN blocks first and handles ties", "[select][block]") {
  inline_executor ex;
  std::vector<float> x(64 * 16, 1.0f);
  x[200] = std::numeric_limits<float>::quiet_NaN();
  const auto got = run_block<xsimd::default_arch>(ex, x, 32);
  // The NaN's block (12), then the lowest-index block of the tied rest (0).
  std::vector<std::uint64_t> expected;
  for (std::uint64_t i = 0; i < 16; ++i) expected.push_back(i);
  for (std::uint64_t i = 192; i < 208; ++i) expected.push_back(i);
  REQUIRE(got == expected);
}

TEST_CASE(
    "block selection keeps much less energy than top-k on i.i.d. gradients, more on correlated "
    "ones",
    "[select][block]") {
  thread_pool pool(2);
  const std::uint64_t n = 1 << 20;
  const std::uint64_t k = n / 100;
  const auto g = gaussian(n, 1);
  const auto r = row_correlated(n, 2);
  block_selection_stats sg, sr;
  run_block<xsimd::default_arch>(pool, g, k, {}, &sg);
  run_block<xsimd::default_arch>(pool, r, k, {}, &sr);
  const double topk_g =
      energy_fraction<float, std::uint64_t>(g, reference_topk_indices<float>(g, k));
  const double topk_r =
      energy_fraction<float, std::uint64_t>(r, reference_topk_indices<float>(r, k));
  CAPTURE(sg.energy_fraction(), topk_g, sr.energy_fraction(), topk_r);
  REQUIRE(sg.energy_fraction() < 0.5 * topk_g);
  REQUIRE(sr.energy_fraction() > sg.energy_fraction());
  REQUIRE(sr.energy_fraction() <= topk_r);
}
