// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/runtime_selector.hpp>

#include "catch.hpp"
#include "compress_test_support.hpp"
#include "selection_oracle.hpp"

#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

constexpr selection_method all_methods[] = {
    selection_method::exact_topk, selection_method::threshold, selection_method::sampled_threshold,
    selection_method::block_topk, selection_method::random_k};

template <class Value, class Index>
std::vector<std::uint64_t> indices_of(const sparse_buffer<Value, Index>& out) {
  return {out.indices().begin(), out.indices().end()};
}

}  // namespace

using value_types = std::tuple<float, fp16, bf16>;

TEMPLATE_LIST_TEST_CASE(
    "error feedback: everything sent plus the residual is everything accumulated", "[compress][ef]",
    value_types) {
  const std::uint64_t n = 100'003;
  thread_pool pool(2);
  for (selection_method method : all_methods) {
    for (std::uint32_t parts : {1u, 3u}) {
      CAPTURE(static_cast<int>(method), parts);
      error_feedback_compressor<runtime_selector<>, TestType> ef(runtime_selector<>(
          {.method = method, .part = {.rank = parts - 1, .parts = parts}, .seed = 7}));
      ef.add_tensor(pool, 4, n, n / 50);
      sparse_buffer<TestType> out(n, n / 50);
      std::vector<double> sent(n, 0.0);
      std::vector<double> grads(n, 0.0);
      for (std::uint64_t step = 0; step < 30; ++step) {
        const auto g = gaussian(n, step, 1.0f + 0.1f * static_cast<float>(step % 5));
        for (std::uint64_t i = 0; i < n; ++i) grads[i] += g[i];
        const std::uint64_t k = n / 100 + step;
        const auto st = ef.compress(pool, 4, g, k, out);
        const auto slice = slice_of({.rank = parts - 1, .parts = parts}, n, k, step);
        REQUIRE(st.count == out.size());
        REQUIRE(out.size() == slice.k);
        REQUIRE(out.dense_size() == n);
        validate_sparse(out.view(), index_order::strictly_ascending);
        for (std::uint64_t j = 0; j < out.size(); ++j) {
          REQUIRE(out.indices()[j] >= slice.begin);
          REQUIRE(out.indices()[j] < slice.end);
          sent[out.indices()[j]] += to_float(out.values()[j]);
        }
      }
      const auto r = ef.residual(4);
      double worst = 0;
      for (std::uint64_t i = 0; i < n; ++i)
        worst = std::max(worst, std::abs(sent[i] + r[i] - grads[i]));
      CAPTURE(worst);
      REQUIRE(worst < 1e-4);
      REQUIRE(ef.step(4) == 30);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("error feedback: the residual is acc minus what was sent, exactly",
                        "[compress][ef]", value_types) {
  const std::uint64_t n = 50'000;
  inline_executor ex;
  error_feedback_compressor<exact_topk_selector<>, TestType> ef;
  ef.add_tensor(ex, 0, n);
  sparse_buffer<TestType> out;
  std::vector<float> acc(n, 0.0f);
  for (std::uint64_t step = 0; step < 5; ++step) {
    const auto g = gaussian(n, 10 + step);
    for (std::uint64_t i = 0; i < n; ++i) acc[i] = g[i] + acc[i];
    const std::uint64_t k = 400;
    ef.compress(ex, 0, g, k, out);
    // The exact top-k of acc, values rounded to nearest even.
    REQUIRE(indices_of(out) == reference_topk_indices<float>(acc, k));
    std::vector<bool> was_sent(n, false);
    for (std::uint64_t j = 0; j < out.size(); ++j) {
      const auto i = out.indices()[j];
      was_sent[i] = true;
      REQUIRE(std::bit_cast<std::uint32_t>(to_float(out.values()[j])) ==
              std::bit_cast<std::uint32_t>(to_float(from_float<TestType>(acc[i]))));
      acc[i] = acc[i] - to_float(out.values()[j]);
    }
    const auto r = ef.residual(0);
    for (std::uint64_t i = 0; i < n; ++i)
      REQUIRE(std::bit_cast<std::uint32_t>(r[i]) == std::bit_cast<std::uint32_t>(acc[i]));
    if constexpr (std::is_same_v<TestType, float>) {
      for (std::uint64_t i = 0; i < n; ++i) {
        if (was_sent[i]) REQUIRE(r[i] == 0.0f);
      }
    }
  }
}

TEST_CASE(
    "error feedback: fp16 saturates and keeps the excess; non-finite values clear their residual",
    "[compress][ef]") {
  inline_executor ex;
  error_feedback_compressor<exact_topk_selector<>, fp16> ef;
  ef.add_tensor(ex, 1, 64);
  std::vector<float> g(64, 0.001f);
  g[3] = 1.0e6f;
  g[9] = -std::numeric_limits<float>::infinity();
  g[20] = std::numeric_limits<float>::quiet_NaN();
  sparse_buffer<fp16> out;
  ef.compress(ex, 1, g, 3, out);
  REQUIRE(indices_of(out) == std::vector<std::uint64_t>{3, 9, 20});
  REQUIRE(to_float(out.values()[0]) == 65504.0f);
  REQUIRE(std::isinf(to_float(out.values()[1])));
  REQUIRE(std::isnan(to_float(out.values()[2])));
  const auto r = ef.residual(1);
  REQUIRE(r[3] == 1.0e6f - 65504.0f);
  REQUIRE(r[9] == 0.0f);
  REQUIRE(r[20] == 0.0f);
  REQUIRE(r[0] == 0.001f);
  // The excess goes out over the next steps.
  std::vector<float> zero(64, 0.0f);
  ef.compress(ex, 1, zero, 1, out);
  REQUIRE(out.indices()[0] == 3);
  REQUIRE(to_float(out.values()[0]) == 65504.0f);
}

TEST_CASE("error feedback with DGC momentum correction", "[compress][ef][momentum]") {
  const std::uint64_t n = 40'000;
  const float mu = 0.9f;
  thread_pool pool(2);
  for (selection_method method : {selection_method::exact_topk, selection_method::threshold}) {
    error_feedback_compressor<runtime_selector<>, float, std::uint32_t, feedback::momentum> ef(
        runtime_selector<>({.method = method}), {.momentum = mu});
    ef.add_tensor(pool, 2, n);
    sparse_buffer<float> out;
    std::vector<double> sent(n, 0.0);
    std::vector<double> momentum_sum(n, 0.0);  // sum over steps of u before masking
    for (std::uint64_t step = 0; step < 20; ++step) {
      const auto g = gaussian(n, 200 + step);
      const auto u_before = std::vector<float>(ef.momentum(2).begin(), ef.momentum(2).end());
      ef.compress(pool, 2, g, 300, out);
      for (std::uint64_t i = 0; i < n; ++i)
        momentum_sum[i] += static_cast<double>(mu) * u_before[i] + g[i];
      for (std::uint64_t j = 0; j < out.size(); ++j) {
        sent[out.indices()[j]] += out.values()[j];
        REQUIRE(ef.momentum(2)[out.indices()[j]] == 0.0f);  // momentum factor masking
      }
    }
    const auto v = ef.residual(2);
    double worst = 0;
    for (std::uint64_t i = 0; i < n; ++i)
      worst = std::max(worst, std::abs(sent[i] + v[i] - momentum_sum[i]));
    CAPTURE(worst);
    REQUIRE(worst < 1e-3);
  }
}

TEST_CASE("error feedback: random-k indices are regenerated from (seed + slice, step, tensor id)",
          "[compress][ef][random]") {
  const std::uint64_t n = 10'000;
  inline_executor ex;
  const partition part{.rank = 1, .parts = 2};
  using random_share = partitioned_selector<random_k_selector<>>;
  error_feedback_compressor<random_share, bf16, std::uint64_t> ef(
      random_share(part, random_k_selector<>(1234)));
  ef.add_tensor(ex, 77, n);
  sparse_buffer<bf16, std::uint64_t> out;
  for (std::uint32_t step = 0; step < 4; ++step) {
    const auto g = gaussian(n, step);
    ef.compress(ex, 77, g, 200, out);
    const auto s = slice_of(part, n, 200, step);
    std::vector<std::uint64_t> regen(s.k);
    std::vector<std::uint64_t> ws(sample_indices_workspace_words(s.end - s.begin));
    sample_sorted_indices<std::uint64_t>({.seed = 1234 + s.slice, .step = step, .tensor = 77},
                                         s.end - s.begin, s.k, regen, ws);
    for (auto& i : regen) i += s.begin;
    REQUIRE(indices_of(out) == regen);
  }
}

TEST_CASE("error feedback: SIMD and scalar paths agree", "[compress][ef]") {
  const std::uint64_t n = 70'001;
  inline_executor ex;
  for (selection_method method : all_methods) {
    CAPTURE(static_cast<int>(method));
    error_feedback_compressor<runtime_selector<scalar_arch>, bf16> a(
        runtime_selector<scalar_arch>({.method = method}));
    error_feedback_compressor<runtime_selector<xsimd::default_arch>, bf16> b(
        runtime_selector<xsimd::default_arch>({.method = method}));
    a.add_tensor(ex, 0, n);
    b.add_tensor(ex, 0, n);
    sparse_buffer<bf16> oa, ob;
    for (std::uint64_t step = 0; step < 6; ++step) {
      const auto g = gaussian(n, 900 + step);
      a.compress(ex, 0, g, 700, oa);
      b.compress(ex, 0, g, 700, ob);
      REQUIRE(indices_of(oa) == indices_of(ob));
      REQUIRE(std::equal(a.residual(0).begin(), a.residual(0).end(), b.residual(0).begin()));
    }
  }
}

TEST_CASE("error feedback: k = 0, k >= n, and argument errors", "[compress][ef]") {
  inline_executor ex;
  error_feedback_compressor<> ef;
  ef.add_tensor(ex, 5, 100);
  ef.add_tensor(ex, 2, 0);
  sparse_buffer<float> out;
  std::vector<float> g(100, 1.0f);
  ef.compress(ex, 5, g, 0, out);
  REQUIRE(out.size() == 0);
  REQUIRE(ef.residual(5)[42] == 1.0f);
  ef.compress(ex, 5, g, 1000, out);
  REQUIRE(out.size() == 100);
  REQUIRE(out.values()[42] == 2.0f);
  REQUIRE(ef.residual(5)[42] == 0.0f);
  ef.compress(ex, 2, std::span<const float>(), 10, out);
  REQUIRE(out.size() == 0);
  REQUIRE(ef.tensor_count() == 2);
  REQUIRE(ef.has_tensor(2));
  REQUIRE_FALSE(ef.has_tensor(3));
  REQUIRE_THROWS_AS(ef.add_tensor(ex, 5, 10), error);
  REQUIRE_THROWS_AS(ef.compress(ex, 3, g, 1, out), error);
  std::vector<float> short_g(99);
  try {
    ef.compress(ex, 5, short_g, 1, out);
    FAIL("no error");
  } catch (const error& e) {
    REQUIRE(e.code() == errc::size_mismatch);
  }
  using momentum_ef =
      error_feedback_compressor<threshold_selector<>, float, std::uint32_t, feedback::momentum>;
  REQUIRE_THROWS_AS(momentum_ef({.momentum = 1.0f}), error);
  REQUIRE_THROWS_AS(momentum_ef({.momentum = -0.1f}), error);
  // A momentum factor without the momentum feedback would be silently ignored: an error.
  REQUIRE_THROWS_AS(error_feedback_compressor<>({.momentum = 0.5f}), error);
  {
    error_feedback_compressor<> plain;
    momentum_ef with_momentum({.momentum = 0.5f});
    plain.add_tensor(ex, 3, 100);
    with_momentum.add_tensor(ex, 3, 100);
    REQUIRE(plain.momentum(3).empty());
    REQUIRE(with_momentum.momentum(3).size() == 100);
  }
  REQUIRE_THROWS_AS(partitioned_selector<>({.rank = 2, .parts = 2}), error);
  REQUIRE_THROWS_AS(runtime_selector<>({.part = {.rank = 2, .parts = 2}}), error);
  REQUIRE_THROWS_AS(runtime_selector<>({.method = static_cast<selection_method>(9)}), error);
  error_feedback_compressor<threshold_selector<>, float, std::uint32_t> narrow;
  REQUIRE_THROWS_AS(narrow.add_tensor(ex, 0, (std::uint64_t{1} << 32) + 1), error);
}

TEST_CASE("error feedback: tensors compress concurrently", "[compress][ef]") {
  thread_pool pool(2);
  error_feedback_compressor<threshold_selector<>, fp16> ef;
  const std::uint64_t n = 200'000;
  for (std::uint32_t id = 0; id < 4; ++id) ef.add_tensor(pool, id, n + id, n / 100);
  std::vector<sparse_buffer<fp16>> outs(4);
  std::vector<std::vector<float>> grads;
  for (std::uint32_t id = 0; id < 4; ++id) grads.push_back(gaussian(n + id, id));
  for (int step = 0; step < 3; ++step) {
    pool.bulk(4, [&](std::size_t id) {
      ef.compress(pool, static_cast<std::uint32_t>(id), grads[id], n / 100, outs[id]);
    });
  }
  error_feedback_compressor<threshold_selector<>, fp16> serial;
  inline_executor ex;
  for (std::uint32_t id = 0; id < 4; ++id) {
    serial.add_tensor(ex, id, n + id);
    sparse_buffer<fp16> out;
    for (int step = 0; step < 3; ++step) serial.compress(ex, id, grads[id], n / 100, out);
    REQUIRE(indices_of(out) == indices_of(outs[id]));
  }
}
