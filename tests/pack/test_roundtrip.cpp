// SPDX-License-Identifier: Apache-2.0
// Round-trip properties: every index encoding with every value encoding, densities from 1e-5 to
// 1, 32- and 64-bit indices, chunk and block boundaries, several tensors per message, thread
// counts; the automatic choice is never larger than any forced encoding.
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include "catch.hpp"
#include "support.hpp"

#include <bit>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using namespace stellatrain;
using stellatrain::test::random_selection;

namespace {

const index_encoding all_index_encodings[] = {
    index_encoding::automatic, index_encoding::raw_u16,      index_encoding::raw_u32,
    index_encoding::raw_u64,   index_encoding::delta_varint, index_encoding::delta_bitpacked,
    index_encoding::bitmap};
const value_encoding all_value_encodings[] = {value_encoding::fp32, value_encoding::fp16,
                                              value_encoding::bf16};

bool fits(index_encoding e, std::uint64_t n) {
  if (e == index_encoding::raw_u16) return n <= 65536;
  if (e == index_encoding::raw_u32) return n <= (std::uint64_t{1} << 32);
  return true;
}

float through(float v, value_encoding e) {
  if (e == value_encoding::fp16) return to_float(fp16(v));
  if (e == value_encoding::bf16) return to_float(bf16(v));
  return v;
}

// Packs `s` with the given encodings, parses, decodes into I-typed indices and float values
// and compares with the input. Returns the message size.
template <class I, class OutI = I, executor Executor>
std::size_t round_trip(const test::selection<I>& s, index_encoding ie, value_encoding ve,
                       Executor& ex, index_encoding* chosen = nullptr) {
  message_packer packer;
  packer.clear(99);
  packer.add(5, s.view(), {.indices = ie, .values = ve});
  std::vector<std::byte> wire(packer.prepare(ex));
  REQUIRE(packer.write(wire, ex).size() == wire.size());
  if (chosen != nullptr) *chosen = packer.chosen_encoding(0);
  if (ie != index_encoding::automatic) REQUIRE(packer.chosen_encoding(0) == ie);

  const std::vector<tensor_info> tensors = {{1, 10}, {5, s.n}};
  message_unpacker unpacker(tensors);
  const auto& info = unpacker.parse(wire, ex);
  REQUIRE(info.tag == 99);
  REQUIRE(info.bytes == wire.size());
  REQUIRE(info.sections.size() == 1);
  const auto& sec = info.sections[0];
  REQUIRE(sec.tensor == 5);
  REQUIRE(sec.dense_size == s.n);
  REQUIRE(sec.count == s.indices.size());
  REQUIRE(sec.values == ve);
  REQUIRE(sec.indices == packer.chosen_encoding(0));

  std::vector<OutI> idx(sec.count + 3, 0xAB);
  std::vector<float> val(sec.count + 3, -7.0f);
  unpacker.decode(0, std::span<OutI>(idx), std::span<float>(val), ex);
  for (std::size_t j = 0; j < s.indices.size(); ++j) {
    if (idx[j] != s.indices[j]) FAIL("index " << j << ": " << idx[j] << " != " << s.indices[j]);
    if (std::bit_cast<std::uint32_t>(val[j]) !=
        std::bit_cast<std::uint32_t>(through(s.values[j], ve))) {
      FAIL("value " << j << ": " << val[j] << " != " << through(s.values[j], ve));
    }
  }
  // Nothing written past the section's count.
  for (std::size_t j = s.indices.size(); j < idx.size(); ++j) {
    REQUIRE(idx[j] == OutI{0xAB});
    REQUIRE(val[j] == -7.0f);
  }
  return wire.size();
}

}  // namespace

TEST_CASE("round trip: every index and value encoding across densities 1e-5 .. 1",
          "[pack][roundtrip]") {
  inline_executor ex;
  const double densities[] = {1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0};
  for (std::uint64_t n : {std::uint64_t{65536}, std::uint64_t{200003}}) {
    for (double d : densities) {
      const auto k = static_cast<std::uint64_t>(d * static_cast<double>(n));
      const auto s = random_selection<std::uint32_t>(n, std::max<std::uint64_t>(k, 1), n + k);
      for (auto ie : all_index_encodings) {
        if (!fits(ie, n)) continue;
        for (auto ve : all_value_encodings) {
          INFO("n " << n << " density " << d << " k " << s.indices.size() << " " << name_of(ie)
                    << "/" << name_of(ve));
          round_trip(s, ie, ve, ex);
        }
      }
    }
  }
}

