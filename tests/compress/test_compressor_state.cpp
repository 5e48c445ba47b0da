// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/runtime_selector.hpp>

#include "catch.hpp"
#include "compress_test_support.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using namespace stellatrain;

namespace {

// A conforming compressor with nothing inside (the concept's documentation example).
struct send_all {
  using value_type = float;
  using index_type = std::uint32_t;
  template <executor E>
  void add_tensor(E&, std::uint32_t, std::uint64_t) {}
  template <executor E>
  selection_stats compress(E&, std::uint32_t, std::span<const float> g, std::uint64_t,
                           sparse_buffer<float>& out) {
    out.reserve(g.size());
    out.resize(g.size());
    out.set_dense_size(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      out.indices()[i] = static_cast<std::uint32_t>(i);
      out.values()[i] = g[i];
    }
    return {.count = g.size()};
  }
  std::span<const float> residual(std::uint32_t) const { return {}; }
  std::vector<std::byte> save_state() const { return {}; }
  template <executor E>
  void load_state(E&, std::span<const std::byte>) {}
};

struct no_state : send_all {
  void save_state() const {}
};

struct bad_value_type : send_all {
  using value_type = double;
};

}  // namespace

TEST_CASE("the compressor concept", "[compress][concept]") {
  STATIC_REQUIRE(compressor<send_all>);
  STATIC_REQUIRE(compressor<error_feedback_compressor<>>);
  STATIC_REQUIRE(compressor<error_feedback_compressor<exact_topk_selector<>, fp16, std::uint64_t>>);
  STATIC_REQUIRE(
      compressor<error_feedback_compressor<threshold_selector<scalar_arch>, bf16, std::uint32_t>>);
  STATIC_REQUIRE(compressor<error_feedback_compressor<runtime_selector<>, bf16>>);
  STATIC_REQUIRE_FALSE(compressor<no_state>);
  STATIC_REQUIRE_FALSE(compressor<int>);
  STATIC_REQUIRE_FALSE(compressor<exact_topk_selector<>>);
}

TEST_CASE("a restored compressor continues exactly as the uninterrupted one", "[compress][state]") {
  const std::uint64_t n = 120'007;
  const selection_method methods[] = {selection_method::exact_topk, selection_method::threshold,
                                      selection_method::sampled_threshold,
                                      selection_method::block_topk, selection_method::random_k};
  auto check = [&]<feedback Feedback>(selection_method method, float momentum) {
    using compressor_type =
        error_feedback_compressor<runtime_selector<>, bf16, std::uint32_t, Feedback>;
    CAPTURE(static_cast<int>(method), momentum);
    const runtime_selector<> sel({.method = method, .part = {.rank = 1, .parts = 2}, .seed = 3});
    const error_feedback_options options{.momentum = momentum};
    inline_executor ex;
    compressor_type a(sel, options);
    a.add_tensor(ex, 9, n);
    a.add_tensor(ex, 4, n / 3);
    sparse_buffer<bf16> out;
    for (std::uint64_t step = 0; step < 7; ++step) {
      a.compress(ex, 9, test::gaussian(n, step), n / 100, out);
      a.compress(ex, 4, test::gaussian(n / 3, 50 + step), n / 300, out);
    }
    const std::vector<std::byte> saved = a.save_state();
    compressor_type b(sel, options);
    b.load_state(ex, saved);
    REQUIRE(b.tensor_count() == 2);
    REQUIRE(b.step(9) == 7);
    sparse_buffer<bf16> oa, ob;
    for (std::uint64_t step = 7; step < 12; ++step) {
      const auto g = test::gaussian(n, step);
      a.compress(ex, 9, g, n / 100, oa);
      b.compress(ex, 9, g, n / 100, ob);
      REQUIRE(std::equal(oa.indices().begin(), oa.indices().end(), ob.indices().begin(),
                         ob.indices().end()));
      for (std::uint64_t j = 0; j < oa.size(); ++j)
        REQUIRE(same_bits(oa.values()[j], ob.values()[j]));
    }
    REQUIRE(std::equal(a.residual(9).begin(), a.residual(9).end(), b.residual(9).begin()));
    REQUIRE(std::equal(a.momentum(9).begin(), a.momentum(9).end(), b.momentum(9).begin()));
    if (method == selection_method::threshold) {
      // runtime_selector's alternative 1: the threshold selector, partitioned.
      const auto& sa = std::get<1>(a.selection_state(9)).slices;
      const auto& sb = std::get<1>(b.selection_state(9)).slices;
      REQUIRE(sa.size() == 2);
      REQUIRE(sa[1].calls > 0);
      REQUIRE(sa[1].low_key == sb[1].low_key);
      REQUIRE(sa[1].calls == sb[1].calls);
    }
  };
  for (selection_method method : methods) {
    check.operator()<feedback::plain>(method, 0.0f);
    check.operator()<feedback::momentum>(method, 0.9f);
  }
}

