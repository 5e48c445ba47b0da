// SPDX-License-Identifier: Apache-2.0
// Chunked sections (chunked_topk indices, chunk_sign / chunk_2bit values): what the codec
// selected comes back from the wire as the codec decodes it, in messages of format version 3,
// and hostile versions of such sections (bad prefix, sizes, order, ranges, padding, pairing,
// version) are refused with the right code before anything is written.
#include <stellatrain/compress/chunked_codec.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include "../compress/compress_test_support.hpp"
#include "catch.hpp"
#include "support.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

using namespace stellatrain;
using test::expect_error;
using test::get;
using test::put;
using test::reseal;

namespace {

constexpr std::size_t hdr = wire::message_header_bytes;
constexpr std::size_t sec = wire::section_header_bytes;
constexpr std::size_t payload0 = hdr + sec;  // the first section's index payload

chunked_selection encode(std::uint64_t n, unsigned b, std::uint32_t k, chunk_value_bits bits,
                         std::uint64_t seed) {
  const auto g = test::gaussian(n, seed, 1.0f);
  std::vector<float> feedback(n, 0.0f);
  chunked_selection sel;
  chunked_codec({.chunk_bits = b, .k = k, .bits = bits}).encode(g, feedback, sel);
  return sel;
}

std::vector<std::byte> pack_chunked(std::uint32_t tensor, const chunked_selection& sel) {
  inline_executor ex;
  message_packer p;
  p.clear(5);
  p.add_chunked(tensor, sel.section());
  std::vector<std::byte> m(p.prepare(ex));
  p.write(m, ex);
  return m;
}

// The selection as the codec decodes it: index -> value.
std::vector<float> dense_of(const chunked_selection& sel) {
  std::vector<float> d(sel.size, 0.0f);
  chunked_codec::decode_add(sel, d, 1.0f);
  return d;
}

// Sets the b-bit field j of the packed indices of the first section (b <= 16).
void set_index(std::vector<std::byte>& m, unsigned b, std::uint64_t j, std::uint32_t x) {
  for (unsigned i = 0; i < b; ++i) {
    const std::uint64_t bit = j * b + i;
    auto& byte = m[payload0 + wire::chunked_prefix_bytes + bit / 8];
    const auto mask = static_cast<std::byte>(1u << (bit % 8));
    byte = ((x >> i) & 1u) != 0 ? (byte | mask) : (byte & ~mask);
  }
}

}  // namespace

TEST_CASE("chunked sections: the wire gives back what the codec decodes", "[pack][chunked]") {
  const unsigned b = GENERATE(4u, 12u);
  const auto bits = GENERATE(chunk_value_bits::one, chunk_value_bits::two);
  const std::uint64_t n = GENERATE(1, 37, 3 * 4096 + 5, 100000);
  const std::uint32_t k = b == 4 ? 3 : 64;
  CAPTURE(b, static_cast<int>(bits), n);
  const auto sel = encode(n, b, k, bits, n + b);
  const auto m = pack_chunked(9, sel);
  const auto shape = wire::chunked_shape_of(n, b, k, static_cast<unsigned>(bits));
  REQUIRE(m.size() == hdr + sec + shape.index_bytes + shape.value_bytes + 4);
  CHECK(get<std::uint16_t>(m, wire::offset_version) == 3);
  CHECK(shape.count == sel.indices.size());
  CHECK((shape.index_bytes + shape.value_bytes) * 8 <= sel.payload_bits() + 64 + 16);

  thread_pool pool{2};
  message_unpacker u(std::vector<tensor_info>{{9, n}});
  const auto& info = u.parse(m, pool);
  REQUIRE(info.sections.size() == 1);
  const section_info& s = info.sections[0];
  CHECK(s.indices == index_encoding::chunked_topk);
  CHECK(s.values ==
        (bits == chunk_value_bits::two ? value_encoding::chunk_2bit : value_encoding::chunk_sign));
  CHECK(s.chunk_bits == b);
  CHECK(s.chunk_k == k);
  REQUIRE(s.count == shape.count);
  sparse_buffer<float, std::uint32_t> out(0, s.count);
  u.decode(0, out, pool);
  const auto want = dense_of(sel);
  std::vector<char> seen(n, 0);
  for (std::size_t j = 0; j < out.size(); ++j) {
    const auto i = out.indices()[j];
    REQUIRE(i < n);
    REQUIRE((j == 0 || i > out.indices()[j - 1]));
    REQUIRE(out.values()[j] == want[i]);
    seen[i] = 1;
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    if (!seen[i]) REQUIRE(want[i] == 0.0f);
  }
  // Narrower outputs: bf16 values (the scales are bf16: exact) and 64-bit indices.
  sparse_buffer<bf16, std::uint64_t> narrow(0, s.count);
  u.decode(0, narrow, pool);
  for (std::size_t j = 0; j < out.size(); ++j) {
    REQUIRE(narrow.indices()[j] == out.indices()[j]);
    REQUIRE(to_float(narrow.values()[j]) == out.values()[j]);
  }
}

