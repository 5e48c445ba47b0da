// SPDX-License-Identifier: Apache-2.0
#include "catch.hpp"

#include <stellatrain/transport/message_buffer.hpp>

#include <cstring>
#include <vector>

using namespace stellatrain;

TEST_CASE("message_buffer grows, keeps capacity and contents", "[transport][message_buffer]") {
  message_buffer m;
  CHECK(m.empty());
  CHECK(m.capacity() == 0);
  std::vector<std::byte> src(1000);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7);
  m.assign(src);
  CHECK(m.size() == 1000);
  CHECK(std::memcmp(m.data(), src.data(), 1000) == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(m.data()) % 64 == 0);
  const auto cap = m.capacity();
  m.resize(10);
  CHECK(m.capacity() == cap);
  m.resize(1000);  // contents past 10 unspecified, first 10 kept
  CHECK(std::memcmp(m.data(), src.data(), 10) == 0);
  m.resize(5000);  // grows, keeps the first 1000
  CHECK(std::memcmp(m.data(), src.data(), 10) == 0);
  CHECK(m.capacity() >= 5000);
  const std::byte* before = m.data();
  m.resize_for_overwrite(100);
  CHECK(m.data() == before);
  m.clear();
  CHECK(m.empty());
  CHECK(m.capacity() >= 5000);
  message_buffer moved = std::move(m);
  CHECK(moved.capacity() >= 5000);
  message_buffer r(1 << 20, true);
  CHECK(r.capacity() == (1u << 20));
  CHECK(r.size() == 0);
}
