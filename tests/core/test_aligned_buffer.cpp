// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include "catch.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

using namespace stellatrain;

TEST_CASE("aligned_buffer aligns and sizes its storage", "[aligned_buffer]") {
  for (std::size_t alignment : {std::size_t{1}, std::size_t{64}, std::size_t{4096}}) {
    aligned_buffer<float> b(1001, {.alignment = alignment});
    CHECK(b.size() == 1001);
    CHECK(b.size_bytes() == 4004);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % std::max(alignment, alignof(float)) == 0);
    CHECK(b.span().size() == 1001);
  }
  aligned_buffer<double> empty(0);
  CHECK(empty.empty());
  CHECK(empty.data() == nullptr);
}

TEST_CASE("large buffers are aligned to huge pages unless told otherwise", "[aligned_buffer]") {
  aligned_buffer<std::uint8_t> big(huge_page_bytes + 1);
  CHECK(reinterpret_cast<std::uintptr_t>(big.data()) % huge_page_bytes == 0);
  CHECK(big.alignment() == huge_page_bytes);
  aligned_buffer<std::uint8_t> small_pages(huge_page_bytes + 1, {.huge_pages = false});
  CHECK(small_pages.alignment() == cache_line_bytes);
}

TEST_CASE("prefault zero-fills the whole buffer, also across a pool", "[aligned_buffer]") {
  thread_pool pool{2};
  const std::size_t n = 3 * huge_page_bytes / sizeof(std::uint32_t) + 7;
  aligned_buffer<std::uint32_t> a(n, {.prefault = true}, pool);
  CHECK(std::all_of(a.begin(), a.end(), [](std::uint32_t v) { return v == 0; }));
  aligned_buffer<std::uint32_t> b(100, {.prefault = true});
  CHECK(std::all_of(b.begin(), b.end(), [](std::uint32_t v) { return v == 0; }));
}

TEST_CASE("aligned_buffer moves without copying", "[aligned_buffer]") {
  aligned_buffer<int> a(10, {.prefault = true});
  a[3] = 7;
  int* p = a.data();
  aligned_buffer<int> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b[3] == 7);
  CHECK(a.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  aligned_buffer<int> c(5);
  c = std::move(b);
  CHECK(c.data() == p);
  CHECK(c.size() == 10);
}

TEST_CASE("aligned_buffer reports bad requests as errors", "[aligned_buffer]") {
  CHECK_THROWS_MATCHES(aligned_buffer<float>(10, {.alignment = 48}), error,
                       Catch::Matchers::Predicate<error>(
                           [](const error& e) { return e.code() == errc::invalid_argument; }));
  const auto too_many = std::numeric_limits<std::size_t>::max() / 2;
  CHECK_THROWS_MATCHES(aligned_buffer<float>(too_many), error,
                       Catch::Matchers::Predicate<error>(
                           [](const error& e) { return e.code() == errc::resource_exhausted; }));
  // Representable, but far beyond any machine's memory: the allocation fails cleanly.
  CHECK_THROWS_MATCHES(aligned_buffer<std::uint8_t>(std::size_t{1} << 60), error,
                       Catch::Matchers::Predicate<error>(
                           [](const error& e) { return e.code() == errc::resource_exhausted; }));
}

TEST_CASE("an offset places the first element past the aligned boundary", "[aligned_buffer]") {
  thread_pool pool{2};
  for (std::size_t count : {std::size_t{100}, huge_page_bytes / sizeof(float) + 3}) {
    const std::size_t offset = 69 * cache_line_bytes;
    aligned_buffer<float> b(count, {.prefault = true, .offset = offset}, pool);
    const auto address = reinterpret_cast<std::uintptr_t>(b.data());
    CHECK((address - offset) % b.alignment() == 0);
    if (count * sizeof(float) >= huge_page_bytes) CHECK(address % huge_page_bytes == offset);
    CHECK(b.size() == count);
    CHECK(std::all_of(b.begin(), b.end(), [](float v) { return v == 0.0f; }));
    b[count - 1] = 1.0f;  // the last element lies inside the allocation (ASan checks it)
    aligned_buffer<float> moved(std::move(b));
    CHECK(moved[count - 1] == 1.0f);
  }
  auto refused = [](std::size_t offset) {
    try {
      aligned_buffer<float> b(10, {.offset = offset});
    } catch (const error& e) {
      return e.code() == errc::invalid_argument;
    }
    return false;
  };
  CHECK(refused(2));                // not a multiple of alignof(float)
  CHECK(refused(huge_page_bytes));  // not below 2 MiB
  CHECK_FALSE(refused(4));
}
