// SPDX-License-Identifier: Apache-2.0
// Sparse aggregation: the k-way merge and the dense scatter-add against a scalar reference that
// sums in input order, for many input counts, densities, value and index types and thread
// counts; bad inputs; the dense/sparse rule.
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/aggregate.hpp>

#include "catch.hpp"
#include "support.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <vector>

using namespace stellatrain;
using test::random_selection;

namespace {

// Index -> value: -0.0f plus each input's value in input order, then times `scale`.
template <class V, class I>
std::map<std::uint64_t, float> reference(const std::vector<sparse_view<const V, const I>>& in,
                                         float scale) {
  std::map<std::uint64_t, float> sum;
  for (const auto& s : in) {
    for (std::size_t j = 0; j < s.size(); ++j) {
      auto [it, fresh] = sum.try_emplace(s.indices()[j], -0.0f);
      it->second += to_float(s.values()[j]);
    }
  }
  for (auto& [i, v] : sum) v *= scale;
  return sum;
}

template <class V, class I, class Executor>
void check_merge(const std::vector<sparse_view<const V, const I>>& in, reduction op, Executor& ex) {
  sparse_merger merger;
  const std::span<const sparse_view<const V, const I>> inputs(in);
  sparse_buffer<float, I> out(0, merge_capacity(inputs) + 1);
  merger.merge(inputs, out, op, ex);
  const auto ref =
      reference(in, op == reduction::mean ? 1.0f / static_cast<float>(in.size()) : 1.0f);
  REQUIRE(out.size() == ref.size());
  REQUIRE(out.dense_size() == in[0].dense_size());
  std::size_t j = 0;
  for (const auto& [i, v] : ref) {
    if (out.indices()[j] != i)
      FAIL("position " << j << ": index " << out.indices()[j] << " != " << i);
    if (std::bit_cast<std::uint32_t>(out.values()[j]) != std::bit_cast<std::uint32_t>(v)) {
      FAIL("index " << i << ": " << out.values()[j] << " != " << v);
    }
    ++j;
  }
  // Scatter-add agrees (dense), where the tensor is small enough to materialise.
  if (in[0].dense_size() <= (1u << 22)) {
    std::vector<float> dense(in[0].dense_size(), 42.0f);
    merger.scatter_add(inputs, std::span<float>(dense), op, ex);
    std::size_t touched = 0;
    for (std::uint64_t i = 0; i < dense.size(); ++i) {
      const auto it = ref.find(i);
      if (it == ref.end()) {
        if (dense[i] != 0.0f) FAIL("dense " << i << " = " << dense[i] << ", expected 0");
      } else {
        ++touched;
        if (dense[i] != it->second)
          FAIL("dense " << i << " = " << dense[i] << " != " << it->second);
      }
    }
    CHECK(touched == ref.size());
  }
}

// Two merge results hold the same pairs, bit for bit.
template <class I>
void require_same_bits(const sparse_buffer<float, I>& a, const sparse_buffer<float, I>& b) {
  REQUIRE(a.size() == b.size());
  CHECK(std::equal(a.indices().begin(), a.indices().end(), b.indices().begin()));
  CHECK(std::memcmp(a.values().data(), b.values().data(), a.size() * sizeof(float)) == 0);
}

template <class I>
std::vector<sparse_view<const float, const I>> views(const std::vector<test::selection<I>>& s) {
  std::vector<sparse_view<const float, const I>> v;
  for (const auto& x : s) v.push_back(x.view());
  return v;
}

}  // namespace

TEST_CASE("merge: equals the reference for 1..9 inputs, densities and windows",
          "[pack][aggregate]") {
  thread_pool pool(3);
  inline_executor one;
  for (std::size_t w : {1, 2, 3, 4, 9}) {
    for (double d : {1e-4, 1e-2, 0.1, 0.6}) {
      const std::uint64_t n = 300007;
      std::vector<test::selection<std::uint32_t>> s;
      for (std::size_t r = 0; r < w; ++r) {
        s.push_back(
            random_selection<std::uint32_t>(n, static_cast<std::uint64_t>(d * n) + r, 100 * w + r));
      }
      INFO("inputs " << w << " density " << d);
      check_merge(views(s), reduction::sum, pool);
      check_merge(views(s), reduction::mean, one);
    }
  }
}