TEST_CASE("round trip: the automatic encoding is the smallest one", "[pack][roundtrip]") {
  inline_executor ex;
  for (double d : {1e-5, 1e-3, 1e-2, 0.05, 0.2, 0.4, 0.9, 1.0}) {
    const std::uint64_t n = 100000;
    const auto s = random_selection<std::uint32_t>(
        n, std::max<std::uint64_t>(1, static_cast<std::uint64_t>(d * n)), 77);
    index_encoding chosen{};
    const std::size_t automatic =
        round_trip(s, index_encoding::automatic, value_encoding::bf16, ex, &chosen);
    INFO("density " << d << " chose " << name_of(chosen));
    for (auto ie : all_index_encodings) {
      if (ie == index_encoding::automatic || !fits(ie, n)) continue;
      const std::size_t forced = round_trip(s, ie, value_encoding::bf16, ex);
      CHECK(automatic <= forced);
      if (ie == chosen) CHECK(automatic == forced);
    }
  }
  // Consecutive indices cost almost nothing as gaps of zero.
  test::selection<std::uint32_t> run;
  run.n = 1 << 20;
  for (std::uint32_t i = 0; i < (1u << 20); ++i) {
    run.indices.push_back(i);
    run.values.push_back(1.0f);
  }
  index_encoding chosen{};
  const std::size_t bytes =
      round_trip(run, index_encoding::automatic, value_encoding::bf16, ex, &chosen);
  CHECK(chosen == index_encoding::delta_bitpacked);
  CHECK(bytes < 2 * run.indices.size() + run.indices.size() / 50);
}

TEST_CASE("round trip: sizes around blocks, chunks, and edges of the index range",
          "[pack][roundtrip]") {
  thread_pool pool(2);
  const std::uint64_t counts[] = {0,   1,     2,     255,   256,   257,  511,
                                  512, 16383, 16384, 16385, 32768, 40000};
  for (std::uint64_t k : counts) {
    const std::uint64_t n = std::max<std::uint64_t>(k * 3 + 1, 70000);
    auto s = random_selection<std::uint32_t>(n, k, k);
    if (k >= 2) {  // the first and last element of the tensor
      s.indices.front() = 0;
      s.indices.back() = static_cast<std::uint32_t>(n - 1);
    }
    for (auto ie : all_index_encodings) {
      if (!fits(ie, n)) continue;
      INFO("k " << k << " " << name_of(ie));
      round_trip(s, ie, value_encoding::fp32, pool);
    }
  }
}

TEST_CASE("round trip: raw_u16 keeps indices 32768..65535 (no signed clamp)", "[pack][roundtrip]") {
  inline_executor ex;
  test::selection<std::uint32_t> s;
  s.n = 65536;
  s.indices = {0, 1, 32766, 32767, 32768, 32769, 40000, 65534, 65535};
  s.values.assign(s.indices.size(), 2.5f);
  round_trip(s, index_encoding::raw_u16, value_encoding::fp32, ex);
  message_packer packer;
  packer.add(5, s.view(), {.indices = index_encoding::raw_u16});
  std::vector<std::byte> wire(packer.prepare(ex));
  packer.write(wire, ex);
  const std::size_t payload = wire::message_header_bytes + wire::section_header_bytes;
  CHECK(test::get<std::uint16_t>(wire, payload + 2 * 4) == 32768);
  CHECK(test::get<std::uint16_t>(wire, payload + 2 * 8) == 65535);
}

TEST_CASE("round trip: 64-bit indices past 2^32 with huge gaps", "[pack][roundtrip]") {
  thread_pool pool(2);
  for (std::uint64_t n : {(std::uint64_t{1} << 33) + 17, std::uint64_t{1} << 50,
                          std::numeric_limits<std::uint64_t>::max()}) {
    auto s = random_selection<std::uint64_t>(n, 20000, n % 1000);
    s.indices.front() = 0;
    s.indices.back() = n - 1;
    for (auto ie : {index_encoding::automatic, index_encoding::raw_u64,
                    index_encoding::delta_varint, index_encoding::delta_bitpacked}) {
      INFO("n " << n << " " << name_of(ie));
      round_trip(s, ie, value_encoding::bf16, pool);
    }
    // A 32-bit output cannot hold these indices: decode refuses before writing.
    const auto wire = test::pack_one(0, s.view());
    message_unpacker u(std::vector<tensor_info>{{0, n}});
    u.parse(wire, pool);
    std::vector<std::uint32_t> idx(s.indices.size(), 3);
    std::vector<float> val(s.indices.size(), 3.0f);
    CHECK_THROWS_AS(u.decode(0, std::span<std::uint32_t>(idx), std::span<float>(val), pool), error);
    CHECK(idx == std::vector<std::uint32_t>(s.indices.size(), 3));
  }
  // 32-bit inputs into 64-bit outputs and back.
  inline_executor ex;
  const auto s = random_selection<std::uint32_t>(std::uint64_t{1} << 32, 5000, 4);
  for (auto ie : all_index_encodings) {
    if (ie == index_encoding::bitmap || !fits(ie, s.n))
      continue;  // a 512 MiB bitmap is not a unit test
    round_trip<std::uint32_t, std::uint64_t>(s, ie, value_encoding::fp32, ex);
  }
}

