// SPDX-License-Identifier: Apache-2.0
// The saved-state container: round trips of fields and arrays through bytes, a span and a
// stream; the byte layout at fixed offsets (little-endian); every truncation and every
// corrupted byte refused with a typed error; misuse of the writer and the reader refused.
#include <stellatrain/core/saved_state.hpp>

#include "catch.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace st = stellatrain;
using st::errc;

namespace {

constexpr st::state_kind kind = st::state_kind::of("STELLTST", 3);

struct sample {
  std::uint32_t id = 7;
  double rate = -2.5;
  std::vector<float> values{1.0f, -0.0f, std::numeric_limits<float>::infinity(), 3.25f};
  std::vector<std::uint64_t> steps{0, 1, std::numeric_limits<std::uint64_t>::max()};
  st::errc code = errc::timeout;

  void write(st::state_writer& w) const {
    w.record("CONF", [&](auto& r) {
      r.put(id);
      r.put(rate);
      r.put(code);
    });
    w.record("VALS", [&](auto& r) {
      r.put(static_cast<std::uint64_t>(values.size()));
      r.put_array(std::span<const float>(values));
    });
    w.record("NONE", [](auto&) {});
    w.record("STEP", [&](auto& r) { r.put_array(std::span<const std::uint64_t>(steps)); });
  }

  static sample read(std::span<const std::byte> bytes) {
    st::state_reader rd(bytes, kind, "sample::read");
    sample s;
    auto conf = rd.next("CONF");
    s.id = conf.get<std::uint32_t>();
    s.rate = conf.get<double>();
    s.code = conf.get<st::errc>();
    conf.finish();
    auto vals = rd.next("VALS");
    const auto n = vals.get<std::uint64_t>();
    if (!vals.holds<float>(n)) vals.fail("too many values");
    s.values.resize(n);
    vals.get_array(std::span<float>(s.values));
    vals.finish();
    rd.next("NONE").finish();
    auto steps = rd.next("STEP");
    s.steps.resize(steps.remaining() / 8);
    steps.get_array(std::span<std::uint64_t>(s.steps));
    steps.finish();
    rd.finish();
    return s;
  }
};

std::vector<std::byte> saved(const sample& s) {
  return st::save_state_bytes(kind, [&](st::state_writer& w) { s.write(w); });
}

void require_same(const sample& a, const sample& b) {
  CHECK(a.id == b.id);
  CHECK(a.rate == b.rate);
  CHECK(a.code == b.code);
  REQUIRE(a.values.size() == b.values.size());
  CHECK(std::memcmp(a.values.data(), b.values.data(), a.values.size() * 4) == 0);
  CHECK(a.steps == b.steps);
}

template <class F>
st::errc code_of(F&& f) {
  try {
    f();
  } catch (const st::error& e) {
    return static_cast<st::errc>(e.code().value());
  }
  return errc{};
}

std::uint32_t le32(const std::vector<std::byte>& b, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i)
    v = v << 8 | std::to_integer<std::uint32_t>(b[at + static_cast<std::size_t>(i)]);
  return v;
}
std::uint64_t le64(const std::vector<std::byte>& b, std::size_t at) {
  return le32(b, at) | std::uint64_t{le32(b, at + 4)} << 32;
}

}  // namespace

TEST_CASE("a saved state round-trips through bytes, a buffer and a stream", "[saved_state]") {
  const sample s;
  const auto bytes = saved(s);
  require_same(sample::read(bytes), s);

  const std::uint64_t size = st::saved_state_size([&](st::state_writer& w) { s.write(w); });
  CHECK(size == bytes.size());
  std::vector<std::byte> buffer(size + 5, std::byte{0xee});
  const auto written = st::save_state_into(buffer, kind, [&](st::state_writer& w) { s.write(w); });
  CHECK(written == size);
  CHECK(std::memcmp(buffer.data(), bytes.data(), bytes.size()) == 0);
  CHECK(buffer.back() == std::byte{0xee});
  std::vector<std::byte> small(size - 1);
  CHECK(code_of([&] {
          (void)st::save_state_into(small, kind, [&](st::state_writer& w) { s.write(w); });
        }) == errc::size_mismatch);

  std::stringstream ss;
  st::save_state_to(ss, kind, [&](st::state_writer& w) { s.write(w); });
  const auto streamed = st::read_state_stream(ss);
  CHECK(streamed == bytes);

  // No records at all.
  const auto empty = st::save_state_bytes(kind, [](st::state_writer&) {});
  CHECK(empty.size() == 48);
  st::state_reader rd(empty, kind, "empty");
  CHECK(rd.records() == 0);
  rd.finish();
}

