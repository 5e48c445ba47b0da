// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/compress/chunked_codec.hpp>

#include "catch.hpp"
#include "compress_test_support.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using namespace stellatrain;
using test::gaussian;

namespace {

// Small integers: many equal magnitudes, so the tie rule decides.
std::vector<float> ties(std::uint64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> dist(-3, 3);
  std::vector<float> x(n);
  for (auto& v : x) v = static_cast<float>(dist(rng));
  return x;
}

// The definition, written plainly: what encode must produce from acc = decay * f + g.
struct reference {
  std::vector<std::uint16_t> indices;
  std::vector<unsigned> codes;
  std::vector<float> scales;
  std::vector<float> feedback;
};

reference encode_reference(const std::vector<float>& g, std::vector<float> f,
                           const chunked_codec_options& o) {
  reference r;
  for (std::size_t i = 0; i < f.size(); ++i)
    f[i] = o.decay == 1.0f ? f[i] + g[i] : o.decay * f[i] + g[i];
  const std::uint64_t chunk = std::uint64_t{1} << o.chunk_bits;
  for (std::uint64_t begin = 0; begin < f.size(); begin += chunk) {
    const std::uint64_t len = std::min<std::uint64_t>(chunk, f.size() - begin);
    std::vector<std::uint64_t> order(len);
    std::iota(order.begin(), order.end(), 0);
    auto mag = [&](std::uint64_t i) {
      return std::bit_cast<std::uint32_t>(f[begin + i]) & 0x7fffffffu;
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](std::uint64_t a, std::uint64_t b) { return mag(a) > mag(b); });
    order.resize(std::min<std::uint64_t>(o.k, len));
    std::sort(order.begin(), order.end());
    std::vector<double> m;
    for (auto i : order) m.push_back(std::fabs(f[begin + i]));
    float lo = 0, hi = 0, split = 0;
    if (o.bits == chunk_value_bits::one) {
      lo = hi = bf16(static_cast<float>(std::accumulate(m.begin(), m.end(), 0.0) /
                                        static_cast<double>(m.size())))
                    .to_float();
      r.scales.push_back(lo);
    } else {
      const float mn = static_cast<float>(*std::min_element(m.begin(), m.end()));
      const float mx = static_cast<float>(*std::max_element(m.begin(), m.end()));
      split = mn + (mx - mn) * 0.5f;
      double sl = 0, sh = 0;
      int nl = 0, nh = 0;
      for (double v : m) {
        if (static_cast<float>(v) > split) {
          sh += v;
          ++nh;
        } else {
          sl += v;
          ++nl;
        }
      }
      lo = bf16(static_cast<float>(sl / nl)).to_float();
      hi = nh ? bf16(static_cast<float>(sh / nh)).to_float() : lo;
      r.scales.push_back(lo);
      r.scales.push_back(hi);
    }
    for (auto i : order) {
      float& x = f[begin + i];
      const bool high = o.bits == chunk_value_bits::two && std::fabs(x) > split;
      const unsigned code = (std::signbit(x) ? 1u : 0u) | (high ? 2u : 0u);
      const float sent = (std::signbit(x) ? -1.0f : 1.0f) * (high ? hi : lo);
      r.indices.push_back(static_cast<std::uint16_t>(i));
      r.codes.push_back(code);
      x -= sent;
    }
  }
  r.feedback = f;
  return r;
}

// The code of the error `f` throws (0 if none).
template <class F>
int thrown(F&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.code().value();
  }
  return 0;
}
constexpr int invalid = static_cast<int>(errc::invalid_argument);
constexpr int out_of_range = static_cast<int>(errc::out_of_range);

unsigned code_at(const chunked_selection& s, std::size_t j) {
  const unsigned w = static_cast<unsigned>(s.bits);
  return (s.codes[j * w / 8] >> (j * w % 8)) & ((1u << w) - 1);
}

void check_against_reference(const std::vector<float>& g, const std::vector<float>& f0,
                             const chunked_codec_options& o) {
  chunked_codec codec(o);
  auto f = f0;
  chunked_selection s;
  codec.encode(g, f, s);
  const reference r = encode_reference(g, f0, o);
  REQUIRE(s.indices == r.indices);
  REQUIRE(s.scales.size() == r.scales.size());
  for (std::size_t i = 0; i < r.scales.size(); ++i) CHECK(s.scales[i].to_float() == r.scales[i]);
  for (std::size_t j = 0; j < r.codes.size(); ++j) REQUIRE(code_at(s, j) == r.codes[j]);
  CHECK(f == r.feedback);
}

}  // namespace

