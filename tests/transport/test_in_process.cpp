// SPDX-License-Identifier: Apache-2.0
// The in-process backend: matching, ordering, sizes, cancellation, closed peers, aborts.
#include "catch.hpp"
#include "scenarios.hpp"

#include <stellatrain/stellatrain.hpp>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

using namespace stellatrain;
using namespace std::chrono_literals;

namespace {
errc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const error& e) {
    return static_cast<errc>(e.code().value());
  }
  return errc{};
}
}  // namespace

TEST_CASE("in_process: send before and after the receive is posted", "[transport][in_process]") {
  in_process_world world(2);
  auto a = world.transport(0);
  auto b = world.transport(1);
  CHECK(a.rank() == 0);
  CHECK(b.size() == 2);
  const auto msg = test::message_of(0, 1000, 1);
  // Send first: the send stays pending until the receiver copies.
  auto s = a.isend(1, 5, msg);
  CHECK_FALSE(s.test());
  std::vector<std::byte> got(1000);
  auto r = b.irecv(0, 5, std::span<std::byte>(got));
  CHECK(r.test());
  CHECK(s.test());
  CHECK(got == msg);
  // Receive first: completes when the send arrives.
  message_buffer m;
  auto r2 = b.irecv(0, 6, m);
  CHECK_FALSE(r2.test());
  auto s2 = a.isend(1, 6, msg);
  CHECK(r2.wait_until(deadline_after(1s)));
  CHECK(s2.test());
  test::expect_message(m.span(), 0, 1000, 1, "variable receive");
  // Empty messages.
  auto s3 = a.isend(1, 7, std::span<const std::byte>{});
  auto r3 = b.irecv(0, 7, m);
  CHECK(r3.wait_until(deadline_after(1s)));
  CHECK(m.empty());
  CHECK(s3.test());
}

TEST_CASE("in_process: ordering per source and tag, independence across tags",
          "[transport][in_process]") {
  run_in_process(3, [](in_process_transport& t) { test::p2p_case(t, 42, 10); });
  run_in_process(1, [](in_process_transport& t) { test::p2p_case(t, 43, 10); });  // to itself
}

TEST_CASE("in_process: a receive of the wrong size fails on both sides",
          "[transport][in_process]") {
  in_process_world world(2);
  auto a = world.transport(0);
  auto b = world.transport(1);
  const auto msg = test::message_of(0, 100, 1);
  auto s = a.isend(1, 1, msg);
  std::vector<std::byte> small(99);
  auto r = b.irecv(0, 1, std::span<std::byte>(small));
  try {
    r.test();
    FAIL("no error");
  } catch (const error& e) {
    CHECK(e.code() == errc::size_mismatch);
    const std::string what = e.what();
    CHECK(what.find("99") != std::string::npos);
    CHECK(what.find("100") != std::string::npos);
  }
  CHECK(code_of([&] { r.test(); }) == errc::size_mismatch);  // sticky
  CHECK(code_of([&] { s.test(); }) == errc::size_mismatch);
  // The pair still works for later messages.
  auto s2 = a.isend(1, 1, msg);
  std::vector<std::byte> ok(100);
  auto r2 = b.irecv(0, 1, std::span<std::byte>(ok));
  CHECK(r2.test());
  CHECK(s2.test());
}

TEST_CASE("in_process: dropping pending requests withdraws them", "[transport][in_process]") {
  in_process_world world(2);
  auto a = world.transport(0);
  auto b = world.transport(1);
  const auto dropped = test::message_of(0, 10, 1);
  {
    auto s = a.isend(1, 3, dropped);  // dropped before anyone receives it: withdrawn
    (void)s;
  }
  {
    std::vector<std::byte> never(10);
    auto r = b.irecv(0, 4, std::span<std::byte>(never));
    (void)r;
  }
  const auto msg = test::message_of(0, 10, 2);
  auto s = a.isend(1, 4, msg);
  auto s3 = a.isend(1, 3, msg);
  std::vector<std::byte> got(10);
  auto r = b.irecv(0, 3, std::span<std::byte>(got));
  CHECK(r.test());
  CHECK(got == msg);  // the withdrawn message on tag 3 was never delivered
  std::vector<std::byte> got4(10);
  auto r4 = b.irecv(0, 4, std::span<std::byte>(got4));
  CHECK(r4.test());
  CHECK(got4 == msg);
  CHECK(s.test());
  CHECK(s3.test());
  // Moving a request keeps it; move-assigning over a pending one cancels the old one.
  std::vector<std::byte> x(1);
  auto p1 = b.irecv(0, 9, std::span<std::byte>(x));
  in_process_request moved = std::move(p1);
  CHECK(p1.test());  // moved-from: empty, complete
  CHECK_FALSE(moved.test());
  moved = in_process_request{};
  const std::byte one[1] = {std::byte{1}};
  auto s9 = a.isend(1, 9, one);
  CHECK_FALSE(s9.test());  // nobody receives it any more
}

