// SPDX-License-Identifier: Apache-2.0
// The step-reports control section: its payload round-trips exactly, a payload that breaks the
// documented layout is refused with the reason, and the book turns all ranks' reports of a step
// into one observation (the fastest exchange, the slowest compute), in step order.
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pipeline/step_reports.hpp>

#include "catch.hpp"

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using namespace stellatrain;

namespace {

std::vector<std::byte> payload_of(const std::vector<rank_report>& reports) {
  std::vector<std::byte> out(step_reports_bytes(reports.size()));
  write_step_reports(reports, out);
  return out;
}

void expect_refused(const std::vector<std::byte>& payload, std::int64_t message_step,
                    const std::string& part) {
  std::array<rank_report, step_reports_layout::max_reports> out{};
  try {
    read_step_reports(payload, message_step, out, "rank 2");
  } catch (const error& e) {
    INFO("what(): " << e.what());
    CHECK(e.code() == errc::malformed_message);
    CHECK(std::string(e.what()).find("rank 2: step reports: " + part) != std::string::npos);
    return;
  }
  FAIL("accepted (expected: " << part << ")");
}

template <class T>
void put(std::vector<std::byte>& m, std::size_t offset, T value) {
  detail::store_le(m.data() + offset, value);
}

}  // namespace

TEST_CASE("step reports: the payload carries every field exactly, in a control section",
          "[pipeline][reports]") {
  const std::vector<rank_report> reports = {{.step = 41,
                                             .exchange_seconds = 0.125,
                                             .compute_seconds = 1.0 / 3.0,
                                             .link_bytes = 123456789012ull,
                                             .bytes_per_element = 3.14,
                                             .latency_rounds = 2},
                                            {.step = 42,
                                             .exchange_seconds = 0,
                                             .compute_seconds = 7e-9,
                                             .link_bytes = 0,
                                             .bytes_per_element = 0},
                                            {.step = std::int64_t{1} << 40,
                                             .exchange_seconds = 1e300,
                                             .compute_seconds = 2.5,
                                             .link_bytes = ~0ull,
                                             .bytes_per_element = 5.0,
                                             .latency_rounds = 0.5}};
  const auto payload = payload_of(reports);
  REQUIRE(payload.size() == 8 + 3 * 48);
  CHECK(detail::load_le<std::uint16_t>(payload.data()) == 2);
  CHECK(detail::load_le<std::uint16_t>(payload.data() + 2) == 3);
  CHECK(detail::load_le<std::uint64_t>(payload.data() + 8) == 41);
  CHECK(detail::load_le<std::uint64_t>(payload.data() + 16) == std::bit_cast<std::uint64_t>(0.125));

  // Through a message: the receiver finds the section by its type and reads the same values.
  inline_executor ex;
  message_packer packer;
  packer.clear((std::uint64_t{1} << 40) + 1);
  packer.add_control(control_type::step_reports, payload);
  std::vector<std::byte> wire(packer.prepare(ex));
  packer.write(wire, ex);
  message_unpacker unpacker;
  const auto& info = unpacker.parse(wire, ex);
  const std::size_t c = unpacker.find_control(control_type::step_reports);
  REQUIRE(c == 0);
  std::array<rank_report, step_reports_layout::max_reports> out{};
  const auto step = static_cast<std::int64_t>(info.tag);
  REQUIRE(read_step_reports(info.controls[c].payload, step, out, "rank 0") == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(out[i].step == reports[i].step);
    CHECK(std::bit_cast<std::uint64_t>(out[i].exchange_seconds) ==
          std::bit_cast<std::uint64_t>(reports[i].exchange_seconds));
    CHECK(std::bit_cast<std::uint64_t>(out[i].compute_seconds) ==
          std::bit_cast<std::uint64_t>(reports[i].compute_seconds));
    CHECK(out[i].link_bytes == reports[i].link_bytes);
    CHECK(out[i].bytes_per_element == reports[i].bytes_per_element);
    CHECK(out[i].latency_rounds == reports[i].latency_rounds);
  }
}

