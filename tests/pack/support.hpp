// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the pack tests: random sorted selections, packing one or more sections into
// a byte vector, re-sealing the checksum of an edited message, requiring that a message is
// refused.
#pragma once

#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include "catch.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::test {

template <class I = std::uint32_t>
struct selection {
  std::uint64_t n = 0;
  std::vector<I> indices;
  std::vector<float> values;
  [[nodiscard]] sparse_view<const float, const I> view() const { return {indices, values, n}; }
};

/// k distinct indices below n, sorted, uniformly at random; values from N(0, 1).
template <class I = std::uint32_t>
selection<I> random_selection(std::uint64_t n, std::uint64_t k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  selection<I> s;
  s.n = n;
  k = std::min(k, n);
  if (k * 3 > n) {  // dense: one Bernoulli pass, then trim or top up
    std::vector<I> all;
    for (std::uint64_t i = 0; i < n; ++i) all.push_back(static_cast<I>(i));
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(k);
    std::sort(all.begin(), all.end());
    s.indices = all;
  } else {
    std::set<std::uint64_t> chosen;
    while (chosen.size() < k) chosen.insert(rng() % n);
    for (auto x : chosen) s.indices.push_back(static_cast<I>(x));
  }
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (std::size_t j = 0; j < s.indices.size(); ++j) s.values.push_back(dist(rng));
  return s;
}

/// Packs one section and returns the message.
template <class V, class I, class Executor = inline_executor>
std::vector<std::byte> pack_one(std::uint32_t tensor, sparse_view<const V, const I> s,
                                section_options options = {}, std::uint64_t tag = 0) {
  Executor ex;
  message_packer packer;
  packer.clear(tag);
  packer.add(tensor, s, options);
  std::vector<std::byte> out(packer.prepare(ex));
  packer.write(out, ex);
  return out;
}

/// Recomputes the trailing CRC-32C after a test edited the message.
inline void reseal(std::vector<std::byte>& m) {
  if (m.size() < wire::message_header_bytes + wire::message_trailer_bytes) return;
  const auto body = std::span<const std::byte>(m).first(m.size() - 4);
  detail::store_le<std::uint32_t>(m.data() + m.size() - 4, crc32c(body));
}

template <class T>
void put(std::vector<std::byte>& m, std::size_t offset, T value) {
  detail::store_le<T>(m.data() + offset, value);
}

template <class T>
T get(const std::vector<std::byte>& m, std::size_t offset) {
  return detail::load_le<T>(m.data() + offset);
}

// Parses `m` and requires a stellatrain::error with `code` whose message contains `part`;
// afterwards the unpacker holds no message: no sections, and `decode` throws.
inline void expect_error(message_unpacker& u, const std::vector<std::byte>& m, errc code,
                         const std::string& part) {
  inline_executor ex;
  try {
    u.parse(m, ex);
  } catch (const error& e) {
    INFO("what(): " << e.what());
    CHECK(e.code() == code);
    CHECK(std::string(e.what()).find(part) != std::string::npos);
    CHECK(u.info().sections.empty());
    CHECK(u.info().controls.empty());
    sparse_buffer<float, std::uint64_t> out(0, 16);
    try {
      u.decode(0, out, ex);
      FAIL("decode after a failed parse did not throw");
    } catch (const error& d) {
      CHECK(d.code() == errc::invalid_argument);
    }
    return;
  }
  FAIL("parse accepted a bad message (expected: " << part << ")");
}

inline void expect_error(std::uint32_t tensor, std::uint64_t n, const std::vector<std::byte>& m,
                         errc code, const std::string& part) {
  message_unpacker u(std::vector<tensor_info>{{tensor, n}});
  expect_error(u, m, code, part);
}

}  // namespace stellatrain::test
