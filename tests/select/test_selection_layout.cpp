// SPDX-License-Identifier: Apache-2.0
// The host-bound selection layout: sizes and offsets, a round trip through a buffer, and every
// way a header can be wrong (each named in the error).
#include <stellatrain/select/selection_layout.hpp>

#include "catch.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace stellatrain;

struct aligned_bytes {
  explicit aligned_bytes(std::size_t n) : storage(n + selection_alignment) {
    auto addr = reinterpret_cast<std::uintptr_t>(storage.data());
    offset = (selection_alignment - addr % selection_alignment) % selection_alignment;
    size = n;
  }
  std::span<std::byte> span() { return {storage.data() + offset, size}; }
  std::vector<std::byte> storage;
  std::size_t offset;
  std::size_t size;
};

std::string message_of(std::span<const std::byte> bytes) {
  try {
    (void)read_selection<float, std::uint32_t>(bytes);
  } catch (const error& e) {
    return e.what();
  }
  return "no error";
}

void patch(std::span<std::byte> bytes, const selection_header& h) {
  std::memcpy(bytes.data(), &h, sizeof h);
}

}  // namespace

TEST_CASE("selection layout sizes and offsets", "[select][layout]") {
  STATIC_REQUIRE(selection_index_offset() == 64);
  STATIC_REQUIRE(selection_value_offset(0, dtype::u32) == 64);
  STATIC_REQUIRE(selection_value_offset(1, dtype::u32) == 128);
  STATIC_REQUIRE(selection_value_offset(16, dtype::u32) == 128);
  STATIC_REQUIRE(selection_value_offset(17, dtype::u32) == 192);
  STATIC_REQUIRE(selection_value_offset(8, dtype::u64) == 128);
  STATIC_REQUIRE(selection_bytes(0, dtype::u32, dtype::f32) == 64);
  STATIC_REQUIRE(selection_bytes(1, dtype::u32, dtype::bf16) == 192);
  STATIC_REQUIRE(selection_bytes<bf16, std::uint32_t>(250'000) == 64 + 1'000'000 + 500'032);
  for (std::uint64_t count : {0u, 1u, 15u, 16u, 17u, 1000u}) {
    for (dtype index : {dtype::u32, dtype::u64}) {
      for (dtype value : {dtype::f32, dtype::f16, dtype::bf16}) {
        const auto v = selection_value_offset(count, index);
        const auto total = selection_bytes(count, index, value);
        CHECK(v % selection_alignment == 0);
        CHECK(total % selection_alignment == 0);
        CHECK(v >= 64 + count * size_of(index));
        CHECK(total >= v + count * size_of(value));
        CHECK(total < v + count * size_of(value) + selection_alignment);
      }
    }
  }
}

TEST_CASE("a selection written on the host reads back", "[select][layout]") {
  const std::uint64_t count = 37;
  aligned_bytes buf(selection_bytes<fp16, std::uint64_t>(count));
  write_selection_header<fp16, std::uint64_t>(buf.span(), count, 1000);
  auto idx = selection_indices<std::uint64_t>(buf.span(), count);
  auto val = selection_values<fp16, std::uint64_t>(buf.span(), count);
  for (std::uint64_t j = 0; j < count; ++j) {
    idx[j] = 3 * j + 1;
    val[j] = fp16{static_cast<float>(j) * 0.5f};
  }
  const auto h = read_selection_header(buf.span());
  CHECK(h.count == count);
  CHECK(h.dense_size == 1000);
  CHECK(h.status == 0);
  CHECK(h.index_dtype == static_cast<std::uint8_t>(dtype::u64));
  CHECK(h.value_dtype == static_cast<std::uint8_t>(dtype::f16));
  const auto view = read_selection<fp16, std::uint64_t>(buf.span());
  REQUIRE(view.size() == count);
  CHECK(view.dense_size() == 1000);
  for (std::uint64_t j = 0; j < count; ++j) {
    CHECK(view.indices()[j] == 3 * j + 1);
    CHECK(view.values()[j].to_float() == static_cast<float>(j) * 0.5f);
  }
  CHECK_NOTHROW(validate_sparse(view, index_order::strictly_ascending));
}

TEST_CASE("malformed selections are rejected with what and where", "[select][layout]") {
  const std::uint64_t count = 10;
  aligned_bytes buf(selection_bytes<float, std::uint32_t>(count));
  write_selection_header<float, std::uint32_t>(buf.span(), count, 100);
  const selection_header good = read_selection_header(buf.span());
  REQUIRE(message_of(buf.span()) == "no error");

  auto expect = [&](selection_header h, const std::string& fragment, errc code) {
    patch(buf.span(), h);
    try {
      (void)read_selection<float, std::uint32_t>(buf.span());
      FAIL("accepted a header with " << fragment);
    } catch (const error& e) {
      CHECK(e.code() == code);
      INFO(e.what());
      CHECK(std::string(e.what()).find(fragment) != std::string::npos);
    }
    patch(buf.span(), good);
  };
  auto h = good;
  h.magic ^= 1u;
  expect(h, "bad magic", errc::malformed_message);
  h = good;
  h.version = 2;
  expect(h, "layout version 2", errc::version_mismatch);
  h = good;
  h.index_dtype = static_cast<std::uint8_t>(dtype::f32);
  expect(h, "index dtype", errc::malformed_message);
  h = good;
  h.value_dtype = 99;
  expect(h, "value dtype 99", errc::malformed_message);
  h = good;
  h.count = 101;
  expect(h, "exceeds the dense size", errc::malformed_message);
  h = good;
  h.value_offset += 64;
  expect(h, "offsets", errc::malformed_message);
  h = good;
  h.count = 1'000'000;
  h.dense_size = 2'000'000;
  expect(h, "does not fit", errc::malformed_message);
  h = good;
  h.count = 20;
  h.value_offset = selection_value_offset(20, dtype::u32);
  expect(h, "needs", errc::malformed_message);
  h = good;
  h.value_dtype = static_cast<std::uint8_t>(dtype::bf16);
  h.value_offset = selection_value_offset(count, dtype::u32);
  expect(h, "expected u32 and f32", errc::malformed_message);
  h = good;
  h.status = static_cast<std::uint32_t>(selection_status::inconsistent_counts) |
             static_cast<std::uint32_t>(selection_status::wrong_total);
  expect(h, "inconsistent counts wrong total", errc::malformed_message);

  CHECK(message_of(buf.span().first(63)).find("shorter than the 64-byte header") !=
        std::string::npos);
  // A sound buffer at an address that is not 64-byte aligned.
  std::vector<std::byte> big(buf.span().size() + 2 * selection_alignment);
  const auto addr = reinterpret_cast<std::uintptr_t>(big.data());
  const std::size_t off =
      (selection_alignment - addr % selection_alignment) % selection_alignment + 8;
  std::memcpy(big.data() + off, buf.span().data(), buf.span().size());
  CHECK(message_of(std::span<const std::byte>(big.data() + off, buf.span().size()))
            .find("not aligned") != std::string::npos);
}