TEST_CASE("chunked codec: the top k of every chunk, as the definition says",
          "[compress][chunked]") {
  for (unsigned b : {4u, 8u, 12u}) {
    for (std::uint32_t k : {1u, 3u, 16u}) {
      if (k > (1u << b)) continue;
      for (auto bits : {chunk_value_bits::one, chunk_value_bits::two}) {
        for (float decay : {1.0f, 0.95f}) {
          for (std::uint64_t n : {std::uint64_t{1} << b, (std::uint64_t{5} << b) + 7}) {
            INFO("b " << b << " k " << k << " bits " << static_cast<int>(bits) << " decay " << decay
                      << " n " << n);
            const chunked_codec_options o{.chunk_bits = b, .k = k, .bits = bits, .decay = decay};
            check_against_reference(gaussian(n, n + k), gaussian(n, 7 * n + b), o);
            check_against_reference(ties(n, n + k), ties(n, 3 * n + b), o);
          }
        }
      }
    }
  }
}

TEST_CASE("chunked codec: exact where neighbouring chunks differ in scale", "[compress][chunked]") {
  // The candidate search starts from the previous chunk's k-th magnitude: chunks of very
  // different scales make that estimate too high or far too low; the result stays exact.
  const std::uint64_t n = std::uint64_t{40} << 8;
  auto g = gaussian(n, 21);
  for (std::uint64_t i = 0; i < n; ++i) {
    const auto c = i >> 8;
    g[i] *= std::pow(10.0f, static_cast<float>(c % 7) - 3.0f) * (c % 3 == 0 ? 1.0f : 0.01f);
  }
  for (std::uint32_t k : {1u, 5u, 64u}) {
    check_against_reference(g, std::vector<float>(n, 0.0f), {.chunk_bits = 8, .k = k});
  }
  // And over steps of one codec, where the feedback changes what every chunk holds.
  chunked_codec codec({.chunk_bits = 8, .k = 5});
  std::vector<float> f(n, 0.0f);
  chunked_selection s;
  for (int step = 0; step < 5; ++step) {
    const auto before = f;
    codec.encode(g, f, s);
    const reference r = encode_reference(g, before, codec.options());
    REQUIRE(s.indices == r.indices);
    REQUIRE(f == r.feedback);
  }
}

TEST_CASE("chunked codec: exactly k per chunk, chunk-local ascending indices",
          "[compress][chunked]") {
  const std::uint64_t n = (std::uint64_t{3} << 12) + 40;  // the last chunk holds 40
  chunked_codec codec({.chunk_bits = 12, .k = 64});
  std::vector<float> f(n, 0.0f);
  chunked_selection s;
  codec.encode(gaussian(n, 1), f, s);
  REQUIRE(s.chunks() == 4);
  CHECK(s.kept(0) == 64);
  CHECK(s.kept(3) == 40);
  REQUIRE(s.indices.size() == 3 * 64 + 40);
  for (std::uint64_t c = 0, j = 0; c < 4; ++c) {
    for (std::uint64_t e = j + s.kept(c); j + 1 < e; ++j) CHECK(s.indices[j] < s.indices[j + 1]);
    ++j;
  }
  // 12-bit indices, 2-bit codes, two bf16 scales per chunk.
  CHECK(s.payload_bits() == (3 * 64 + 40) * 14 + 4 * 2 * 16);
}

TEST_CASE("chunked codec: all-zero chunks send the lowest indices with zero scales",
          "[compress][chunked]") {
  chunked_codec codec({.chunk_bits = 4, .k = 3});
  std::vector<float> g(32, 0.0f), f(32, 0.0f);
  chunked_selection s;
  codec.encode(g, f, s);
  CHECK(s.indices == std::vector<std::uint16_t>{0, 1, 2, 0, 1, 2});
  for (auto v : s.scales) CHECK(v.to_float() == 0.0f);
  CHECK(f == std::vector<float>(32, 0.0f));
}

TEST_CASE("chunked codec: decode adds what the sender took from its feedback",
          "[compress][chunked]") {
  for (auto bits : {chunk_value_bits::one, chunk_value_bits::two}) {
    const std::uint64_t n = 10000;
    const auto g = gaussian(n, 11);
    std::vector<float> f(n, 0.0f);
    chunked_codec codec({.chunk_bits = 10, .k = 20, .bits = bits});
    chunked_selection s;
    codec.encode(g, f, s);
    std::vector<float> out(n, 1.0f);
    chunked_codec::decode_add(s, out, 2.0f);
    for (std::uint64_t i = 0; i < n; ++i) {
      // sent + feedback = g (the feedback was zero): sent = g - f, exactly where g - f is.
      const float sent = (out[i] - 1.0f) / 2.0f;
      CHECK(std::fabs(sent + f[i] - g[i]) <= 1e-5f);
    }
  }
}

