// SPDX-License-Identifier: Apache-2.0
// Bad input: truncated, oversized, bit-flipped and structurally corrupted messages (with the
// checksum recomputed, so that the structural checks themselves are exercised) must throw a
// stellatrain::error with the right code and a message naming what is wrong; nothing is ever
// written into the caller's buffers. Also the sender-side checks of message_packer.
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include "catch.hpp"
#include "support.hpp"

#include <cstdint>
#include <string>
#include <vector>

using namespace stellatrain;
using test::expect_error;
using test::get;
using test::put;
using test::random_selection;
using test::reseal;

namespace {

constexpr std::size_t hdr = wire::message_header_bytes;  // first section header
constexpr std::size_t sec = wire::section_header_bytes;
constexpr std::size_t payload0 = hdr + sec;  // first section's index payload

// A message with one section of every index encoding (small tensors).
struct sample_message {
  std::vector<std::byte> bytes;
  std::vector<tensor_info> tensors;
};

sample_message every_encoding() {
  sample_message m;
  inline_executor ex;
  message_packer p;
  p.clear(5);
  std::vector<test::selection<std::uint32_t>> keep;
  const index_encoding encodings[] = {index_encoding::raw_u16,         index_encoding::raw_u32,
                                      index_encoding::raw_u64,         index_encoding::delta_varint,
                                      index_encoding::delta_bitpacked, index_encoding::bitmap};
  for (std::uint32_t t = 0; t < 6; ++t)
    keep.push_back(random_selection<std::uint32_t>(600 + 100 * t, 40 + 10 * t, t));
  for (std::uint32_t t = 0; t < 6; ++t) {
    p.add(t, keep[t].view(),
          {.indices = encodings[t], .values = static_cast<value_encoding>(1 + t % 3)});
    m.tensors.push_back({t, keep[t].n});
  }
  static const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  p.add_random_k<float>(6, {.seed = 3}, 100, values);
  m.tensors.push_back({6, 100});
  m.bytes.resize(p.prepare(ex));
  p.write(m.bytes, ex);
  return m;
}

}  // namespace

TEST_CASE("unpack: every truncation and every extension of a message is refused",
          "[pack][validation]") {
  const auto m = every_encoding();
  message_unpacker u(m.tensors);
  inline_executor ex;
  REQUIRE(u.parse(m.bytes, ex).sections.size() == 7);
  for (std::size_t len = 0; len < m.bytes.size(); ++len) {
    const std::vector<std::byte> cut(m.bytes.begin(),
                                     m.bytes.begin() + static_cast<std::ptrdiff_t>(len));
    INFO("length " << len);
    CHECK_THROWS_AS(u.parse(cut, ex), error);
    CHECK(u.info().sections.empty());
  }
  expect_error(u, std::vector<std::byte>(m.bytes.begin(), m.bytes.begin() + 20),
               errc::malformed_message, "truncated");
  auto cut = std::vector<std::byte>(m.bytes.begin(), m.bytes.end() - 1);
  expect_error(u, cut, errc::malformed_message, "truncated: the header says");
  auto longer = m.bytes;
  longer.push_back(std::byte{0});
  expect_error(u, longer, errc::malformed_message, "oversized");
  reseal(longer);
  expect_error(u, longer, errc::malformed_message, "oversized");
}

