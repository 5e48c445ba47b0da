// SPDX-License-Identifier: Apache-2.0
// chunked_compressor: the codec behind the compressor concept; k per chunk from the k asked
// for, the pairs the codec decodes, the feedback as residual, a saved state that continues
// bit-identically, and bad use.
#include <stellatrain/compress/chunked_compressor.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include "catch.hpp"
#include "compress_test_support.hpp"

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

using namespace stellatrain;

TEST_CASE("chunked_compressor: k per chunk follows the k asked for", "[compress][chunked]") {
  inline_executor ex;
  const std::uint64_t n = 10 * 4096 + 100;
  chunked_compressor<> c({.chunk_bits = 12, .bits = chunk_value_bits::two, .decay = 0.95f});
  c.add_tensor(ex, 7, n);
  const auto g = test::gaussian(n, 1, 1.0f);
  sparse_buffer<float, std::uint32_t> out;
  // 1.5625% of n (rounded down): 64 of every 4096 (and 64 of the last 100).
  const std::uint64_t k = n * 64 / 4096;
  const auto stats = c.compress(ex, 7, std::span<const float>(g), k, out);
  const chunked_section s = c.wire_section(7);
  CHECK(s.k == 64);
  CHECK(stats.count == 10 * 64 + 64);
  REQUIRE(out.size() == stats.count);
  CHECK(out.dense_size() == n);
  // The pairs are the codec's decode of its section; the residual is what was not sent.
  std::vector<float> sent(n, 0.0f);
  for (std::size_t j = 0; j < out.size(); ++j) {
    REQUIRE((j == 0 || out.indices()[j] > out.indices()[j - 1]));
    sent[out.indices()[j]] = out.values()[j];
  }
  const auto r = c.residual(7);
  for (std::uint64_t i = 0; i < n; ++i) REQUIRE(r[i] + sent[i] == Approx(g[i]).margin(1e-6));
  // A tiny k still sends one per chunk; k = n sends everything.
  c.compress(ex, 7, std::span<const float>(g), 1, out);
  CHECK(c.wire_section(7).k == 1);
  CHECK(out.size() == 11);
  c.compress(ex, 7, std::span<const float>(g), n, out);
  CHECK(c.wire_section(7).k == 4096);
  CHECK(out.size() == n);
}

TEST_CASE("chunked_compressor: a saved state continues bit-identically", "[compress][chunked]") {
  thread_pool pool{2};
  const std::uint64_t n = 3 * 4096 + 7;
  auto make = [&] {
    chunked_compressor<> c({.chunk_bits = 10, .bits = chunk_value_bits::one, .decay = 0.9f});
    c.add_tensor(pool, 1, n);
    c.add_tensor(pool, 4, 100);
    return c;
  };
  auto a = make();
  sparse_buffer<float, std::uint32_t> out_a, out_b;
  for (std::uint64_t s = 0; s < 3; ++s) {
    const auto g = test::gaussian(n, s, 1.0f);
    a.compress(pool, 1, std::span<const float>(g), n / 20, out_a);
  }
  const auto saved = a.save_state();
  auto b = make();
  b.load_state(pool, saved);
  const auto g = test::gaussian(n, 9, 1.0f);
  a.compress(pool, 1, std::span<const float>(g), n / 20, out_a);
  b.compress(pool, 1, std::span<const float>(g), n / 20, out_b);
  REQUIRE(out_a.size() == out_b.size());
  CHECK(std::memcmp(out_a.values().data(), out_b.values().data(), out_a.size() * 4) == 0);
  CHECK(std::memcmp(out_a.indices().data(), out_b.indices().data(), out_a.size() * 4) == 0);
  CHECK(std::memcmp(a.residual(1).data(), b.residual(1).data(), n * 4) == 0);

  chunked_compressor<> other({.chunk_bits = 12});
  CHECK_THROWS_WITH(other.load_state(saved), Catch::Matchers::Contains("other options"));
  auto truncated = saved;
  truncated.resize(truncated.size() - 9);
  auto c = make();
  CHECK_THROWS(c.load_state(truncated));
  CHECK(c.residual(1).size() == n);  // unchanged
}

TEST_CASE("chunked_compressor: bad use", "[compress][chunked]") {
  inline_executor ex;
  CHECK_THROWS_WITH(chunked_compressor<>({.chunk_bits = 0}),
                    Catch::Matchers::Contains("chunk_bits"));
  CHECK_THROWS_WITH(chunked_compressor<>({.decay = 0.0f}), Catch::Matchers::Contains("decay"));
  chunked_compressor<> c;
  c.add_tensor(ex, 1, 100);
  CHECK_THROWS_WITH(c.add_tensor(ex, 1, 5), Catch::Matchers::Contains("registered twice"));
  std::vector<float> g(99, 1.0f);
  sparse_buffer<float, std::uint32_t> out;
  CHECK_THROWS_WITH(c.compress(ex, 1, std::span<const float>(g), 5, out),
                    Catch::Matchers::Contains("has 100 elements, got 99"));
  CHECK_THROWS_WITH(c.compress(ex, 2, std::span<const float>(g), 5, out),
                    Catch::Matchers::Contains("not registered"));
}