TEST_CASE("chunked codec: the feedback carries what was not sent to the next step",
          "[compress][chunked]") {
  // Over many steps of the same gradient, the sum of what was sent approaches the sum of the
  // gradients: the difference is exactly the feedback left.
  const std::uint64_t n = 4096;
  const auto g = gaussian(n, 5);
  std::vector<float> f(n, 0.0f), sent(n, 0.0f);
  chunked_codec codec({.chunk_bits = 8, .k = 8});
  chunked_selection s;
  const int steps = 50;
  for (int t = 0; t < steps; ++t) {
    codec.encode(g, f, s);
    chunked_codec::decode_add(s, sent);
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    CHECK(std::fabs(sent[i] + f[i] - steps * g[i]) <= 1e-4f * std::fabs(steps * g[i]) + 1e-3f);
  }
}

TEST_CASE("chunked codec: a non-finite value is sent and its chunk's feedback cleared",
          "[compress][chunked]") {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> g(32, 1.0f), f(32, 0.0f);
  g[5] = inf;
  g[20] = 2.0f;
  chunked_codec codec({.chunk_bits = 4, .k = 2});
  chunked_selection s;
  codec.encode(g, f, s);
  REQUIRE(s.indices.size() == 4);
  CHECK(s.indices[0] == 0);  // infinity ranks first, then the tie to the lowest index,
  CHECK(s.indices[1] == 5);  // sent in ascending order
  CHECK_FALSE(std::isfinite(s.scales[0].to_float()));
  CHECK(f[5] == 0.0f);
  CHECK(f[0] == 0.0f);
  CHECK(std::isfinite(s.scales[2].to_float()));
  CHECK(s.indices[2] == 0);
  CHECK(s.indices[3] == 4);  // 20 - 16
}

TEST_CASE("chunked codec: bad options and bad selections are refused", "[compress][chunked]") {
  auto bad = [](chunked_codec_options o) { CHECK(thrown([&] { chunked_codec c(o); }) == invalid); };
  bad({.chunk_bits = 0});
  bad({.chunk_bits = 17});
  bad({.chunk_bits = 4, .k = 0});
  bad({.chunk_bits = 4, .k = 17});
  bad({.decay = 0.0f});
  bad({.decay = 1.5f});
  bad({.decay = std::numeric_limits<float>::quiet_NaN()});

  chunked_codec codec({.chunk_bits = 4, .k = 2});
  std::vector<float> g(32, 1.0f), f(31, 0.0f);
  chunked_selection s;
  CHECK(thrown([&] { codec.encode(g, f, s); }) == invalid);

  f.resize(32);
  codec.encode(g, f, s);
  std::vector<float> out(32, 0.0f);
  std::vector<float> shorter(31, 0.0f);
  CHECK(thrown([&] { chunked_codec::decode_add(s, shorter); }) == invalid);
  auto broken = s;
  broken.indices[1] = broken.indices[0];  // not ascending
  CHECK(thrown([&] { chunked_codec::decode_add(broken, out); }) == out_of_range);
  broken = s;
  broken.indices[0] = 16;  // outside the chunk
  CHECK(thrown([&] { chunked_codec::decode_add(broken, out); }) == out_of_range);
  broken = s;
  broken.scales.pop_back();
  CHECK(thrown([&] { chunked_codec::decode_add(broken, out); }) == invalid);
  CHECK(out == std::vector<float>(32, 0.0f));  // nothing written by a refused call
}

TEST_CASE("chunked codec: the guide's block encodes and decodes", "[compress][chunked]") {
  const std::uint64_t n = 100'000;
  const std::vector<float> grad = gaussian(n, 3);
  // docs/guide/selection.md's "Chunked low-bit codec" block is the text between the two
  // "// [chunked_codec]" lines.
  // [chunked_codec]
  stellatrain::chunked_codec codec({.chunk_bits = 12,
                                    .k = 64,  // 64 of every 4096
                                    .bits = stellatrain::chunk_value_bits::two,
                                    .decay = 0.95f});
  std::vector<float> feedback(grad.size(), 0.0f);  // one per tensor, kept across steps
  stellatrain::chunked_selection sent;
  codec.encode(grad, feedback, sent);  // feedback keeps what was not sent
  std::vector<float> mean(grad.size(), 0.0f);
  stellatrain::chunked_codec::decode_add(sent, mean, 1.0f / 4);  // one of 4 ranks' share
  // [chunked_codec]
  CHECK(sent.indices.size() == (n / 4096) * 64 + std::min<std::uint64_t>(64, n % 4096));
  CHECK(static_cast<double>(sent.payload_bits()) / static_cast<double>(sent.indices.size()) < 15.0);
}
