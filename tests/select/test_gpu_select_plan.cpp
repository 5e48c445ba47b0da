// SPDX-License-Identifier: Apache-2.0
// Host tests of the GPU radix select's decisions (select/detail/radix_select_plan.hpp): digit
// plans, the parallel bucket choice, and a step-by-step emulation of the kernels against the
// scalar oracle on random, tied, NaN, constant and tiny inputs in fp32/fp16/bf16, with
// candidate buffers of every size and thresholds that hit and miss.
#include <stellatrain/select/detail/radix_select_plan.hpp>

#include "catch.hpp"
#include "gpu_select_emulator.hpp"
#include "selection_oracle.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <vector>

namespace {

using namespace stellatrain;
using stellatrain::test::emulate_radix_select;
using stellatrain::test::emulator_options;

template <class T>
std::vector<std::uint32_t> keys_of(const std::vector<T>& x) {
  std::vector<std::uint32_t> keys(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) keys[i] = detail::magnitude_key(x[i]);
  return keys;
}

template <class T>
std::vector<T> gaussian(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<T> x(n);
  for (auto& v : x) v = from_float<T>(dist(rng));
  return x;
}

/// Values drawn from a handful of magnitudes with random signs: many ties everywhere.
template <class T>
std::vector<T> few_values(std::size_t n, std::uint64_t seed, int distinct) {
  std::mt19937_64 rng(seed);
  std::vector<T> x(n);
  for (auto& v : x) {
    const float m =
        static_cast<float>(static_cast<int>(rng() % static_cast<std::uint64_t>(distinct))) * 0.25f;
    v = from_float<T>(rng() % 2 ? m : -m);
  }
  return x;
}

template <class T>
void check_against_oracle(const std::vector<T>& x, std::uint64_t k,
                          const emulator_options& o = {}) {
  const auto keys = keys_of(x);
  const auto got = emulate_radix_select(keys, detail::magnitude_key_bits<T>, k, o);
  const auto want = stellatrain::test::reference_topk_indices<T>(std::span<const T>(x), k);
  INFO("n = " << x.size() << ", k = " << k << ", cap0 = " << got.cap0 << ", cap1 = " << got.cap1
              << ", threshold = " << o.threshold_key);
  REQUIRE(got.indices.size() == want.size());
  REQUIRE(got.indices == want);
  if (!want.empty()) {
    CHECK(got.state.status == 0);
    CHECK(got.state.phase == detail::radix_done);
  }
}

}  // namespace

TEST_CASE("radix digits split keys and indices top first", "[select][gpu_plan]") {
  using detail::radix_field_digit;
  CHECK(detail::radix_levels_of(31) == 3);
  CHECK(detail::radix_levels_of(15) == 2);
  CHECK(detail::radix_levels_of(0) == 0);
  CHECK(detail::radix_levels_of(11) == 1);
  CHECK(detail::radix_levels_of(12) == 2);
  CHECK(detail::radix_levels_of(64) == 6);
  CHECK(radix_field_digit(31, 0).shift == 20);
  CHECK(radix_field_digit(31, 0).bits == 11);
  CHECK(radix_field_digit(31, 1).shift == 9);
  CHECK(radix_field_digit(31, 2).shift == 0);
  CHECK(radix_field_digit(31, 2).bits == 9);
  CHECK(radix_field_digit(15, 0).shift == 4);
  CHECK(radix_field_digit(15, 1).bits == 4);

  CHECK(detail::index_bits_of(0) == 0);
  CHECK(detail::index_bits_of(1) == 0);
  CHECK(detail::index_bits_of(2) == 1);
  CHECK(detail::index_bits_of(3) == 2);
  CHECK(detail::index_bits_of(4) == 2);
  CHECK(detail::index_bits_of(5) == 3);
  CHECK(detail::index_bits_of(std::uint64_t{1} << 32) == 32);
  CHECK(detail::index_bits_of((std::uint64_t{1} << 32) + 1) == 33);
  CHECK(detail::index_bits_of(~std::uint64_t{0}) == 64);

  for (std::uint32_t bits : {1u, 9u, 11u, 15u, 22u, 31u, 33u, 64u}) {
    std::uint64_t covered = 0;
    for (std::uint32_t j = 0; j < detail::radix_levels_of(bits); ++j) {
      const auto d = radix_field_digit(bits, j);
      CHECK(d.bits >= 1);
      CHECK(d.bits <= detail::radix_digit_bits);
      CHECK((covered & d.mask()) == 0);
      covered |= d.mask();
    }
    CHECK(covered == (bits == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << bits) - 1));
  }

  const auto p = detail::make_radix_plan(31, 100'000'000);
  CHECK(p.key_levels == 3);
  CHECK(p.index_bits == 27);
  CHECK(p.index_levels == 3);
  CHECK(detail::radix_steps(p) == 8);
  CHECK(p.key_mask() == 0x7fffffffu);
}

