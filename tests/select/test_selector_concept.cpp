// SPDX-License-Identifier: Apache-2.0
// The `selector` and `selection_source` concepts: every shipped selector models them, archetypes
// that miss a requirement do not; every selector's first pass reads each element exactly once
// (error feedback depends on it); the documented minimal selector works in a compressor; the
// run-time choice gives the bits of the selector it chose.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/runtime_selector.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>
#include <stellatrain/select/threshold.hpp>

#include "select_test_support.hpp"

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::test;

namespace {

// The minimal conforming selector of the concept's documentation: the first k elements.
struct first_k_selector {
  struct tensor_state {};
  struct workspace {};
  template <executor Ex>
  void reserve(Ex&, workspace&, std::uint64_t, std::uint64_t) const {}
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex&, tensor_state&, workspace&, const Source& src, std::uint64_t n,
                              std::uint64_t k, const selection_context&, Emit&& emit) const {
    const std::uint64_t m = std::min(k, n);
    for (std::uint64_t i = 0; i < n; ++i) (void)src.load_scalar(i);  // every element once
    const auto values = src.reread();                                // what that pass produced
    for (std::uint64_t i = 0; i < m; ++i) emit(i, i, values.load_scalar(i));
    return {.count = m, .exact = m == n, .passes = 1};
  }
};

// The source of selection_source's documentation: counts the loads of every element.
struct counting_source {
  using value_type = float;
  static constexpr std::uint32_t key_mask = 0x7fffffffu;
  const float* x;
  std::uint32_t* reads;
  std::uint32_t load_scalar(std::uint64_t i) const {
    ++reads[i];
    return std::bit_cast<std::uint32_t>(x[i]);
  }
  template <class Arch>
  selection_lanes<Arch> load(std::uint64_t i) const {
    for (std::size_t l = 0; l < selection_lanes<Arch>::size; ++l) ++reads[i + l];
    return to_selection_lanes(xsimd::batch<float, Arch>::load_unaligned(x + i));
  }
  std::uint32_t peek(std::uint64_t i) const { return std::bit_cast<std::uint32_t>(x[i]); }
  void prefetch(std::uint64_t) const {}
  plain_source<float> reread() const { return {x}; }
  counting_source offset_by(std::uint64_t b) const { return {x + b, reads + b}; }
};

// Archetypes, each missing one requirement.
struct no_workspace {
  struct tensor_state {};
  template <executor Ex>
  void reserve(Ex&, int&, std::uint64_t, std::uint64_t) const {}
};
struct no_select_from : first_k_selector {
  template <executor Ex, class Source, class Emit>
  void select_from(Ex&, int&, Source&, Emit&&) const {}
};
struct state_without_save : first_k_selector {
  struct tensor_state {
    std::uint32_t bound = 0;
  };
  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, tensor_state&, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context& ctx,
                              Emit&& emit) const {
    first_k_selector::tensor_state none;
    return first_k_selector::select_from(ex, none, ws, src, n, k, ctx, emit);
  }
};
struct state_with_save : state_without_save {
  void save(const tensor_state& s, state_record_writer& w) const { w.put(s.bound); }
  void load(tensor_state& s, state_record_reader& r) const { s.bound = r.get<std::uint32_t>(); }
};
struct not_a_selector {
  int select(int) { return 0; }
};
struct no_reread {
  using value_type = float;
  static constexpr std::uint32_t key_mask = 0x7fffffffu;
  std::uint32_t load_scalar(std::uint64_t) const { return 0; }
  std::uint32_t peek(std::uint64_t) const { return 0; }
  void prefetch(std::uint64_t) const {}
  no_reread offset_by(std::uint64_t) const { return {}; }
};

// Runs one call of `sel` on a counting source over `x` and returns how often each element was
// loaded; checks the emitted count and order.
template <class S>
std::vector<std::uint32_t> reads_of_one_call(const S& sel, const std::vector<float>& x,
                                             std::uint64_t k, std::uint64_t step = 0) {
  std::vector<std::uint32_t> reads(x.size(), 0);
  typename S::tensor_state state{};
  typename S::workspace ws;
  inline_executor ex;
  std::vector<std::uint64_t> emitted;
  std::uint64_t out_of_order = 0;  // emissions whose position is not the next one
  auto emit = [&](std::uint64_t pos, std::uint64_t i, std::uint32_t) {
    out_of_order += pos != emitted.size() ? 1 : 0;
    emitted.push_back(i);
  };
  const selection_stats st = sel.select_from(ex, state, ws, counting_source{x.data(), reads.data()},
                                             x.size(), k, {.step = step}, emit);
  REQUIRE(out_of_order == 0);
  REQUIRE(st.count == emitted.size());
  REQUIRE(std::is_sorted(emitted.begin(), emitted.end()));
  REQUIRE(std::adjacent_find(emitted.begin(), emitted.end()) == emitted.end());
  return reads;
}

}  // namespace