TEST_CASE("merge: dense and sparse stretches in one merge", "[pack][aggregate]") {
  // Dense clusters between long sparse stretches: consecutive windows alternate between
  // many pairs and a few, and the merge counts them in different ways.
  inline_executor one;
  thread_pool pool(2);
  const std::uint64_t n = 1000003;
  std::vector<test::selection<std::uint32_t>> s;
  for (std::uint32_t r = 0; r < 3; ++r) {
    const auto sparse = random_selection<std::uint32_t>(n, 60 + r, 7 * r + 1);
    test::selection<std::uint32_t> mixed;
    mixed.n = n;
    std::mt19937_64 rng(r);
    for (std::uint64_t i = 0; i < n; ++i) {
      const bool in_cluster = (i / 20000) % 7 == r;  // 20000-index clusters, other places per input
      const bool chosen = in_cluster
                              ? rng() % 3 == 0
                              : std::binary_search(sparse.indices.begin(), sparse.indices.end(), i);
      if (chosen) {
        mixed.indices.push_back(static_cast<std::uint32_t>(i));
        mixed.values.push_back(static_cast<float>(rng() % 1000) / 8.0f - 60.0f);
      }
    }
    s.push_back(mixed);
  }
  check_merge(views(s), reduction::sum, one);
  check_merge(views(s), reduction::mean, pool);
}