TEST_CASE("load_state rejects malformed or foreign state", "[compress][state]") {
  using threshold_ef = error_feedback_compressor<runtime_selector<>, float>;
  const runtime_selector<> threshold({.method = selection_method::threshold});
  inline_executor ex;
  threshold_ef a(threshold);
  a.add_tensor(ex, 1, 1000);
  sparse_buffer<float> out;
  a.compress(ex, 1, test::gaussian(1000, 1), 10, out);
  const auto saved = a.save_state();
  auto code_of = [&](auto&& make, std::span<const std::byte> bytes) {
    auto c = make();
    try {
      c.load_state(ex, bytes);
    } catch (const error& e) {
      return e.code();
    }
    return std::error_code{};
  };
  auto same = [&] { return threshold_ef(threshold); };
  REQUIRE(code_of(same, saved) == std::error_code{});
  // Truncated anywhere.
  for (std::size_t cut :
       {std::size_t{0}, std::size_t{3}, std::size_t{20}, saved.size() / 2, saved.size() - 1}) {
    CAPTURE(cut);
    REQUIRE(code_of(same, std::span(saved).first(cut)) == errc::malformed_message);
  }
  // Trailing bytes.
  auto longer = saved;
  longer.push_back(std::byte{0});
  REQUIRE(code_of(same, longer) == errc::malformed_message);
  // Wrong magic, wrong version, a flipped bit.
  auto bad = saved;
  bad[0] = std::byte{0};
  REQUIRE(code_of(same, bad) == errc::malformed_message);
  bad = saved;
  bad[8] = std::byte{9};
  REQUIRE(code_of(same, bad) == errc::version_mismatch);
  bad = saved;
  bad[saved.size() / 2] ^= std::byte{1};
  REQUIRE(code_of(same, bad) == errc::checksum_mismatch);
  // Saved by another configuration.
  REQUIRE(code_of([&] { return error_feedback_compressor<runtime_selector<>, fp16>(threshold); },
                  saved) == errc::invalid_argument);
  REQUIRE(
      code_of(
          [] { return threshold_ef(runtime_selector<>({.method = selection_method::exact_topk})); },
          saved) == errc::invalid_argument);
  REQUIRE(code_of(
              [&] {
                return error_feedback_compressor<runtime_selector<>, float, std::uint32_t,
                                                 feedback::momentum>(threshold, {.momentum = 0.5f});
              },
              saved) == errc::invalid_argument);
  // A size that claims more than the input holds (the record's checksum made to match).
  bad = saved;
  const std::size_t tensor_record = 32 + 16 + 11 + 4;  // container header, CONF record
  REQUIRE(std::memcmp(bad.data() + tensor_record, "TNSR", 4) == 0);
  std::uint64_t length;
  std::memcpy(&length, bad.data() + tensor_record + 8, 8);
  const std::uint64_t claimed = 2000;
  std::memcpy(bad.data() + tensor_record + 16 + 4, &claimed, 8);  // after the id
  const auto record = std::span<const std::byte>(bad).subspan(tensor_record, 16 + length);
  const std::uint32_t crc = crc32c(record);
  std::memcpy(bad.data() + tensor_record + 16 + length, &crc, 4);
  REQUIRE(code_of(same, bad) == errc::malformed_message);
  // A failed load leaves the compressor as it was.
  auto c = same();
  c.add_tensor(ex, 8, 10);
  REQUIRE_THROWS(c.load_state(ex, std::span(saved).first(30)));
  REQUIRE_THROWS(c.load_state(ex, bad));
  REQUIRE(c.has_tensor(8));
  REQUIRE(c.tensor_count() == 1);
}