TEST_CASE("round trip: random_k sections carry the key, not the indices", "[pack][roundtrip]") {
  thread_pool pool(2);
  for (std::uint64_t n : {std::uint64_t{1}, std::uint64_t{1000}, std::uint64_t{1} << 20}) {
    for (std::uint64_t k : {std::uint64_t{0}, std::uint64_t{1}, n / 100, n / 2 + 1, n}) {
      const random_key key{.seed = 0x1234, .step = static_cast<std::uint32_t>(k), .tensor = 3};
      std::vector<float> values(k);
      for (std::size_t j = 0; j < k; ++j) values[j] = static_cast<float>(j) * 0.5f;
      message_packer packer;
      packer.add_random_k<float>(8, key, n, values, value_encoding::bf16);
      std::vector<std::byte> wire(packer.prepare(pool));
      packer.write(wire, pool);
      CHECK(wire.size() ==
            wire::message_header_bytes + wire::section_header_bytes + 16 + 2 * k + 4);

      message_unpacker u(std::vector<tensor_info>{{8, n}});
      const auto& info = u.parse(wire, pool);
      REQUIRE(info.sections[0].indices == index_encoding::random_k);
      CHECK(info.sections[0].random.seed == key.seed);
      CHECK(info.sections[0].random.step == key.step);
      CHECK(info.sections[0].random.tensor == key.tensor);
      sparse_buffer<bf16, std::uint64_t> out(0, k);
      u.decode(0, out, pool);
      std::vector<std::uint64_t> expect(k);
      std::vector<std::uint64_t> ws(sample_indices_workspace_words(n));
      sample_sorted_indices<std::uint64_t>(key, n, k, expect, ws);
      REQUIRE(out.size() == k);
      CHECK(out.dense_size() == n);
      for (std::size_t j = 0; j < k; ++j) {
        REQUIRE(out.indices()[j] == expect[j]);
        REQUIRE(same_bits(out.values()[j], bf16(values[j])));
      }
    }
  }
}

TEST_CASE("round trip: many tensors in one message (bucket fusion)", "[pack][roundtrip]") {
  thread_pool pool(2);
  std::vector<test::selection<std::uint32_t>> tensors;
  std::vector<tensor_info> shapes;
  message_packer packer;
  packer.clear(7);
  std::mt19937_64 rng(11);
  for (std::uint32_t t = 0; t < 120; ++t) {
    const std::uint64_t n = 1 + rng() % 5000 + (t % 10 == 0 ? 200000 : 0);
    tensors.push_back(random_selection<std::uint32_t>(n, rng() % (n + 1), t));
    shapes.push_back({1000 + 3 * t, n});
  }
  for (std::uint32_t t = 0; t < 120; ++t) {
    const auto ie = all_index_encodings[t % 7];
    const auto ve = all_value_encodings[t % 3];
    packer.add(1000 + 3 * t, tensors[t].view(),
               {.indices = fits(ie, tensors[t].n) ? ie : index_encoding::automatic, .values = ve});
  }
  std::vector<std::byte> wire(packer.prepare(pool));
  packer.write(wire, pool);

  std::reverse(shapes.begin(), shapes.end());  // registration order does not matter
  message_unpacker u(shapes);
  const auto& info = u.parse(wire, pool);
  REQUIRE(info.sections.size() == 120);
  CHECK(info.tag == 7);
  std::uint64_t total = 0;
  for (std::uint32_t t = 0; t < 120; ++t) {
    const std::size_t i = u.find(1000 + 3 * t);
    REQUIRE(i == t);
    sparse_buffer<float, std::uint32_t> out(0, tensors[t].indices.size());
    u.decode(i, out, pool);
    REQUIRE(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) ==
            tensors[t].indices);
    for (std::size_t j = 0; j < out.size(); ++j) {
      REQUIRE(out.values()[j] == through(tensors[t].values[j], all_value_encodings[t % 3]));
    }
    total += out.size();
  }
  CHECK(info.total_count() == total);
  CHECK(u.find(1) == message_unpacker::npos);
}