TEST_CASE("merge: window and tensor edges, empty inputs, identical inputs", "[pack][aggregate]") {
  thread_pool pool(2);
  test::selection<std::uint32_t> a, b, empty;
  a.n = b.n = empty.n = 40000;
  a.indices = {0, 1, 4095, 4096, 4097, 8191, 12288, 16383, 16384, 32768, 39999};
  b.indices = {1, 2, 4095, 8192, 16383, 16385, 32767, 32768, 39998, 39999};
  a.values = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  b.values = {-2, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  check_merge(views(std::vector{a, b}), reduction::sum, pool);
  check_merge(views(std::vector{a, empty, b}), reduction::mean, pool);
  check_merge(views(std::vector{empty, empty}), reduction::sum, pool);
  check_merge(views(std::vector{a, a, a}), reduction::sum, pool);
  // One input is copied exactly, -0.0 included.
  a.values[0] = -0.0f;
  sparse_merger m;
  const std::vector<test::selection<std::uint32_t>> only_a = {a};
  const auto in = views(only_a);
  sparse_buffer<float> out(0, a.indices.size());
  m.merge<float, std::uint32_t>(in, out, reduction::sum, pool);
  CHECK(std::bit_cast<std::uint32_t>(out.values()[0]) == 0x80000000u);
  CHECK(std::vector<float>(out.values().begin() + 1, out.values().end()) ==
        std::vector<float>(a.values.begin() + 1, a.values.end()));
}

TEST_CASE("merge: large inputs split across threads give the same bits", "[pack][aggregate]") {
  const std::uint64_t n = 5000000;
  std::vector<test::selection<std::uint32_t>> s;
  for (std::uint32_t r = 0; r < 4; ++r)
    s.push_back(random_selection<std::uint32_t>(n, 60000 + r * 1000, r));
  const auto in = views(s);
  sparse_merger m1, m4;
  inline_executor one;
  thread_pool four(4);
  sparse_buffer<float> a(0, 300000), b(0, 300000);
  m1.merge<float, std::uint32_t>(in, a, reduction::mean, one);
  m4.merge<float, std::uint32_t>(in, b, reduction::mean, four);
  m4.merge<float, std::uint32_t>(in, b, reduction::mean, four);  // reuse: warm, same result
  require_same_bits(a, b);
  check_merge(in, reduction::sum, four);
}

TEST_CASE("merge: a chunk spanning more windows than a thread marks ahead", "[pack][aggregate]") {
  // The largest input is dense in the first 2M indices, so every chunk cut lies there; the
  // other inputs spread over 60M indices, so the last chunk spans thousands of windows and is
  // written partly after its start is known.
  thread_pool pool(3);
  const std::uint64_t n = 60000000;
  std::vector<test::selection<std::uint32_t>> s;
  auto dense = random_selection<std::uint32_t>(2000000, 150000, 5);
  dense.n = n;
  s.push_back(dense);
  s.push_back(random_selection<std::uint32_t>(n, 40000, 6));
  s.push_back(random_selection<std::uint32_t>(n, 30000, 7));
  check_merge(views(s), reduction::sum, pool);
  sparse_merger m1, m3;
  inline_executor one;
  const auto in = views(s);
  sparse_buffer<float> a(0, 220000), b(0, 220000);
  m1.merge<float, std::uint32_t>(in, a, reduction::mean, one);
  m3.merge<float, std::uint32_t>(in, b, reduction::mean, pool);
  require_same_bits(a, b);
}

TEST_CASE("merge: a bad input in one chunk fails the whole merge, and the merger stays usable",
          "[pack][aggregate]") {
  // Many chunks on 3 threads: the chunk that finds the error must release the chunks after it
  // (which wait for its count), or the merge would hang.
  thread_pool pool(3);
  const std::uint64_t n = 5000000;
  std::vector<test::selection<std::uint32_t>> s;
  for (std::uint32_t r = 0; r < 4; ++r)
    s.push_back(random_selection<std::uint32_t>(n, 60000 + r * 1000, 40 + r));
  const auto good = views(s);
  sparse_buffer<float> expected(0, 300000), out(0, 300000);
  sparse_merger fresh;
  fresh.merge<float, std::uint32_t>(good, expected, reduction::sum, pool);
  sparse_merger m;
  auto merge_with = [&](std::vector<test::selection<std::uint32_t>> bad) {
    const auto in = views(bad);
    m.merge<float, std::uint32_t>(in, out, reduction::sum, pool);
  };
  // Two neighbours in different windows swapped, at several places of one input (in different
  // chunks).
  for (std::size_t at :
       {std::size_t{100}, std::size_t{20000}, std::size_t{31000}, std::size_t{45000}}) {
    auto bad = s;
    auto& idx = bad[2].indices;
    while (idx[at] / 16384 == idx[at + 1] / 16384) ++at;
    std::swap(idx[at], idx[at + 1]);
    INFO("swapped at " << at);
    CHECK_THROWS_WITH(merge_with(bad), Catch::Matchers::Contains("not sorted"));
  }
  auto outside = s;
  outside[1].indices.back() = static_cast<std::uint32_t>(n);
  CHECK_THROWS_WITH(merge_with(outside), Catch::Matchers::Contains(
                                             "index 5000000 is not below the tensor size 5000000"));
  // The same merger, after the failures, merges as a fresh one does.
  m.merge<float, std::uint32_t>(good, out, reduction::sum, pool);
  require_same_bits(out, expected);
}

TEST_CASE("merge: 16-bit values and 64-bit indices", "[pack][aggregate]") {
  thread_pool pool(2);
  const std::uint64_t n = (std::uint64_t{1} << 36) + 5;
  std::vector<test::selection<std::uint64_t>> s;
  for (std::uint32_t r = 0; r < 3; ++r) s.push_back(random_selection<std::uint64_t>(n, 3000, r));
  s[1].indices[7] = s[0].indices[7];  // a collision past 2^32
  std::sort(s[1].indices.begin(), s[1].indices.end());
  s[1].indices.erase(std::unique(s[1].indices.begin(), s[1].indices.end()), s[1].indices.end());
  s[1].values.resize(s[1].indices.size());
  check_merge(views(s), reduction::sum, pool);
  std::vector<std::vector<bf16>> vb(3);
  std::vector<sparse_view<const bf16, const std::uint64_t>> in;
  for (std::size_t r = 0; r < 3; ++r) {
    for (float v : s[r].values) vb[r].push_back(bf16(v));
    in.emplace_back(std::span<const std::uint64_t>(s[r].indices), std::span<const bf16>(vb[r]), n);
  }
  check_merge(in, reduction::mean, pool);
}

TEST_CASE("merge and scatter_add: bad inputs are refused", "[pack][aggregate]") {
  inline_executor ex;
  sparse_merger m;
  test::selection<std::uint32_t> a;
  a.n = 100000;
  a.indices = {5, 9000, 70000, 80000};
  a.values = {1, 1, 1, 1};
  auto unsorted = a;
  std::swap(unsorted.indices[1], unsorted.indices[2]);
  auto outside = a;
  outside.indices.back() = 100000;
  auto other_size = a;
  other_size.n = 5;
  sparse_buffer<float> out(0, 100);
  std::vector<float> dense(100000);
  auto merge = [&](const std::vector<test::selection<std::uint32_t>>& s) {
    const auto in = views(s);
    m.merge<float, std::uint32_t>(in, out, reduction::sum, ex);
  };
  auto scatter = [&](const std::vector<test::selection<std::uint32_t>>& s) {
    const auto in = views(s);
    m.scatter_add<float, std::uint32_t>(in, dense, reduction::sum, ex);
  };
  CHECK_THROWS_WITH(merge({a, unsorted}), Catch::Matchers::Contains("not sorted"));
  CHECK_THROWS_WITH(merge({outside}),
                    Catch::Matchers::Contains("index 100000 is not below the tensor size 100000"));
  CHECK_THROWS_WITH(merge({a, other_size}), Catch::Matchers::Contains("input 1 has dense size 5"));
  CHECK_THROWS_WITH(merge({}), Catch::Matchers::Contains("no inputs"));
  CHECK_THROWS_WITH(scatter({a, unsorted}), Catch::Matchers::Contains("not sorted"));
  CHECK_THROWS_WITH(scatter({outside}), Catch::Matchers::Contains("is not below the tensor size"));
  std::vector<float> wrong(10);
  const std::vector<test::selection<std::uint32_t>> only_a = {a};
  const auto in = views(only_a);
  CHECK_THROWS_AS((m.scatter_add<float, std::uint32_t>(in, wrong, reduction::sum, ex)), error);
  sparse_buffer<float> tiny(0, 3);
  CHECK_THROWS_WITH((m.merge<float, std::uint32_t>(in, tiny, reduction::sum, ex)),
                    Catch::Matchers::Contains("output capacity 3 is below the 4 input pairs"));
}

TEST_CASE("aggregate: merges sparse unions, scatters dense ones", "[pack][aggregate]") {
  STATIC_REQUIRE(choose_aggregate(24, 100, 0.25) == aggregate_kind::sparse);
  STATIC_REQUIRE(choose_aggregate(25, 100, 0.25) == aggregate_kind::dense);
  STATIC_REQUIRE(choose_aggregate(0, 0, 0.25) == aggregate_kind::dense);
  thread_pool pool(2);
  sparse_merger m;
  const std::uint64_t n = 40000;
  std::vector<test::selection<std::uint32_t>> low, high;
  for (std::uint32_t r = 0; r < 4; ++r) {
    low.push_back(random_selection<std::uint32_t>(n, 400, r));
    high.push_back(random_selection<std::uint32_t>(n, 4000, r));
  }
  sparse_buffer<float> sparse(0, 16000);
  std::vector<float> dense(n, 5.0f);
  const auto lin = views(low);
  const auto hin = views(high);
  CHECK(m.aggregate<float, std::uint32_t>(lin, sparse, dense, {.op = reduction::mean}, pool) ==
        aggregate_kind::sparse);
  CHECK(sparse.size() > 1500);
  CHECK(dense[0] == 5.0f);
  CHECK(m.aggregate<float, std::uint32_t>(hin, sparse, dense,
                                          {.op = reduction::mean, .dense_threshold = 0.4},
                                          pool) == aggregate_kind::dense);
  const auto ref = reference(hin, 0.25f);
  for (const auto& [i, v] : ref) REQUIRE(dense[i] == v);
  CHECK(m.aggregate<float, std::uint32_t>(hin, sparse, dense, {.dense_threshold = 0.41}, pool) ==
        aggregate_kind::sparse);
  CHECK(m.aggregate<float, std::uint32_t>(hin, sparse, {}, {.dense_threshold = 0.0}, pool) ==
        aggregate_kind::sparse);
}