TEST_CASE("magnitude keys rank as the shared semantics say", "[select][gpu_plan]") {
  using detail::magnitude_key;
  CHECK(magnitude_key(0.0f) == magnitude_key(-0.0f));
  CHECK(magnitude_key(-2.0f) == magnitude_key(2.0f));
  CHECK(magnitude_key(std::numeric_limits<float>::infinity()) >
        magnitude_key(std::numeric_limits<float>::max()));
  CHECK(magnitude_key(std::numeric_limits<float>::quiet_NaN()) >
        magnitude_key(std::numeric_limits<float>::infinity()));
  CHECK(magnitude_key(fp16{-1.0f}) == magnitude_key(fp16{1.0f}));
  CHECK(magnitude_key(fp16::from_bits(0x7e00)) > magnitude_key(fp16::from_bits(0x7c00)));
  CHECK(magnitude_key(bf16::from_bits(0xffc0)) > magnitude_key(bf16::from_bits(0x7f80)));
  CHECK(detail::infinity_key<float> == magnitude_key(std::numeric_limits<float>::infinity()));
  CHECK(detail::infinity_key<fp16> == magnitude_key(fp16{std::numeric_limits<float>::infinity()}));
  CHECK(detail::infinity_key<bf16> == magnitude_key(bf16{std::numeric_limits<float>::infinity()}));
  CHECK(detail::key_value<float>(magnitude_key(-3.5f)) == 3.5f);
  CHECK(detail::key_value<bf16>(magnitude_key(bf16{-3.5f})) == 3.5f);
  CHECK(detail::key_value<fp16>(magnitude_key(fp16{0.125f})) == 0.125f);
}

TEST_CASE("the parallel bucket choice equals the serial one", "[select][gpu_plan]") {
  std::mt19937_64 rng(7);
  const auto plan = detail::make_radix_plan(31, 1'000'000);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<std::uint64_t> hist(detail::device_radix_bins, 0);
    const int filled = trial % 3 == 0 ? 1 : (trial % 3 == 1 ? 7 : 500);
    for (int j = 0; j < filled; ++j) hist[rng() % detail::device_radix_bins] += 1 + rng() % 50;
    std::uint64_t total = 0;
    for (auto h : hist) total += h;
    for (std::uint32_t level :
         {0u, 3u}) {  // a key level (descending) and an index level (ascending)
      for (std::uint64_t k : {std::uint64_t{1}, total / 3 + 1, total / 2, total - 1, total}) {
        if (k == 0) continue;
        const auto serial = detail::radix_choose(hist.data(), plan, level, k);
        REQUIRE(serial.found);
        CHECK(serial.before < k);
        CHECK(k <= serial.before + serial.count);
        CHECK(serial.count == hist[detail::radix_position_digit(plan, level, serial.position)]);
        for (unsigned threads : {1u, 256u, 512u, 2048u}) {
          const auto par = stellatrain::test::parallel_choose(hist, plan, level, k, threads);
          REQUIRE(par.crossing.found);
          CHECK(par.total == total);
          CHECK(par.crossing.position == serial.position);
          CHECK(par.crossing.before == serial.before);
          CHECK(par.crossing.count == serial.count);
        }
      }
    }
  }
}