TEST_CASE("chunked sections: beside other sections; version 2 without them", "[pack][chunked]") {
  inline_executor ex;
  const auto sel = encode(70000, 10, 5, chunk_value_bits::two, 3);
  const auto other = test::random_selection<std::uint32_t>(1000, 40, 2);
  const std::vector<std::byte> control{std::byte{1}, std::byte{2}};
  message_packer p;
  p.clear(1);
  p.add(2, other.view(), {.values = value_encoding::bf16});
  p.add_chunked(3, sel.section());
  p.add_control(control_type::first_application, control);
  std::vector<std::byte> m(p.prepare(ex));
  p.write(m, ex);
  CHECK(get<std::uint16_t>(m, wire::offset_version) == 3);
  message_unpacker u(std::vector<tensor_info>{{2, 1000}, {3, 70000}});
  const auto& info = u.parse(m, ex);
  REQUIRE(info.sections.size() == 2);
  CHECK(info.sections[1].indices == index_encoding::chunked_topk);
  CHECK(info.controls.size() == 1);
  sparse_buffer<float, std::uint32_t> out(0, info.sections[1].count);
  u.decode(1, out, ex);
  const auto want = dense_of(sel);
  for (std::size_t j = 0; j < out.size(); ++j) REQUIRE(out.values()[j] == want[out.indices()[j]]);

  const auto plain = test::pack_one(2, other.view());
  CHECK(get<std::uint16_t>(plain, wire::offset_version) == 2);
}