TEST_CASE("in_process: a closed rank fails receives from it and sends to it",
          "[transport][in_process]") {
  in_process_world world(3);
  auto a = world.transport(0);
  auto c = world.transport(2);
  std::vector<std::byte> buf(10);
  auto pending = a.irecv(1, 1, std::span<std::byte>(buf));
  const auto msg = test::message_of(1, 10, 1);
  {
    auto b = world.transport(1);
    auto queued = b.isend(2, 2, msg);
    CHECK_FALSE(queued.test());
    auto r = c.irecv(1, 2, std::span<std::byte>(buf));  // receives it before b closes
    CHECK(r.test());
    CHECK(queued.test());
  }
  CHECK(code_of([&] { pending.test(); }) == errc::peer_failure);
  auto late = a.irecv(1, 1, std::span<std::byte>(buf));
  CHECK(code_of([&] { late.test(); }) == errc::peer_failure);
  auto to_closed = a.isend(1, 1, msg);
  CHECK(code_of([&] { to_closed.test(); }) == errc::peer_failure);
  CHECK_THROWS_AS(world.transport(1), error);  // taken once
  CHECK_THROWS_AS(world.transport(3), error);
  CHECK_THROWS_AS(a.isend(5, 0, msg), error);
}

TEST_CASE("in_process: abort wakes every waiter with peer_failure", "[transport][in_process]") {
  in_process_world world(3);
  auto a = world.transport(0);
  auto b = world.transport(1);
  std::vector<std::byte> buf(10);
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    auto r = a.irecv(2, 1, std::span<std::byte>(buf));
    const auto t0 = transport_clock::now();
    CHECK(code_of([&] { r.wait_until(deadline_after(10s)); }) == errc::peer_failure);
    CHECK(transport_clock::now() - t0 < 5s);
    woke = true;
  });
  std::this_thread::sleep_for(50ms);
  b.abort("test reason");
  waiter.join();
  CHECK(woke);
  CHECK(world.failed());
  try {
    (void)a.isend(1, 0, buf);
    FAIL("no error");
  } catch (const error& e) {
    CHECK(e.code() == errc::peer_failure);
    CHECK(std::string(e.what()).find("test reason") != std::string::npos);
    CHECK(std::string(e.what()).find("rank 1") != std::string::npos);
  }
}

TEST_CASE("in_process: many threads per rank exchanging on many tags", "[transport][in_process]") {
  constexpr int ranks = 4;
  constexpr int threads = 3;
  constexpr int rounds = 50;
  run_in_process(ranks, [&](in_process_transport& t) {
    std::vector<std::thread> pool;
    std::atomic<int> failures{0};
    for (int k = 0; k < threads; ++k) {
      pool.emplace_back([&, k] {
        try {
          for (int round = 0; round < rounds; ++round) {
            const tag_type tag = static_cast<tag_type>(1000 + k);
            const int dest = (t.rank() + 1 + round % (ranks - 1)) % ranks;
            const int src = (t.rank() + ranks - 1 - round % (ranks - 1)) % ranks;
            const std::size_t n = static_cast<std::size_t>(1 + (round * 131) % 5000);
            const auto msg =
                test::message_of(t.rank(), n, static_cast<std::uint64_t>(round * 10 + k));
            auto s = t.isend(dest, tag, msg);
            message_buffer m;
            auto r = t.irecv(src, tag, m);
            wait_or_throw(r, 10s, "stress receive");
            test::expect_message(m.span(), src, n, static_cast<std::uint64_t>(round * 10 + k),
                                 "stress");
            wait_or_throw(s, 10s, "stress send");
          }
        } catch (...) {
          ++failures;
        }
      });
    }
    for (auto& th : pool) th.join();
    if (failures != 0)
      throw test::scenario_failure("stress: " + std::to_string(failures.load()) +
                                   " threads failed");
  });
}