TEST_CASE("classification by the chosen bucket", "[select][gpu_plan]") {
  const auto plan = detail::make_radix_plan(31, 1000);
  detail::radix_state s{};
  s.k_remaining = 10;
  // Key level 0 chooses digit 5 (keys 5 << 20 .. (6 << 20) - 1).
  detail::radix_apply_choice(s, plan, 0, {detail::device_radix_bins - 1 - 5, 3, 20, true});
  REQUIRE(s.chosen == 5);
  REQUIRE(s.phase == detail::radix_running);
  CHECK(s.k_remaining == 7);
  CHECK(s.candidates == 20);
  CHECK(detail::radix_classify(s, plan, 6u << 20, 0) == detail::radix_class::winner);
  CHECK(detail::radix_classify(s, plan, (5u << 20) | 77u, 0) == detail::radix_class::candidate);
  CHECK(detail::radix_classify(s, plan, 4u << 20, 0) == detail::radix_class::loser);
  CHECK(detail::radix_next_digit(s, plan, (5u << 20) | (9u << 9), 0) == 9);
  // Level 1 chooses digit 9: now only keys with digit 0 == 5 are looked at.
  detail::radix_apply_choice(s, plan, 1, {detail::device_radix_bins - 1 - 9, 2, 8, true});
  CHECK(detail::radix_classify(s, plan, 6u << 20, 0) == detail::radix_class::skip);
  CHECK(detail::radix_classify(s, plan, (5u << 20) | (10u << 9), 0) == detail::radix_class::winner);
  CHECK(detail::radix_classify(s, plan, (5u << 20) | (9u << 9), 0) ==
        detail::radix_class::candidate);
  // Levels 2 (last key digit) and 3 (first index digit, ascending: lower indices win).
  detail::radix_apply_choice(s, plan, 2,
                             {(1u << 9) - 1 - 1, 1, 6, true});  // 9-bit digit: 512 positions
  CHECK(s.phase == detail::radix_running);
  const std::uint32_t t = (5u << 20) | (9u << 9) | 1u;
  CHECK(s.key_prefix == t);
  CHECK(s.key_mask == 0x7fffffffu);
  REQUIRE(plan.index_levels == 1);
  detail::radix_apply_choice(s, plan, 3, {500, 3, 1, true});
  CHECK(s.phase == detail::radix_all_in);
  CHECK(s.status == 0);
  CHECK(detail::radix_classify(s, plan, t, 499) == detail::radix_class::winner);
  CHECK(detail::radix_classify(s, plan, t, 500) == detail::radix_class::candidate);
  CHECK(detail::radix_classify(s, plan, t, 501) == detail::radix_class::loser);
  CHECK(detail::radix_classify(s, plan, t + 1, 3) == detail::radix_class::skip);
}