TEST_CASE("chunked sections: hostile sections are refused", "[pack][chunked][validation]") {
  // n = 70000 in chunks of 1024: 68 full chunks and one of 368, 5 sent per chunk.
  const std::uint64_t n = 70000;
  const unsigned b = 10;
  const auto sel = encode(n, b, 5, chunk_value_bits::two, 8);
  const auto good = pack_chunked(3, sel);
  const auto shape = wire::chunked_shape_of(n, b, 5, 2);
  {
    message_unpacker u(std::vector<tensor_info>{{3, n}});
    inline_executor ex;
    CHECK_NOTHROW(u.parse(good, ex));
  }
  {  // Version 2 has no chunked encodings.
    auto m = good;
    put<std::uint16_t>(m, wire::offset_version, 2);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "unknown index encoding 8 in version 2");
  }
  {  // Chunked indices with fp32 values, and raw indices with chunked values.
    auto m = good;
    m[hdr + wire::offset_value_encoding] = static_cast<std::byte>(value_encoding::fp32);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "chunked_topk indices with fp32 values");
    m = good;
    m[hdr + wire::offset_index_encoding] = static_cast<std::byte>(index_encoding::raw_u32);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "raw_u32 indices with chunk_2bit values");
  }
  {  // The prefix: b, the reserved bytes, k.
    for (unsigned bad_b : {0u, 17u}) {
      auto m = good;
      m[payload0] = static_cast<std::byte>(bad_b);
      reseal(m);
      expect_error(3, n, m, errc::malformed_message, "b = " + std::to_string(bad_b));
    }
    auto m = good;
    m[payload0 + 2] = std::byte{1};
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "reserved bytes set");
    for (std::uint32_t bad_k : {0u, 1025u}) {
      m = good;
      put<std::uint32_t>(m, payload0 + 4, bad_k);
      reseal(m);
      expect_error(3, n, m, errc::malformed_message, "k = " + std::to_string(bad_k));
    }
    // Another valid k: the sizes no longer match the header.
    m = good;
    put<std::uint32_t>(m, payload0 + 4, 6);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "6 of every 2^10 elements");
  }
  {  // The header's count and payload sizes.
    auto m = good;
    put<std::uint64_t>(m, hdr + wire::offset_count, shape.count - 1);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "pairs in");
    m = good;
    put<std::uint64_t>(m, hdr + wire::offset_index_bytes, 7);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "no room for its prefix");
  }
  {  // Order inside a chunk, and an index past a chunk's end (the last chunk has 368).
    auto m = good;
    set_index(m, b, 1, sel.indices[0]);
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "not strictly ascending at position 1");
    m = good;
    set_index(m, b, shape.count - 1, 400);
    reseal(m);
    expect_error(3, n, m, errc::out_of_range, "index 400 at position");
  }
  {  // Bits after the last index, after the last code.
    const std::uint64_t index_bits = shape.count * b;
    const std::uint64_t code_bits = shape.count * 2;
    REQUIRE(index_bits % 8 != 0);
    REQUIRE(code_bits % 8 != 0);
    auto m = good;
    m[payload0 + shape.index_bytes - 1] |= std::byte{0x80};
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "bits set after the last index");
    m = good;
    m[payload0 + shape.index_bytes + shape.value_bytes - 1] |= std::byte{0x80};
    reseal(m);
    expect_error(3, n, m, errc::malformed_message, "bits set after the last value code");
  }
  {  // A flipped bit without a new checksum is corruption, whatever it hits.
    auto m = good;
    m[payload0 + 20] ^= std::byte{4};
    expect_error(3, n, m, errc::checksum_mismatch, "checksum");
  }
}

TEST_CASE("chunked sections: the packer refuses bad sections", "[pack][chunked]") {
  const auto sel = encode(5000, 8, 4, chunk_value_bits::one, 1);
  auto refused = [](const chunked_section& c, errc code, const std::string& part) {
    message_packer p;
    try {
      p.add_chunked(1, c);
    } catch (const error& e) {
      INFO("what(): " << e.what());
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find(part) != std::string::npos);
      CHECK(p.section_count() == 0);
      return;
    }
    FAIL("add_chunked accepted a bad section (expected: " << part << ")");
  };
  auto c = sel.section();
  c.chunk_bits = 17;
  refused(c, errc::invalid_argument, "b = 17");
  c = sel.section();
  c.k = 0;
  refused(c, errc::invalid_argument, "k = 0");
  c = sel.section();
  c.code_bits = 3;
  refused(c, errc::invalid_argument, "3 code bits");
  c = sel.section();
  c.indices = c.indices.first(c.indices.size() - 1);
  refused(c, errc::invalid_argument, "indices");
  c = sel.section();
  c.scales = c.scales.first(c.scales.size() - 1);
  refused(c, errc::invalid_argument, "scales");
  auto bad = sel.indices;
  std::swap(bad[0], bad[1]);
  c = sel.section();
  c.indices = bad;
  refused(c, errc::invalid_argument, "not strictly ascending at position 1");
  // 5000 = 19 * 256 + 136: the last chunk holds 136 elements.
  bad = sel.indices;
  bad.back() = 136;
  c = sel.section();
  c.indices = bad;
  refused(c, errc::out_of_range, "index 136 at position");

  message_packer p;
  const auto other = test::random_selection<std::uint32_t>(1000, 40, 2);
  CHECK_THROWS_WITH(p.add(1, other.view(), {.values = value_encoding::chunk_2bit}),
                    Catch::Matchers::Contains("chunk_2bit values go in chunked sections"));
  CHECK_THROWS_WITH(p.add(1, other.view(), {.indices = index_encoding::chunked_topk}),
                    Catch::Matchers::Contains("added with add_chunked"));
}