TEST_CASE("round trip: control sections beside tensor sections, and alone", "[pack][roundtrip]") {
  thread_pool pool(2);
  const auto big = random_selection<std::uint32_t>(400000, 40000, 5);
  const auto small = random_selection<std::uint32_t>(100, 7, 6);
  std::vector<std::byte> reports(1000), app(3);
  for (std::size_t i = 0; i < reports.size(); ++i) reports[i] = static_cast<std::byte>(i * 7);
  app = {std::byte{1}, std::byte{2}, std::byte{3}};
  const std::vector<tensor_info> shapes = {{3, big.n}, {4, small.n}};
  for (bool with_tensors : {true, false}) {
    message_packer packer;
    packer.clear(9);
    if (with_tensors) packer.add(3, big.view(), {.values = value_encoding::bf16});
    packer.add_control(control_type::step_reports, reports);
    packer.add_control(control_type::first_application + 1, app);
    packer.add_control(control_type::first_application, {});  // an empty payload is one
    if (with_tensors) packer.add(4, small.view());
    CHECK(packer.control_count() == 3);
    std::vector<std::byte> wire(packer.prepare(pool));
    packer.write(wire, pool);

    message_unpacker u(shapes);
    const auto& info = u.parse(wire, pool);
    CHECK(info.tag == 9);
    REQUIRE(info.sections.size() == (with_tensors ? 2u : 0u));
    REQUIRE(info.controls.size() == 3);
    const auto bytes_of = [&](std::uint32_t type) {
      const std::size_t c = u.find_control(type);
      REQUIRE(c != message_unpacker::npos);
      const auto payload = info.controls[c].payload;
      return std::vector<std::byte>(payload.begin(), payload.end());
    };
    CHECK(bytes_of(control_type::step_reports) == reports);
    CHECK(bytes_of(control_type::first_application + 1) == app);
    CHECK(bytes_of(control_type::first_application).empty());
    // The controls follow the tensor sections, in the order added.
    CHECK(info.controls[0].type == control_type::step_reports);
    CHECK(info.controls[0].offset > (with_tensors ? info.sections[1].offset : 0));
    if (!with_tensors) continue;
    sparse_buffer<float, std::uint32_t> out(0, big.indices.size());
    u.decode(u.find(3), out, pool);
    CHECK(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) == big.indices);
    u.decode(u.find(4), out, pool);
    CHECK(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) == small.indices);
  }
}

TEST_CASE("packing is deterministic and independent of the thread count", "[pack][roundtrip]") {
  const auto s = random_selection<std::uint32_t>(3000000, 60000, 3);
  inline_executor one;
  thread_pool two(2), five(5);
  for (auto ie : {index_encoding::automatic, index_encoding::delta_bitpacked,
                  index_encoding::bitmap, index_encoding::delta_varint}) {
    auto pack_with = [&](auto& ex) {
      message_packer p;
      p.add(1, s.view(), {.indices = ie, .values = value_encoding::fp16});
      std::vector<std::byte> w(p.prepare(ex));
      p.write(w, ex);
      return w;
    };
    const auto a = pack_with(one);
    {  // prepare and write may be repeated on the same sections
      message_packer p;
      p.add(1, s.view(), {.indices = ie, .values = value_encoding::fp16});
      p.prepare(two);
      std::vector<std::byte> w(p.prepare(two));
      p.write(w, two);
      CHECK(w == a);
      p.write(w, two);
      CHECK(w == a);
    }
    CHECK(pack_with(two) == a);
    CHECK(pack_with(five) == a);
    CHECK(pack_with(one) == a);
  }
}

TEST_CASE("values of every C++ type pack and unpack into every C++ type", "[pack][roundtrip]") {
  inline_executor ex;
  const auto s = random_selection<std::uint32_t>(5000, 300, 8);
  std::vector<bf16> b;
  for (float v : s.values) b.push_back(bf16(v));
  const sparse_view<const bf16, const std::uint32_t> view(s.indices, b, s.n);
  for (auto ve : all_value_encodings) {
    const auto wire = test::pack_one(2, view, {.values = ve});
    message_unpacker u(std::vector<tensor_info>{{2, s.n}});
    u.parse(wire, ex);
    sparse_buffer<fp16, std::uint64_t> h(0, 300);
    u.decode(0, h, ex);
    sparse_buffer<bf16, std::uint32_t> back(0, 300);
    u.decode(0, back, ex);
    for (std::size_t j = 0; j < 300; ++j) {
      const float wire_value = through(to_float(b[j]), ve);
      REQUIRE(same_bits(h.values()[j], fp16(wire_value)));
      REQUIRE(same_bits(back.values()[j], bf16(wire_value)));
      REQUIRE(h.indices()[j] == s.indices[j]);
    }
  }
}