TEST_CASE("step reports: a payload that breaks the layout is refused with the reason",
          "[pipeline][reports]") {
  const auto good = payload_of({{.step = 5,
                                 .exchange_seconds = 0.1,
                                 .compute_seconds = 0.2,
                                 .link_bytes = 100,
                                 .bytes_per_element = 3.0},
                                {.step = 6,
                                 .exchange_seconds = 0.1,
                                 .compute_seconds = 0.2,
                                 .link_bytes = 100,
                                 .bytes_per_element = 3.0}});
  std::array<rank_report, step_reports_layout::max_reports> out{};
  REQUIRE(read_step_reports(good, 7, out, "rank 2") == 2);

  expect_refused(std::vector<std::byte>(good.begin(), good.begin() + 7), 7, "7 bytes, no header");
  expect_refused(std::vector<std::byte>(good.begin(), good.end() - 1), 7,
                 "103 bytes for 2 reports");
  auto longer = good;
  longer.push_back(std::byte{0});
  expect_refused(longer, 7, "105 bytes for 2 reports");
  auto m = good;
  put<std::uint16_t>(m, 0, 1);
  expect_refused(m, 7, "layout version 1");
  m = good;
  put<std::uint32_t>(m, 4, 1);
  expect_refused(m, 7, "reserved bytes are not zero");
  m = good;
  put<std::uint16_t>(m, 2, 0);
  expect_refused(m, 7, "0 reports");
  m = good;
  put<std::uint16_t>(m, 2, 9);
  expect_refused(m, 7, "9 reports");
  // Steps: before the message's own, ascending.
  expect_refused(good, 6, "report of step 6 in a message of step 6 after step 5");
  expect_refused(good, 0, "report of step 5 in a message of step 0");
  m = good;
  put<std::uint64_t>(m, 56, 5);
  expect_refused(m, 7, "report of step 5 in a message of step 7 after step 5");
  m = good;
  put<std::uint64_t>(m, 8, ~0ull);  // step -1 as a signed number
  expect_refused(m, 7, "report of step 18446744073709551615");
  // Times and sizes per element: finite and not negative.
  const double bad_values[] = {-1.0, std::numeric_limits<double>::quiet_NaN(),
                               std::numeric_limits<double>::infinity()};
  const std::pair<std::size_t, const char*> fields[] = {{16, "exchange seconds"},
                                                        {24, "compute seconds"},
                                                        {40, "bytes per element"},
                                                        {48, "latency rounds"}};
  for (const auto& [offset, name] : fields) {
    for (double v : bad_values) {
      m = good;
      put<std::uint64_t>(m, offset, std::bit_cast<std::uint64_t>(v));
      expect_refused(m, 7, name);
    }
  }
  // The writer refuses what the layout cannot hold.
  std::vector<std::byte> room(step_reports_bytes(9));
  CHECK_THROWS_AS(write_step_reports(std::vector<rank_report>(9), room), error);
  CHECK_THROWS_AS(write_step_reports(std::vector<rank_report>{}, room), error);
  CHECK_THROWS_AS(
      write_step_reports(std::vector<rank_report>(2), std::span<std::byte>(room).first(103)),
      error);
}