TEST_CASE("the container's bytes are little-endian at the documented offsets", "[saved_state]") {
  const sample s;
  const auto b = saved(s);
  CHECK(std::memcmp(b.data(), "STELLTST", 8) == 0);
  CHECK(le32(b, 8) == 1);   // container version
  CHECK(le32(b, 12) == 3);  // layout version
  CHECK(le64(b, 16) == 4);  // records
  CHECK(le32(b, 24) == 0);
  CHECK(le32(b, 28) == st::crc32c(std::span<const std::byte>(b).first(28)));
  // First record: CONF with u32 + f64 + i32 (the enum's underlying type).
  CHECK(std::memcmp(b.data() + 32, "CONF", 4) == 0);
  CHECK(le64(b, 40) == 16);
  CHECK(le32(b, 48) == 7);
  std::uint64_t rate_bits;
  const double rate = -2.5;
  std::memcpy(&rate_bits, &rate, 8);
  CHECK(le64(b, 52) == rate_bits);
  CHECK(le32(b, 60) == static_cast<std::uint32_t>(errc::timeout));
  CHECK(le32(b, 64) == st::crc32c(std::span<const std::byte>(b).subspan(32, 32)));
  // Trailer.
  CHECK(std::memcmp(b.data() + b.size() - 16, "STELLEND", 8) == 0);
  CHECK(le64(b, b.size() - 8) == b.size());
}

TEST_CASE("every truncation and every corrupted byte of a saved state is refused",
          "[saved_state]") {
  const sample s;
  const auto good = saved(s);
  for (std::size_t n = 0; n < good.size(); ++n) {
    const std::span<const std::byte> cut(good.data(), n);
    INFO("truncated to " << n << " bytes");
    CHECK(code_of([&] { (void)sample::read(cut); }) == errc::malformed_message);
  }
  auto longer = good;
  longer.push_back(std::byte{0});
  CHECK(code_of([&] { (void)sample::read(longer); }) == errc::malformed_message);

  std::set<st::errc> seen;
  for (std::size_t at = 0; at < good.size(); ++at) {
    for (const unsigned flip : {0x01u, 0x80u}) {
      auto bad = good;
      bad[at] ^= static_cast<std::byte>(flip);
      INFO("byte " << at << " ^ " << flip);
      const st::errc c = code_of([&] { (void)sample::read(bad); });
      CHECK((c == errc::malformed_message || c == errc::checksum_mismatch ||
             c == errc::version_mismatch));
      seen.insert(c);
    }
  }
  CHECK(seen.count(errc::checksum_mismatch) == 1);
  CHECK(seen.count(errc::malformed_message) == 1);
  CHECK(seen.count(errc::version_mismatch) == 1);
}

TEST_CASE("a saved state of another kind or version is refused", "[saved_state]") {
  const sample s;
  const auto bytes = saved(s);
  CHECK(code_of([&] { st::state_reader(bytes, st::state_kind::of("STELLOTH", 3), "x"); }) ==
        errc::malformed_message);
  CHECK(code_of([&] { st::state_reader(bytes, st::state_kind::of("STELLTST", 4), "x"); }) ==
        errc::version_mismatch);
  CHECK(code_of([] { (void)st::state_kind::of("SHORT", 1); }) == errc::invalid_argument);
}

TEST_CASE("reading records out of order, past their end or leaving some is refused",
          "[saved_state]") {
  const sample s;
  const auto bytes = saved(s);
  {
    st::state_reader rd(bytes, kind, "x");
    CHECK(rd.next_tag() == "CONF");
    CHECK(code_of([&] { (void)rd.next("VALS"); }) == errc::malformed_message);
  }
  {
    st::state_reader rd(bytes, kind, "x");
    auto conf = rd.next("CONF");
    (void)conf.get<std::uint32_t>();
    CHECK(code_of([&] { conf.finish(); }) == errc::malformed_message);
    (void)conf.get<double>();
    (void)conf.get<std::uint32_t>();
    conf.finish();
    CHECK(code_of([&] { (void)conf.get<std::uint8_t>(); }) == errc::malformed_message);
    CHECK(code_of([&] { rd.finish(); }) == errc::malformed_message);
    (void)rd.next("VALS");
    (void)rd.next("NONE");
    (void)rd.next("STEP");
    CHECK(rd.remaining() == 0);
    CHECK(rd.next_tag().empty());
    CHECK(code_of([&] { (void)rd.next("MORE"); }) == errc::malformed_message);
    rd.finish();
  }
}

TEST_CASE("a writer whose passes disagree or whose tag is not 4 characters is refused",
          "[saved_state]") {
  int pass = 0;
  CHECK(code_of([&] {
          (void)st::save_state_bytes(kind, [&](st::state_writer& w) {
            ++pass;
            w.record("DATA", [&](auto& r) {
              r.put(std::uint32_t{1});
              if (pass == 2) r.put(std::uint8_t{2});
            });
          });
        }) == errc::invalid_argument);
  pass = 0;
  CHECK(code_of([&] {
          (void)st::save_state_bytes(kind, [&](st::state_writer& w) {
            ++pass;
            if (pass == 1) w.record("DATA", [](auto&) {});
          });
        }) == errc::invalid_argument);
  CHECK(code_of([&] {
          (void)st::save_state_bytes(
              kind, [&](st::state_writer& w) { w.record("TOOLONG", [](auto&) {}); });
        }) == errc::invalid_argument);
}