TEST_CASE("emulated GPU select equals the oracle: fp32", "[select][gpu_plan]") {
  SECTION("gaussian, densities 0.1% .. 100%, and past n") {
    const auto x = gaussian<float>(std::size_t{1} << 16, 11);
    for (std::uint64_t k : {1, 7, 65, 655, 6553, 32768, 65535, 65536, 70000})
      check_against_oracle(x, k);
  }
  SECTION("2^20 elements, k = 1%: two full reads, then the candidate buffer") {
    const auto x = gaussian<float>(std::size_t{1} << 20, 12);
    const auto keys = keys_of(x);
    const std::uint64_t k = x.size() / 100;
    const auto got = emulate_radix_select(keys, 31, k);
    CHECK(got.indices ==
          stellatrain::test::reference_topk_indices<float>(std::span<const float>(x), k));
    CHECK(got.full_reads == 2);
    CHECK(got.buffer_reads >= 1);
  }
  SECTION("tiny inputs: every n below two warps and every k") {
    for (std::size_t n = 0; n <= 70; ++n) {
      const auto x = gaussian<float>(n, 100 + n);
      for (std::uint64_t k = 0; k <= n + 1; ++k) check_against_oracle(x, k);
    }
  }
  SECTION("NaN and infinities rank first, signed zeros tie") {
    std::vector<float> x = gaussian<float>(5000, 13);
    const float inf = std::numeric_limits<float>::infinity();
    x[10] = std::numeric_limits<float>::quiet_NaN();
    x[20] = -inf;
    x[30] = inf;
    x[40] = -std::numeric_limits<float>::quiet_NaN();
    x[50] = std::bit_cast<float>(0x7fc00001u);  // NaN with a larger payload
    for (std::size_t i = 100; i < 400; ++i) x[i] = i % 2 ? 0.0f : -0.0f;
    for (std::uint64_t k : {1, 2, 3, 5, 6, 100, 4700, 4750, 4999}) check_against_oracle(x, k);
  }
  SECTION("all equal and all zero: ties resolved by index digits") {
    for (float v : {0.0f, -1.5f}) {
      std::vector<float> x(10'000, v);
      for (std::size_t i = 1; i < x.size(); i += 2) x[i] = -x[i];
      for (std::uint64_t k : {1, 2, 1234, 5000, 9999, 10'000}) {
        check_against_oracle(x, k);
        // Small buffers: the index levels have to read the tensor.
        check_against_oracle(x, k, {.cap0 = 100, .cap1 = 100});
      }
    }
  }
  SECTION("few distinct values, candidate buffers from 1 entry to n") {
    const auto x = few_values<float>(20'000, 14, 9);
    for (std::uint64_t cap : {1, 2, 1000, 5000, 19'999, 20'000}) {
      for (std::uint64_t k : {1, 2221, 10'000, 19'000})
        check_against_oracle(x, k, {.cap0 = cap, .cap1 = cap});
    }
    check_against_oracle(x, 4321, {.cap0 = 20'000, .cap1 = 3});
    check_against_oracle(x, 4321, {.cap0 = 3, .cap1 = 20'000});
  }
  SECTION("a tied bucket of exactly the buffer capacity, and one more") {
    // 2.0 x 777 at scattered indices, 1.0 elsewhere: the first bucket holds 777 elements.
    std::vector<float> x(50'000, 1.0f);
    for (std::size_t i = 0; i < 777; ++i) x[(i * 7919) % x.size()] = 2.0f;
    for (std::uint64_t cap : {775, 776, 777, 778}) {
      for (std::uint64_t k : {100, 776, 777, 778, 5000})
        check_against_oracle(x, k, {.cap0 = cap, .cap1 = cap});
    }
  }
}

TEST_CASE("emulated GPU select equals the oracle: fp16 and bf16", "[select][gpu_plan]") {
  SECTION("fp16 gaussian and tied") {
    const auto x = gaussian<fp16>(50'000, 21);
    for (std::uint64_t k : {1, 50, 500, 5000, 25'000, 49'999}) check_against_oracle(x, k);
    const auto t = few_values<fp16>(30'000, 22, 5);
    for (std::uint64_t k : {1, 3000, 17'777}) check_against_oracle(t, k);
  }
  SECTION("bf16: many exact ties at the threshold") {
    const auto x = gaussian<bf16>(100'000, 23);
    for (std::uint64_t k : {1, 100, 1000, 10'000, 60'000}) check_against_oracle(x, k);
    check_against_oracle(x, 1000, {.cap0 = 10, .cap1 = 10});
  }
  SECTION("16-bit NaN and infinity") {
    auto x = gaussian<bf16>(3000, 24);
    x[5] = bf16::from_bits(0x7fc1);
    x[6] = bf16::from_bits(0xff80);
    auto h = gaussian<fp16>(3000, 25);
    h[7] = fp16::from_bits(0xfe00);
    h[8] = fp16::from_bits(0x7c00);
    for (std::uint64_t k : {1, 2, 3, 300}) {
      check_against_oracle(x, k);
      check_against_oracle(h, k);
    }
  }
}

TEST_CASE("emulated threshold selection is exact whether the threshold hits or misses",
          "[select][gpu_plan]") {
  const auto x = gaussian<float>(200'000, 31);
  const auto keys = keys_of(x);
  const std::uint64_t k = 2000;
  const auto want = stellatrain::test::reference_topk_indices<float>(std::span<const float>(x), k);
  auto kth = keys;
  std::nth_element(kth.begin(), kth.begin() + static_cast<std::ptrdiff_t>(k - 1), kth.end(),
                   std::greater<>());
  const std::uint32_t t = kth[k - 1];

  SECTION("a good threshold: one full read") {
    const auto thr = detail::magnitude_key(detail::key_value<float>(t) * 0.97f);
    const auto got =
        emulate_radix_select(keys, 31, k, {.threshold_key = thr, .threshold_mode = true});
    CHECK(got.indices == want);
    CHECK(got.full_reads == 1);
    CHECK((got.state.flags & 2u) != 0);
    CHECK((got.state.flags & 1u) == 0);
    CHECK(got.state.scan_total >= k);
  }
  SECTION("the k-th key itself as threshold") {
    const auto got =
        emulate_radix_select(keys, 31, k, {.threshold_key = t, .threshold_mode = true});
    CHECK(got.indices == want);
    CHECK(got.full_reads == 1);
  }
  SECTION("too high: too few candidates, exact fallback in the same call") {
    const auto got =
        emulate_radix_select(keys, 31, k, {.threshold_key = t + 1, .threshold_mode = true});
    CHECK(got.indices == want);
    CHECK((got.state.flags & 1u) != 0);
    CHECK(got.full_reads >= 3);
  }
  SECTION("too low: more candidates than buffer 0 holds") {
    const auto thr = detail::magnitude_key(detail::key_value<float>(t) * 0.2f);
    const auto got =
        emulate_radix_select(keys, 31, k, {.threshold_key = thr, .threshold_mode = true});
    CHECK(got.indices == want);
    CHECK((got.state.flags & 1u) != 0);
    CHECK(got.state.scan_total > got.cap0);
  }
  SECTION("ties at a bf16 threshold") {
    const auto b = gaussian<bf16>(100'000, 32);
    const auto bk = keys_of(b);
    const auto bwant =
        stellatrain::test::reference_topk_indices<bf16>(std::span<const bf16>(b), 777);
    auto sorted = bk;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (std::uint32_t thr : {sorted[776], sorted[900], sorted[700], sorted[5000]}) {
      const auto got =
          emulate_radix_select(bk, 15, 777, {.threshold_key = thr, .threshold_mode = true});
      CHECK(got.indices == bwant);
    }
  }
}

TEST_CASE("the threshold state moves with the k-th magnitude", "[select][gpu_plan]") {
  const detail::threshold_update_options o{0.03f, 0.005f, 0.5f};
  topk_threshold_state t{};
  // Bootstrap (no threshold used): key from the k-th magnitude, initial slack.
  detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 0u, 0, 100, o);
  CHECK(t.slack == 0.03f);
  CHECK(t.key == detail::magnitude_key(2.0f * (1.0f - 0.03f)));
  CHECK(t.calls == 1);
  // A hit narrows the slack.
  detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 2u, 150, 100, o);
  CHECK(t.slack < 0.03f);
  CHECK(t.candidates == 150);
  CHECK(t.misses == 0);
  // A miss with too few candidates widens it.
  const float before = t.slack;
  detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 3u, 50, 100, o);
  CHECK(t.slack > before);
  CHECK(t.misses == 1);
  // Too many candidates: narrower.
  const float wide = t.slack;
  detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 3u, 5000, 100, o);
  CHECK(t.slack < wide);
  CHECK(t.misses == 2);
  // Non-finite or zero k-th magnitude: no threshold next time.
  detail::update_threshold_state<float>(t, detail::infinity_key<float>, 2u, 150, 100, o);
  CHECK(t.key == 0);
  detail::update_threshold_state<bf16>(t, 0u, 2u, 150, 100, o);
  CHECK(t.key == 0);
  detail::update_threshold_state<bf16>(t, detail::magnitude_key(bf16{1.0f}), 2u, 150, 100, o);
  CHECK(t.key != 0);
  CHECK(t.key < detail::magnitude_key(bf16{1.0f}));
  // Slack bounds.
  for (int i = 0; i < 40; ++i)
    detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 3u, 1, 100, o);
  CHECK(t.slack == 0.5f);
  for (int i = 0; i < 400; ++i)
    detail::update_threshold_state<float>(t, detail::magnitude_key(2.0f), 2u, 150, 100, o);
  CHECK(t.slack == 0.005f);
}

TEST_CASE("error feedback rounding keeps what the value lost", "[select][gpu_plan]") {
  float sent32 = 0;
  CHECK(detail::quantize_with_feedback(1.25f, sent32) == 0.0f);
  CHECK(sent32 == 1.25f);
  bf16 sent{};
  const float acc = 1.0f + 1.0f / 1024;  // not representable in bf16 (7 mantissa bits)
  const float r = detail::quantize_with_feedback(acc, sent);
  CHECK(sent.to_float() == 1.0f);
  CHECK(r == 1.0f / 1024);
  CHECK(sent.to_float() + r == acc);
  fp16 h{};
  CHECK(detail::quantize_with_feedback(100000.0f, h) == 0.0f);  // overflows fp16: not fed back
  CHECK(h.bits() == 0x7c00);
  CHECK(detail::quantize_with_feedback(std::numeric_limits<float>::quiet_NaN(), h) == 0.0f);
  CHECK(detail::quantize_with_feedback(-std::numeric_limits<float>::infinity(), sent32) == 0.0f);
  // Same type: bit copy (a NaN payload survives).
  const auto nan = bf16::from_bits(0x7f81);
  CHECK(detail::convert_value<bf16>(nan).bits() == 0x7f81);
  CHECK(detail::convert_value<float>(fp16{0.5f}) == 0.5f);
  CHECK(detail::convert_value<fp16>(0.1f).bits() == fp16{0.1f}.bits());
}

TEST_CASE("emulated error feedback equals the scalar definition", "[select][gpu_plan]") {
  const std::size_t n = 30'000;
  const auto g = gaussian<bf16>(n, 41);
  auto residual = gaussian<float>(n, 42, 0.1f);
  const std::uint64_t k = 300;
  for (int step = 0; step < 3; ++step) {
    std::vector<float> acc(n);
    for (std::size_t i = 0; i < n; ++i) acc[i] = g[i].to_float() + residual[i];
    const auto sel = emulate_radix_select(keys_of(acc), 31, k);
    REQUIRE(sel.indices ==
            stellatrain::test::reference_topk_indices<float>(std::span<const float>(acc), k));
    std::vector<float> next = acc;
    double sent_energy = 0;
    for (auto i : sel.indices) {
      bf16 v{};
      next[i] = detail::quantize_with_feedback(acc[i], v);
      CHECK(std::fabs(next[i]) <= std::fabs(acc[i]) / 128.0f);  // bf16 keeps 8 significant bits
      CHECK(v.to_float() + next[i] == acc[i]);
      sent_energy += static_cast<double>(v.to_float()) * v.to_float();
    }
    CHECK(sent_energy > 0);
    residual = next;
  }
}

TEST_CASE("the workspace layout is aligned, disjoint and complete", "[select][gpu_plan]") {
  for (std::uint64_t n : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{1000},
                          std::uint64_t{100'000'000}, (std::uint64_t{1} << 32) + 5}) {
    const std::uint64_t k = n / 100;
    const auto plan = detail::make_radix_plan(31, n);
    const auto w = detail::plan_radix_workspace(n, k, plan, 1.0 / 32, 2.0, 1000,
                                                std::min<std::uint64_t>(n, 65536), 3000, k, 777);
    const std::vector<std::pair<std::size_t, std::size_t>> parts{
        {w.state, sizeof(detail::radix_state)},
        {w.tickets, 4 * w.steps},
        {w.appended, 8 * w.steps},
        {w.histograms, 8 * detail::device_radix_bins * w.steps},
        {w.buffer0, w.cap0 * w.entry_bytes},
        {w.buffer1, w.cap1 * w.entry_bytes},
        {w.bitmap, w.words * 4},
        {w.tile_counts, w.tiles * 8},
        {w.tile_offsets, w.tiles * 8},
        {w.scan_temp, 1000},
        {w.sample_keys, w.samples * 4},
        {w.sample_sorted, w.samples * 4},
        {w.sort_temp, 3000},
        {w.cub_keys, k * 8},
        {w.cub_temp, 777}};
    std::size_t end = 0;
    for (const auto& [at, bytes] : parts) {
      CHECK(at % detail::workspace_alignment == 0);
      CHECK(at >= end);
      end = at + bytes;
    }
    CHECK(w.total >= end + detail::workspace_alignment);
    CHECK(w.control_bytes == w.buffer0);
    CHECK(w.entry_bytes == (n <= (std::uint64_t{1} << 32) ? 4u : 8u));
    CHECK(w.words == (n + 31) / 32);
    CHECK(w.tiles * detail::compaction_tile_words >= w.words);
    CHECK(w.cap0 >= w.cap1);
    CHECK(w.cap1 <= n);
    CHECK(w.cap0 <= n);
    if (n >= 65536) CHECK(w.cap1 >= std::max<std::uint64_t>(65536, n / 32));
    if (n > 0 && 2 * k < n) CHECK(w.cap0 >= 2 * k);
  }
}

TEST_CASE("sample positions stay in their strides; the sampled rank scales with k/n",
          "[select][gpu_plan]") {
  const std::uint64_t n = 1'000'003;
  const std::uint64_t samples = 65536;
  const std::uint64_t stride = n / samples;
  std::uint64_t previous = 0;
  for (std::uint64_t j = 0; j < samples; ++j) {
    const auto i = detail::sample_position(j, stride, 99);
    REQUIRE(i >= j * stride);
    REQUIRE(i < (j + 1) * stride);
    REQUIRE(i < n);
    if (j > 0) REQUIRE(i > previous);
    previous = i;
  }
  CHECK(detail::sample_position(5, 1, 3) == 5);
  CHECK(detail::sample_threshold_rank(n, n / 100, samples, 1.0) == samples / 100);
  CHECK(detail::sample_threshold_rank(n, n / 100, samples, 1.25) == samples * 5 / 400);
  CHECK(detail::sample_threshold_rank(n, 1, samples, 1.0) == 0);
  CHECK(detail::sample_threshold_rank(n, n, samples, 2.0) == samples - 1);
  CHECK(detail::sample_threshold_rank(100, 10, 100, 1.0) == 9);
}