TEST_CASE(
    "step reports: every step is observed once, in order, with the mean span less the slowest "
    "compute",
    "[pipeline][reports]") {
  detail::step_report_book book;
  book.start(3, 0);
  std::vector<rank_report> seen;
  auto observe = [&](const rank_report& r) { seen.push_back(r); };
  auto report = [](std::int64_t step, double exchange, double compute, std::uint64_t bytes) {
    return rank_report{.step = step,
                       .exchange_seconds = exchange,
                       .compute_seconds = compute,
                       .link_bytes = bytes,
                       .bytes_per_element = static_cast<double>(bytes) / 100.0};
  };
  // Ranks report steps 0 and 1 at different times; step 0 is complete after the third rank.
  const std::vector<rank_report> r0 = {report(0, 0.30, 0.10, 300), report(1, 0.20, 0.10, 300)};
  const std::vector<rank_report> r1 = {report(0, 0.25, 0.40, 250)};
  const std::vector<rank_report> r2 = {report(0, 0.35, 0.20, 350), report(1, 0.50, 0.30, 500)};
  book.take(0, r0, observe);
  book.take(1, r1, observe);
  CHECK(seen.empty());
  book.take(2, r2, observe);
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].step == 0);
  // Spans (exchange + compute) 0.40, 0.65, 0.55: their mean less the slowest compute.
  CHECK(seen[0].exchange_seconds == Approx(1.6 / 3 - 0.40));
  CHECK(seen[0].link_bytes == 300);  // the means of link bytes and bytes per element
  CHECK(seen[0].bytes_per_element == Approx(3.0));
  CHECK(seen[0].compute_seconds == 0.40);  // the slowest rank's
  // Reports repeat across messages: a step is observed once.
  book.take(0, r0, observe);
  CHECK(seen.size() == 1);
  const std::vector<rank_report> r1b = {report(1, 0.60, 0.05, 600)};
  book.take(1, r1b, observe);
  REQUIRE(seen.size() == 2);
  CHECK(seen[1].step == 1);
  CHECK(seen[1].exchange_seconds == Approx((0.30 + 0.65 + 0.80) / 3 - 0.30));
  CHECK(seen[1].link_bytes == 467);
  CHECK(seen[1].compute_seconds == 0.30);

  // A rank that raced 8 steps ahead overwrote its report of step 2: the step is skipped.
  std::vector<rank_report> ahead;
  for (std::int64_t s = 2; s <= 10; ++s) ahead.push_back(report(s, 0.1, 0.1, 100));
  book.take(0, std::span<const rank_report>(ahead).first(8), observe);
  book.take(0, std::span<const rank_report>(ahead).subspan(8), observe);  // step 10 replaces 2
  const std::vector<rank_report> late = {report(2, 0.1, 0.1, 100), report(3, 0.1, 0.1, 100)};
  book.take(1, late, observe);
  book.take(2, late, observe);
  REQUIRE(seen.size() == 3);
  CHECK(seen[2].step == 3);

  // Own reports: the latest three, oldest first; none before the first step completes.
  std::vector<std::byte> scratch;
  detail::step_report_book mine;
  mine.start(1, 0);
  CHECK(mine.own_payload(scratch).empty());
  for (std::int64_t s = 0; s < 5; ++s) mine.add_own(report(s, 0.1, 0.2, 10));
  const auto payload = mine.own_payload(scratch);
  std::array<rank_report, step_reports_layout::max_reports> out{};
  REQUIRE(read_step_reports(payload, 5, out, "own") == 3);
  CHECK(out[0].step == 2);
  CHECK(out[2].step == 4);
  // A restart at step 5 forgets everything before it.
  mine.start(1, 5);
  CHECK(mine.own_payload(scratch).empty());
  std::vector<rank_report> after;
  mine.take(0, std::span<const rank_report>(out.data(), 3),
            [&](const rank_report& r) { after.push_back(r); });
  CHECK(after.empty());
}

TEST_CASE(
    "step reports: ranks whose exchanges start apart observe the step's period, not the "
    "shortest exchange",
    "[pipeline][reports]") {
  // Staleness 0, a step of 40 ms: every rank computes, then waits on the exchange until the
  // step ends. Over a ring the ranks start apart (offsets that sum to zero), so one rank's
  // exchange runs 25 ms short and another's 10 ms long; the exchange the step exposes beyond
  // its slowest compute is 40 - 6 = 34 ms all the same.
  constexpr double period = 0.040;
  const std::array<double, 4> compute = {0.003, 0.005, 0.004, 0.006};
  const std::array<double, 4> offset = {0.010, -0.025, 0.005, 0.010};
  detail::step_report_book book;
  book.start(4, 7);
  std::vector<rank_report> seen;
  for (int r = 0; r < 4; ++r) {
    const auto i = static_cast<std::size_t>(r);
    const std::vector<rank_report> mine = {{.step = 7,
                                            .exchange_seconds = period - compute[i] + offset[i],
                                            .compute_seconds = compute[i],
                                            .link_bytes = 1000,
                                            .latency_rounds = 3}};
    book.take(r, mine, [&](const rank_report& agg) { seen.push_back(agg); });
  }
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].exchange_seconds == Approx(period - 0.006));
  CHECK(seen[0].compute_seconds == 0.006);
  CHECK(seen[0].latency_rounds == 3);
  CHECK(seen[0].link_bytes == 1000);

  // Reports whose spans fall short of the slowest compute give 0, not a negative time.
  detail::step_report_book short_book;
  short_book.start(2, 0);
  seen.clear();
  const std::vector<rank_report> quick = {
      {.step = 0, .exchange_seconds = 0, .compute_seconds = 0.001}};
  const std::vector<rank_report> slow = {
      {.step = 0, .exchange_seconds = 0, .compute_seconds = 0.009}};
  short_book.take(0, quick, [&](const rank_report& agg) { seen.push_back(agg); });
  short_book.take(1, slow, [&](const rank_report& agg) { seen.push_back(agg); });
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].exchange_seconds == 0);
}