TEST_CASE("the shipped selectors and sources model the concepts; archetypes do not",
          "[select][concept]") {
  STATIC_REQUIRE(selector<exact_topk_selector<>>);
  STATIC_REQUIRE(selector<exact_topk_selector<scalar_arch>>);
  STATIC_REQUIRE(selector<threshold_selector<>>);
  STATIC_REQUIRE(selector<sampled_threshold_selector<>>);
  STATIC_REQUIRE(selector<block_topk_selector<>>);
  STATIC_REQUIRE(selector<random_k_selector<>>);
  STATIC_REQUIRE(selector<partitioned_selector<threshold_selector<>>>);
  STATIC_REQUIRE(selector<runtime_selector<>>);
  STATIC_REQUIRE(selector<first_k_selector>);
  STATIC_REQUIRE(selector<state_with_save>);
  STATIC_REQUIRE_FALSE(selector<no_workspace>);
  STATIC_REQUIRE_FALSE(selector<no_select_from>);
  STATIC_REQUIRE_FALSE(selector<state_without_save>);
  STATIC_REQUIRE_FALSE(selector<not_a_selector>);
  STATIC_REQUIRE_FALSE(selector<int>);

  STATIC_REQUIRE(selection_source<plain_source<float>, xsimd::default_arch>);
  STATIC_REQUIRE(selection_source<plain_source<fp16>>);
  STATIC_REQUIRE(selection_source<error_feedback_source, xsimd::default_arch>);
  STATIC_REQUIRE(selection_source<momentum_source>);
  STATIC_REQUIRE(selection_source<counting_source, xsimd::default_arch>);
  STATIC_REQUIRE_FALSE(selection_source<no_reread>);
  STATIC_REQUIRE_FALSE(selection_source<no_reread, xsimd::default_arch>);
  STATIC_REQUIRE_FALSE(selection_source<float>);
}

TEMPLATE_LIST_TEST_CASE("every selector's first pass loads each element exactly once",
                        "[select][concept]", test_archs) {
  using A = TestType;
  const std::uint64_t n = 40'037;  // not a multiple of any SIMD width or block
  const auto x = row_correlated(n, 5);
  auto require_once = [](const std::vector<std::uint32_t>& reads) {
    const auto wrong =
        std::find_if(reads.begin(), reads.end(), [](std::uint32_t r) { return r != 1; });
    INFO("element " << (wrong - reads.begin()) << " loaded " << (wrong == reads.end() ? 1 : *wrong)
                    << " times");
    REQUIRE(wrong == reads.end());
  };
  for (const std::uint64_t k :
       {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{400}, n - 1, n, n + 5}) {
    CAPTURE(k);
    require_once(reads_of_one_call(exact_topk_selector<A>(), x, k));
    require_once(reads_of_one_call(threshold_selector<A>(), x, k));
    require_once(reads_of_one_call(sampled_threshold_selector<A>(), x, k));
    require_once(reads_of_one_call(block_topk_selector<A>(), x, k));
    require_once(reads_of_one_call(random_k_selector<A>(3), x, k));
    require_once(reads_of_one_call(first_k_selector(), x, k));
    for (std::uint64_t step = 0; step < 3; ++step) {
      require_once(reads_of_one_call(
          partitioned_selector<threshold_selector<A>>({.rank = 1, .parts = 3}), x, k, step));
      require_once(reads_of_one_call(runtime_selector<A>({.method = selection_method::block_topk}),
                                     x, k, step));
    }
  }
}

TEST_CASE("the documented minimal selector runs in an error-feedback compressor",
          "[select][concept]") {
  const std::uint64_t n = 1000;
  inline_executor ex;
  error_feedback_compressor<first_k_selector, bf16> ef;
  ef.add_tensor(ex, 3, n);
  sparse_buffer<bf16> out;
  std::vector<double> sent(n, 0.0), total(n, 0.0);
  for (std::uint64_t step = 0; step < 4; ++step) {
    const auto g = gaussian(n, 70 + step);
    for (std::uint64_t i = 0; i < n; ++i) total[i] += g[i];
    ef.compress(ex, 3, g, 10, out);
    REQUIRE(out.size() == 10);
    for (std::uint64_t j = 0; j < out.size(); ++j) {
      REQUIRE(out.indices()[j] == j);
      sent[j] += to_float(out.values()[j]);
    }
  }
  const auto r = ef.residual(3);
  for (std::uint64_t i = 0; i < n; ++i) REQUIRE(std::abs(sent[i] + r[i] - total[i]) < 1e-4);

  // A selector state round-trips through a compressor checkpoint.
  error_feedback_compressor<state_with_save, float> a;
  a.add_tensor(ex, 1, 50);
  const auto saved = a.save_state();
  error_feedback_compressor<state_with_save, float> b;
  b.load_state(ex, saved);
  REQUIRE(b.tensor_count() == 1);
}

TEST_CASE("a run-time choice selects the bits of the selector it chose", "[select][concept]") {
  const std::uint64_t n = 30'011;
  const std::uint64_t k = 300;
  const auto x = gaussian(n, 8);
  inline_executor ex;
  auto run = [&](const auto& sel) {
    using S = std::remove_cvref_t<decltype(sel)>;
    typename S::tensor_state state{};
    typename S::workspace ws;
    std::vector<std::uint64_t> got;
    for (std::uint64_t step = 0; step < 3; ++step) {
      got.clear();
      sel.select_from(ex, state, ws, plain_source<float>{x.data()}, n, k,
                      {.tensor = 4, .step = step},
                      [&](std::uint64_t, std::uint64_t i, std::uint32_t) { got.push_back(i); });
    }
    return got;
  };
  const partition part{.rank = 1, .parts = 2};
  CHECK(run(runtime_selector<>({.method = selection_method::exact_topk, .part = part})) ==
        run(partitioned_selector<exact_topk_selector<>>(part)));
  CHECK(run(runtime_selector<>({.method = selection_method::threshold})) ==
        run(partitioned_selector<threshold_selector<>>()));
  CHECK(run(runtime_selector<>({.method = selection_method::sampled_threshold})) ==
        run(sampled_threshold_selector<>()));
  CHECK(run(runtime_selector<>({.method = selection_method::block_topk})) ==
        run(block_topk_selector<>()));
  CHECK(run(runtime_selector<>({.method = selection_method::random_k, .seed = 9})) ==
        run(random_k_selector<>(9)));
  CHECK(run(runtime_selector<>({.method = selection_method::random_k, .seed = 9})) !=
        run(random_k_selector<>(10)));
}