TEST_CASE("unpack: every single-bit error is detected", "[pack][validation]") {
  const auto m = every_encoding();
  message_unpacker u(m.tensors);
  inline_executor ex;
  for (std::size_t bit = 0; bit < m.bytes.size() * 8; ++bit) {
    auto bad = m.bytes;
    bad[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    INFO("bit " << bit);
    try {
      u.parse(bad, ex);
      FAIL("accepted");
    } catch (const error& e) {
      const std::size_t byte = bit / 8;
      if (bit == 32) {  // version 2 -> 3, which this build reads: the checksum catches it
        CHECK(e.code() == errc::checksum_mismatch);
      } else if (byte >= 4 && byte < 8) {  // version and flags are read before the checksum
        CHECK((e.code() == errc::version_mismatch || e.code() == errc::unsupported));
      } else if (byte < 4 || (byte >= 12 && byte < 24)) {  // magic, header size, message size
        CHECK(e.code() == errc::malformed_message);
      } else {
        CHECK(e.code() == errc::checksum_mismatch);
      }
    }
  }
}

TEST_CASE("unpack: header fields are checked", "[pack][validation]") {
  inline_executor ex;
  const auto s = random_selection<std::uint32_t>(1000, 50, 1);
  const auto good = test::pack_one(4, s.view(), {.indices = index_encoding::raw_u32});
  {
    auto m = good;
    m[0] = std::byte{'X'};
    expect_error(4, 1000, m, errc::malformed_message, "bad magic");
  }
  {
    auto m = good;
    put<std::uint16_t>(m, 4, 4);
    reseal(m);
    expect_error(4, 1000, m, errc::version_mismatch,
                 "format version 4, this build reads versions 2 to 3");
  }
  {  // Version 1 had no section kinds: refused, never misread.
    auto m = good;
    put<std::uint16_t>(m, 4, 1);
    reseal(m);
    expect_error(4, 1000, m, errc::version_mismatch,
                 "format version 1, this build reads versions 2 to 3");
  }
  {
    auto m = good;
    put<std::uint16_t>(m, 6, 0x10);
    reseal(m);
    expect_error(4, 1000, m, errc::unsupported, "unknown message flags 0x10");
  }
  {
    auto m = good;
    put<std::uint32_t>(m, 12, 40);
    reseal(m);
    expect_error(4, 1000, m, errc::malformed_message, "header size 40");
  }
  {
    auto m = good;
    put<std::uint32_t>(m, m.size() - 4, get<std::uint32_t>(m, m.size() - 4) ^ 1u);
    expect_error(4, 1000, m, errc::checksum_mismatch, "CRC-32C");
  }
  {
    auto m = good;
    put<std::uint32_t>(m, 8, 1000000);
    reseal(m);
    expect_error(4, 1000, m, errc::malformed_message, "1000000 sections cannot fit");
  }
  {
    auto m = good;
    put<std::uint32_t>(m, 8, 0);
    reseal(m);
    expect_error(4, 1000, m, errc::malformed_message, "unused bytes after the last section");
  }
  {
    auto m = good;
    put<std::uint32_t>(m, 8, 2);
    reseal(m);
    message_unpacker u(std::vector<tensor_info>{{4, 1000}, {5, 10}});
    expect_error(u, m, errc::malformed_message, "section 1 at byte");
  }
  {
    message_unpacker u(std::vector<tensor_info>{{4, 1000}}, {.max_message_bytes = 100});
    expect_error(u, good, errc::resource_exhausted, "exceeds the limit of 100");
  }
  {  // More sections than registered tensors and control sections together.
    const auto big = random_selection<std::uint32_t>(4000, 1000, 2);
    auto m = test::pack_one(4, big.view(), {.indices = index_encoding::raw_u32});
    put<std::uint32_t>(m, 8, 1 + wire::max_control_sections);
    reseal(m);
    message_unpacker u;
    expect_error(u, m, errc::malformed_message,
                 "only 0 tensors are registered (and 16 control sections allowed)");
    message_unpacker one(std::vector<tensor_info>{{4, 4000}});
    expect_error(one, m, errc::malformed_message, "section 1 at byte");
  }
  message_unpacker u(std::vector<tensor_info>{{4, 1000}});
  const auto& info = u.parse(good, ex);
  CHECK(info.sections.size() == 1);
}

TEST_CASE("unpack: section headers are checked against the registered tensors",
          "[pack][validation]") {
  const auto s = random_selection<std::uint32_t>(1000, 50, 1);
  const auto good = test::pack_one(
      4, s.view(), {.indices = index_encoding::raw_u32, .values = value_encoding::bf16});
  auto edited = [&](std::size_t offset, auto value) {
    auto m = good;
    put(m, offset, value);
    reseal(m);
    return m;
  };
  expect_error(9, 1000, good, errc::malformed_message, "tensor 4 is not registered");
  expect_error(4, 999, good, errc::size_mismatch, "tensor size 1000, registered size 999");
  expect_error(4, 1000, edited(hdr + wire::offset_index_encoding, std::uint8_t{0}),
               errc::malformed_message, "unknown index encoding 0");
  expect_error(4, 1000, edited(hdr + wire::offset_index_encoding, std::uint8_t{8}),
               errc::malformed_message, "unknown index encoding 8");
  expect_error(4, 1000, edited(hdr + wire::offset_value_encoding, std::uint8_t{4}),
               errc::malformed_message, "unknown value encoding 4");
  expect_error(4, 1000, edited(hdr + wire::offset_section_kind, std::uint16_t{2}),
               errc::unsupported, "unknown section kind 2");
  // A tensor section marked as a control section has fields a control section must not have.
  expect_error(4, 1000, edited(hdr + wire::offset_section_kind, std::uint16_t{1}),
               errc::malformed_message,
               "(control type 4): a control section has no encodings, size, count or values");
  expect_error(4, 1000, edited(hdr + wire::offset_count, std::uint64_t{1001}),
               errc::malformed_message, "1001 pairs in a tensor of 1000");
  expect_error(4, 1000, edited(hdr + wire::offset_count, std::uint64_t{51}),
               errc::malformed_message, "value payload of 100 bytes for 51 bf16 values");
  expect_error(4, 1000, edited(hdr + wire::offset_value_bytes, std::uint64_t{101}),
               errc::malformed_message, "value payload of 101 bytes");
  expect_error(4, 1000, edited(hdr + wire::offset_index_bytes, std::uint64_t{196}),
               errc::malformed_message, "raw_u32 payload of 196 bytes for 50 indices");
  expect_error(
      4, 1000,
      edited(hdr + wire::offset_index_encoding, static_cast<std::uint8_t>(index_encoding::raw_u16)),
      errc::malformed_message, "raw_u16 payload of 200 bytes");
  expect_error(
      4, 1000,
      edited(hdr + wire::offset_index_encoding, static_cast<std::uint8_t>(index_encoding::bitmap)),
      errc::malformed_message, "bitmap of 200 bytes for a tensor of 1000");
  expect_error(4, 1000,
               edited(hdr + wire::offset_index_encoding,
                      static_cast<std::uint8_t>(index_encoding::random_k)),
               errc::malformed_message, "random_k payload of 200 bytes");
  {  // A u32 payload for a tensor past 2^32 elements.
    auto m = edited(hdr + wire::offset_dense_size, (std::uint64_t{1} << 32) + 1);
    expect_error(4, (std::uint64_t{1} << 32) + 1, m, errc::malformed_message,
                 "raw_u32 indices for a tensor of");
  }
  {  // Payload lengths that run past the end (and whose products would overflow).
    auto m = good;
    put<std::uint64_t>(m, hdr + wire::offset_count, std::uint64_t{1} << 62);
    put<std::uint64_t>(m, hdr + wire::offset_dense_size, std::uint64_t{1} << 63);
    put<std::uint64_t>(m, hdr + wire::offset_index_bytes, std::uint64_t{1} << 62);
    put<std::uint64_t>(m, hdr + wire::offset_index_encoding, std::uint64_t{0});
    put<std::uint8_t>(m, hdr + wire::offset_index_encoding,
                      static_cast<std::uint8_t>(index_encoding::raw_u64));
    put<std::uint8_t>(m, hdr + wire::offset_value_encoding,
                      static_cast<std::uint8_t>(value_encoding::fp32));
    put<std::uint64_t>(m, hdr + wire::offset_value_bytes, std::uint64_t{1} << 64 - 2);
    reseal(m);
    expect_error(4, std::uint64_t{1} << 63, m, errc::malformed_message, "");
  }
  {  // Two sections of the same tensor.
    inline_executor ex;
    message_packer p;
    p.add(4, s.view());
    p.add(5, s.view());
    std::vector<std::byte> m(p.prepare(ex));
    p.write(m, ex);
    const std::size_t second = hdr + sec + get<std::uint64_t>(m, hdr + wire::offset_index_bytes) +
                               get<std::uint64_t>(m, hdr + wire::offset_value_bytes);
    put<std::uint32_t>(m, second, 4);
    reseal(m);
    message_unpacker u(std::vector<tensor_info>{{4, 1000}, {5, 1000}});
    expect_error(u, m, errc::malformed_message, "the tensor appears twice");
  }
}

TEST_CASE("unpack: raw and bitmap indices must ascend and stay in range", "[pack][validation]") {
  const auto s = random_selection<std::uint32_t>(1000, 50, 1);
  for (auto ie : {index_encoding::raw_u16, index_encoding::raw_u32, index_encoding::raw_u64}) {
    const std::size_t w = ie == index_encoding::raw_u16 ? 2 : ie == index_encoding::raw_u32 ? 4 : 8;
    const auto good = test::pack_one(4, s.view(), {.indices = ie});
    auto set_index = [&](std::vector<std::byte>& m, std::size_t j, std::uint64_t x) {
      if (w == 2) put<std::uint16_t>(m, payload0 + 2 * j, static_cast<std::uint16_t>(x));
      if (w == 4) put<std::uint32_t>(m, payload0 + 4 * j, static_cast<std::uint32_t>(x));
      if (w == 8) put<std::uint64_t>(m, payload0 + 8 * j, x);
    };
    INFO(name_of(ie));
    {
      auto m = good;
      set_index(m, 10, s.indices[11]);
      set_index(m, 11, s.indices[10]);
      reseal(m);
      expect_error(4, 1000, m, errc::malformed_message,
                   "indices not strictly ascending at position 11");
    }
    {
      auto m = good;
      set_index(m, 20, s.indices[19]);
      reseal(m);
      expect_error(4, 1000, m, errc::malformed_message, "not strictly ascending at position 20");
    }
    {
      auto m = good;
      set_index(m, 49, 1000);
      reseal(m);
      expect_error(4, 1000, m, errc::out_of_range,
                   "index 1000 at position 49 is not below the tensor size 1000");
    }
    {
      auto m = good;
      for (std::size_t j = 0; j < 50; ++j) set_index(m, j, 60000 + j);
      reseal(m);
      expect_error(4, 1000, m, errc::out_of_range, "index 60000 at position 0");
    }
  }
  const auto bm = test::pack_one(4, random_selection<std::uint32_t>(1003, 50, 2).view(),
                                 {.indices = index_encoding::bitmap});
  {
    auto m = bm;
    m[payload0 + 125] |= std::byte{0x10};  // element 1004 of a 1003-element tensor
    reseal(m);
    expect_error(4, 1003, m, errc::out_of_range, "bitmap bits set past the tensor size 1003");
  }
  {
    auto m = bm;
    std::size_t byte = 0;
    while (m[payload0 + byte] == std::byte{0xff}) ++byte;
    const auto old = std::to_integer<unsigned>(m[payload0 + byte]);
    m[payload0 + byte] = static_cast<std::byte>(old | (old + 1));  // one more bit
    reseal(m);
    expect_error(4, 1003, m, errc::malformed_message,
                 "bitmap holds 51 indices, the header says 50");
  }
}

TEST_CASE("unpack: delta payloads are decoded and checked before anything is written",
          "[pack][validation]") {
  // Five indices, gaps 1 0 1 3 7: one partial block of width 3 and no exceptions.
  test::selection<std::uint32_t> small;
  small.n = 100;
  small.indices = {1, 2, 4, 8, 16};
  small.values = {1, 2, 3, 4, 5};
  const auto bp = test::pack_one(4, small.view(), {.indices = index_encoding::delta_bitpacked});
  REQUIRE(get<std::uint64_t>(bp, hdr + wire::offset_index_bytes) == 5);
  REQUIRE(std::to_integer<int>(bp[payload0]) == 3);
  {
    auto m = bp;
    m[payload0] = std::byte{33};
    reseal(m);
    expect_error(4, 100, m, errc::malformed_message, "bit width 33 > 32");
  }
  {
    auto m = bp;
    put<std::uint16_t>(m, payload0 + 1, 6);
    reseal(m);
    expect_error(4, 100, m, errc::malformed_message, "6 exceptions for 5 gaps");
  }
  {
    auto m = bp;
    m[payload0 + 4] |= std::byte{0x80};
    reseal(m);
    expect_error(4, 100, m, errc::malformed_message, "nonzero padding bits");
  }
  {  // Register a smaller tensor: the last index no longer fits.
    auto m = bp;
    put<std::uint64_t>(m, hdr + wire::offset_dense_size, 16);
    reseal(m);
    expect_error(4, 16, m, errc::out_of_range, "index 16 is not below the tensor size 16");
  }
  {  // The payload is one byte longer than its blocks.
    auto m = bp;
    m.insert(m.begin() + static_cast<std::ptrdiff_t>(payload0 + 5), std::byte{0});
    put<std::uint64_t>(m, hdr + wire::offset_index_bytes, 6);
    put<std::uint64_t>(m, wire::offset_message_bytes, m.size());
    reseal(m);
    expect_error(4, 100, m, errc::malformed_message, "1 bytes left after its last index");
  }
  // Nine gaps of 0 and one of 1000: width 0 with one exception at position 9.
  test::selection<std::uint32_t> ex1;
  ex1.n = 2000;
  for (std::uint32_t i = 0; i < 9; ++i) ex1.indices.push_back(i);
  ex1.indices.push_back(1009);
  ex1.values.assign(10, 1.0f);
  const auto e = test::pack_one(4, ex1.view(), {.indices = index_encoding::delta_bitpacked});
  REQUIRE(std::to_integer<int>(e[payload0]) == 0);
  REQUIRE(get<std::uint16_t>(e, payload0 + 1) == 1);
  REQUIRE(std::to_integer<int>(e[payload0 + 3]) == 9);
  {
    auto m = e;
    m[payload0 + 3] = std::byte{10};
    reseal(m);
    expect_error(4, 2000, m, errc::malformed_message, "exception positions not ascending");
  }
  {
    auto m = e;
    m[payload0 + 4] = std::byte{0x80};  // 1000 = 0xE8 0x07; make it 0x80 0x07 -> still valid (896)
    m[payload0 + 5] = std::byte{0x00};  // ... and now overlong
    reseal(m);
    expect_error(4, 2000, m, errc::malformed_message, "malformed exception varint");
  }
  {
    auto m = e;
    m[payload0 + 4] = std::byte{0x00};
    m[payload0 + 5] = std::byte{0x00};
    m.erase(m.begin() + static_cast<std::ptrdiff_t>(payload0 + 5));
    put<std::uint64_t>(m, hdr + wire::offset_index_bytes, 5);
    put<std::uint64_t>(m, wire::offset_message_bytes, m.size());
    reseal(m);
    expect_error(4, 2000, m, errc::malformed_message, "exception high bits 0");
  }
  // Varint payloads.
  const auto v = test::pack_one(4, small.view(), {.indices = index_encoding::delta_varint});
  REQUIRE(get<std::uint64_t>(v, hdr + wire::offset_index_bytes) == 5);
  {
    auto m = v;
    m[payload0 + 4] = std::byte{0x87};  // the last varint now continues past the payload
    reseal(m);
    expect_error(4, 100, m, errc::malformed_message, "varint 4 of its chunk");
  }
  {
    auto m = v;
    m[payload0 + 4] = std::byte{99};  // last index 8 + 1 + 99 = 108
    reseal(m);
    expect_error(4, 100, m, errc::out_of_range, "index 108 is not below the tensor size 100");
  }
}

TEST_CASE("unpack: chunk directories are checked", "[pack][validation]") {
  const auto s = random_selection<std::uint32_t>(100000, 16384 + 500, 6);
  for (auto ie : {index_encoding::delta_bitpacked, index_encoding::delta_varint}) {
    INFO(name_of(ie));
    const auto good = test::pack_one(4, s.view(), {.indices = ie});
    const std::uint64_t base1 = get<std::uint64_t>(good, payload0);
    const std::uint64_t off1 = get<std::uint64_t>(good, payload0 + 8);
    REQUIRE(base1 == static_cast<std::uint64_t>(s.indices[16383]) + 1);
    {
      auto m = good;
      put<std::uint64_t>(m, payload0 + 8, 0);
      reseal(m);
      expect_error(4, 100000, m, errc::malformed_message, "directory entry 1: chunk offset 0");
    }
    {
      auto m = good;
      put<std::uint64_t>(m, payload0 + 8, std::uint64_t{1} << 40);
      reseal(m);
      expect_error(4, 100000, m, errc::malformed_message, "directory entry 1: chunk offset");
    }
    {
      auto m = good;
      put<std::uint64_t>(m, payload0, base1 + 1);
      reseal(m);
      expect_error(4, 100000, m, errc::malformed_message, "chunk 0: ends at index");
    }
    {
      auto m = good;
      put<std::uint64_t>(m, payload0, 100);
      reseal(m);
      expect_error(4, 100000, m, errc::malformed_message,
                   "chunk base index 100 after 0 is impossible");
    }
    {
      auto m = good;
      put<std::uint64_t>(m, payload0 + 8, off1 - 1);
      reseal(m);
      expect_error(4, 100000, m, errc::malformed_message, "chunk 0:");
    }
  }
}

TEST_CASE("unpack: decode checks the caller's buffers and never writes on failure",
          "[pack][validation]") {
  inline_executor ex;
  const auto s = random_selection<std::uint32_t>(1000, 50, 1);
  const auto good = test::pack_one(4, s.view());
  message_unpacker u(std::vector<tensor_info>{{4, 1000}});
  std::vector<std::uint32_t> idx(60, 777);
  std::vector<float> val(60, 7.0f);
  // A failed parse leaves no message to decode from.
  auto bad = good;
  bad[40] ^= std::byte{1};
  CHECK_THROWS_AS(u.parse(bad, ex), error);
  CHECK_THROWS_AS(u.decode(0, std::span<std::uint32_t>(idx), std::span<float>(val), ex), error);
  CHECK(idx == std::vector<std::uint32_t>(60, 777));
  CHECK(val == std::vector<float>(60, 7.0f));
  // Buffers too small: refused before writing.
  u.parse(good, ex);
  CHECK_THROWS_AS(u.decode(0, std::span<std::uint32_t>(idx).first(49), std::span<float>(val), ex),
                  error);
  CHECK_THROWS_AS(u.decode(0, std::span<std::uint32_t>(idx), std::span<float>(val).first(10), ex),
                  error);
  sparse_buffer<float, std::uint32_t> small(5, 49);
  small.resize(3);
  CHECK_THROWS_AS(u.decode(0, small, ex), error);
  CHECK(small.size() == 3);
  CHECK(small.dense_size() == 5);
  CHECK(idx == std::vector<std::uint32_t>(60, 777));
  CHECK_THROWS_AS(u.decode(1, std::span<std::uint32_t>(idx), std::span<float>(val), ex), error);
  u.decode(0, std::span<std::uint32_t>(idx), std::span<float>(val), ex);
  CHECK(std::vector<std::uint32_t>(idx.begin(), idx.begin() + 50) == s.indices);
  CHECK(idx[50] == 777);
  // Registering a tensor twice is an error.
  CHECK_THROWS_AS(u.register_tensor(4, 10), error);
}

TEST_CASE("pack: the sender refuses bad selections before writing", "[pack][validation]") {
  inline_executor ex;
  auto s = random_selection<std::uint32_t>(100000, 40000, 3);
  auto expect = [&](const test::selection<std::uint32_t>& sel, section_options o, errc code,
                    const std::string& part) {
    message_packer p;
    p.add(1, sel.view(), o);
    try {
      p.prepare(ex);
      FAIL("accepted");
    } catch (const error& e) {
      INFO(e.what());
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find(part) != std::string::npos);
    }
  };
  for (auto ie :
       {index_encoding::automatic, index_encoding::delta_bitpacked, index_encoding::delta_varint,
        index_encoding::raw_u32, index_encoding::raw_u64, index_encoding::bitmap}) {
    INFO(name_of(ie));
    for (std::size_t j : {std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{16384},
                          std::size_t{39999}}) {
      auto t = s;
      t.indices[j] = t.indices[j - 1];
      expect(t, {.indices = ie}, errc::invalid_argument,
             "not strictly ascending at position " + std::to_string(j));
    }
    auto t = s;
    t.indices.back() = 100000;
    expect(t, {.indices = ie}, errc::out_of_range,
           "index 100000 at position 39999 is not below the tensor size 100000");
    t = s;
    t.indices[20000] = 2000000;  // out of range and out of order
    expect(t, {.indices = ie}, errc::invalid_argument, "not strictly ascending at position 20001");
  }
  expect(s, {.indices = index_encoding::raw_u16}, errc::invalid_argument,
         "raw_u16 holds tensors of up to 65536");
  auto big = s;
  big.n = 10;
  expect(big, {}, errc::invalid_argument, "40000 pairs exceed the tensor size 10");
  {
    message_packer p;
    p.add(1, s.view());
    p.add(1, s.view());
    CHECK_THROWS_WITH(p.prepare(ex), Catch::Matchers::Contains("tensor 1 appears twice"));
  }
  {
    message_packer p;
    CHECK_THROWS_AS(p.add(1, s.view(), {.indices = index_encoding::random_k}), error);
    CHECK_THROWS_AS(p.add(1, s.view(), {.values = static_cast<value_encoding>(9)}), error);
    p.add(1, s.view());
    std::vector<std::byte> out(10, std::byte{3});
    CHECK_THROWS_AS(p.write(out, ex), error);  // not prepared
    p.prepare(ex);
    CHECK_THROWS_WITH(p.write(out, ex), Catch::Matchers::Contains("output holds 10 bytes"));
    CHECK(out == std::vector<std::byte>(10, std::byte{3}));
  }
  {  // 64-bit indices: the maximum followed by more indices.
    test::selection<std::uint64_t> w;
    w.n = std::numeric_limits<std::uint64_t>::max();
    w.indices = {5, std::numeric_limits<std::uint64_t>::max() - 1, 7};
    w.values = {1, 2, 3};
    for (auto ie :
         {index_encoding::delta_bitpacked, index_encoding::delta_varint, index_encoding::raw_u64}) {
      message_packer p;
      p.add(1, w.view(), {.indices = ie});
      CHECK_THROWS_AS(p.prepare(ex), error);
    }
  }
}

