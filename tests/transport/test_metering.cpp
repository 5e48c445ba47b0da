// SPDX-License-Identifier: Apache-2.0
// The metering decorator: bytes and messages per peer, busy time and achieved rates.
#include "catch.hpp"
#include "scenarios.hpp"

#include <stellatrain/stellatrain.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

using namespace stellatrain;
using namespace std::chrono_literals;

TEST_CASE("metering: counts bytes and messages per peer", "[transport][metering]") {
  std::mutex m;
  std::vector<traffic_snapshot> snaps(4);
  std::atomic<int> callbacks{0};
  run_in_process(4, [&](in_process_transport& raw) {
    metered_transport t(std::move(raw), {.on_transfer = [&](const transfer_record& rec) {
                          if (rec.completed >= rec.posted) ++callbacks;
                        }});
    // Direct all-gather on a transport with variable-length receives: each rank sends its
    // message, and nothing else, to every peer.
    const std::size_t mine = 1000 + 100 * static_cast<std::size_t>(t.rank());
    test::allgather_case(
        t, [](int r) { return 1000 + 100 * static_cast<std::size_t>(r); },
        {.algorithm = allgather_algorithm::direct}, 1);
    auto s = t.snapshot();
    std::lock_guard lock(m);
    snaps[static_cast<std::size_t>(t.rank())] = s;
    CHECK(s.peers.size() == 4);
    (void)mine;
  });
  for (int r = 0; r < 4; ++r) {
    const auto& s = snaps[static_cast<std::size_t>(r)];
    for (int q = 0; q < 4; ++q) {
      const auto& pt = s.peers[static_cast<std::size_t>(q)];
      if (q == r) {
        CHECK(pt.messages_sent == 0);
        CHECK(pt.messages_received == 0);
        continue;
      }
      CHECK(pt.messages_sent == 1);
      CHECK(pt.messages_received == 1);
      CHECK(pt.bytes_sent == 1000 + 100 * static_cast<std::uint64_t>(r));
      CHECK(pt.bytes_received == 1000 + 100 * static_cast<std::uint64_t>(q));
    }
    CHECK(s.total.messages_sent == 3);
    CHECK(s.total.bytes_received ==
          3 * 1000 + 100 * (0 + 1 + 2 + 3 - static_cast<std::uint64_t>(r)));
    CHECK(s.send_busy > 0ns);
    CHECK(s.send_busy <= s.elapsed);
  }
  CHECK(callbacks == 4 * 6);
}

// One transfer of 1 MiB in four sends over a 50 Mbit/s shaped link; returns the rate the
// sender's meter reports.
static double metered_rate_of_one_transfer() {
  double rate = 0;
  run_in_process(2, [&](in_process_transport& raw) {
    metered_transport t(
        shaped_transport(std::move(raw), {.bits_per_second = 50e6, .burst_bytes = 0}));
    const std::size_t n = std::size_t{1} << 20;
    barrier(t);
    t.reset();
    if (t.rank() == 0) {
      const auto data = test::message_of(0, n, 1);
      std::vector<metered_request<shaped_transport<in_process_transport>>> sends;
      for (int i = 0; i < 4; ++i)
        sends.push_back(t.isend(1, 1,
                                std::span<const std::byte>(data).subspan(
                                    static_cast<std::size_t>(i) * (n / 4), n / 4)));
      for (auto& s : sends) wait_or_throw(s, 10s, "send");
      const auto snap = t.snapshot();
      rate = snap.send_bits_per_second();
      CHECK(snap.total.bytes_sent == n);
      CHECK(snap.peers[1].messages_sent == 4);
    } else {
      std::vector<std::byte> got(n);
      auto r = t.irecv(0, 1, std::span<std::byte>(got).first(n / 4));
      wait_or_throw(r, 10s, "receive");
      message_buffer rest;
      for (int i = 1; i < 4; ++i) {
        auto r2 = t.irecv(0, 1, rest);
        wait_or_throw(r2, 10s, "receive");
        CHECK(rest.size() == n / 4);
      }
      CHECK(t.snapshot().total.bytes_received == n);
    }
  });
  return rate;
}

TEST_CASE("metering: achieved rate over a shaped link matches the shaping",
          "[transport][metering]") {
  // A stalled thread (other tests share the two cores, sanitizers slow every step) can only
  // lower the achieved rate, never raise it past the shaping: every attempt must stay under
  // the upper bound, and the best of up to three must reach the lower one.
  double best = 0;
  for (int attempt = 0; attempt < 3 && best < 50e6 * 0.95; ++attempt) {
    const double rate = metered_rate_of_one_transfer();
    CAPTURE(attempt, rate);
    CHECK(rate <= 50e6 * 1.05);
    best = std::max(best, rate);
  }
  CAPTURE(best);
  CHECK(best >= 50e6 * 0.95);
}

TEST_CASE("metering: failed and cancelled operations are not counted", "[transport][metering]") {
  in_process_world world(2);
  metered_transport a(world.transport(0));
  metered_transport b(world.transport(1));
  {
    std::vector<std::byte> buf(10);
    auto r = b.irecv(0, 1, std::span<std::byte>(buf));
    (void)r;
  }
  const std::vector<std::byte> msg(10);
  auto s = a.isend(1, 2, msg);
  std::vector<std::byte> wrong(9);
  auto r = b.irecv(0, 2, std::span<std::byte>(wrong));
  CHECK_THROWS_AS(r.test(), error);
  CHECK_THROWS_AS(s.test(), error);
  CHECK(a.snapshot().total.messages_sent == 0);
  CHECK(b.snapshot().total.messages_received == 0);
}