TEST_CASE("control sections: the sender and the reader check their bounds", "[pack][validation]") {
  inline_executor ex;
  const auto s = random_selection<std::uint32_t>(1000, 50, 1);
  const std::vector<std::byte> payload(24, std::byte{0x5a});
  {
    message_packer p;
    p.add_control(control_type::first_application, payload);
    CHECK_THROWS_WITH(p.add_control(control_type::first_application, payload),
                      Catch::Matchers::Contains("control type 65536 appears twice"));
    for (std::uint32_t t = 1; p.control_count() < wire::max_control_sections; ++t)
      p.add_control(t, {});
    CHECK_THROWS_WITH(p.add_control(99, payload),
                      Catch::Matchers::Contains("more than 16 control sections"));
  }
  // One tensor section, then one control section of 24 bytes.
  message_packer p;
  p.clear(7);
  p.add(4, s.view(), {.indices = index_encoding::raw_u32});
  p.add_control(control_type::first_application, payload);
  std::vector<std::byte> good(p.prepare(ex));
  p.write(good, ex);
  const std::size_t control = good.size() - wire::message_trailer_bytes - payload.size() - sec;
  auto edited = [&](std::size_t offset, auto value) {
    auto m = good;
    put(m, offset, value);
    reseal(m);
    return m;
  };
  {
    message_unpacker u(std::vector<tensor_info>{{4, 1000}});
    const auto& info = u.parse(good, ex);
    REQUIRE(info.sections.size() == 1);
    REQUIRE(info.controls.size() == 1);
    CHECK(info.controls[0].offset == control);
    CHECK(u.find_control(control_type::first_application) == 0);
    CHECK(u.find_control(control_type::step_reports) == message_unpacker::npos);
  }
  for (std::size_t field : {wire::offset_index_encoding, wire::offset_value_encoding}) {
    expect_error(4, 1000, edited(control + field, std::uint8_t{1}), errc::malformed_message,
                 "(control type 65536): a control section has no encodings");
  }
  for (std::size_t field :
       {wire::offset_dense_size, wire::offset_count, wire::offset_value_bytes}) {
    expect_error(4, 1000, edited(control + field, std::uint64_t{1}), errc::malformed_message,
                 "a control section has no encodings, size, count or values");
  }
  expect_error(4, 1000, edited(control + wire::offset_index_bytes, std::uint64_t{25}),
               errc::malformed_message,
               "payload of 25 bytes runs past the end of the message (24 bytes left)");
  expect_error(4, 1000, edited(control + wire::offset_index_bytes, std::uint64_t{23}),
               errc::malformed_message, "1 unused bytes after the last section");
  {  // The same type twice.
    message_packer q;
    q.add_control(5, {});
    q.add_control(6, {});
    std::vector<std::byte> m(q.prepare(ex));
    q.write(m, ex);
    put<std::uint32_t>(m, hdr + sec, 5);
    reseal(m);
    expect_error(4, 1000, m, errc::malformed_message,
                 "section 1 at byte 72 (control type 5): the control type appears twice");
  }
}
