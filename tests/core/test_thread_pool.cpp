// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include "catch.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <latch>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

using namespace stellatrain;

namespace {
struct no_concurrency {
  template <class F>
  void bulk(std::size_t n, F&& f) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }
};
struct no_bulk {
  std::size_t concurrency() const noexcept { return 1; }
};
}  // namespace

TEST_CASE("executor concept accepts the shipped executors and rejects archetypes", "[executor]") {
  STATIC_REQUIRE(executor<inline_executor>);
  STATIC_REQUIRE(executor<thread_pool>);
  STATIC_REQUIRE_FALSE(executor<no_concurrency>);
  STATIC_REQUIRE_FALSE(executor<no_bulk>);
  STATIC_REQUIRE_FALSE(executor<int>);
}

TEST_CASE("bulk calls every index exactly once", "[thread_pool]") {
  const std::size_t threads = GENERATE(1, 2, 3, 8);
  thread_pool pool{threads};
  CHECK(pool.concurrency() == threads);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, threads - 1, threads, threads + 1,
                        std::size_t{1000}, std::size_t{100003}}) {
    std::vector<std::atomic<int>> hits(n);
    pool.bulk(n, [&](std::size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
    for (std::size_t i = 0; i < n; ++i) REQUIRE(hits[i].load() == 1);
  }
}

TEST_CASE("bulk runs calls on several threads", "[thread_pool]") {
  thread_pool pool{4};
  std::mutex m;
  std::set<std::thread::id> ids;
  std::atomic<int> arrived{0};
  pool.bulk(4, [&](std::size_t) {
    {
      std::lock_guard lock(m);
      ids.insert(std::this_thread::get_id());
    }
    // Hold every call until all four have started: only possible if they run concurrently.
    arrived.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < 4 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
  });
  CHECK(arrived.load() == 4);
  CHECK(ids.size() == 4);
}

TEST_CASE("bulk rethrows the first exception and skips later calls", "[thread_pool]") {
  // One thread: the calls run in index order on the caller, so the skip is deterministic.
  {
    thread_pool pool{1};
    std::size_t calls = 0;
    CHECK_THROWS_AS(pool.bulk(1000,
                              [&](std::size_t i) {
                                ++calls;
                                if (i == 10) throw std::runtime_error("boom at 10");
                              }),
                    std::runtime_error);
    CHECK(calls == 11);
  }
  // Two threads: the exception reaches the caller whichever thread threw it. How many calls
  // the other thread starts before it sees the failure depends on scheduling (an unwinding
  // under a sanitizer can take longer than the whole bulk), so only the bound is checked.
  thread_pool pool{2};
  for (std::size_t thrower : {std::size_t{0}, std::size_t{1}, std::size_t{5000}}) {
    std::atomic<std::size_t> calls{0};
    CHECK_THROWS_WITH(pool.bulk(10000,
                                [&](std::size_t i) {
                                  calls.fetch_add(1);
                                  if (i == thrower) throw std::runtime_error("boom");
                                }),
                      "boom");
    CHECK(calls.load() >= 1);
    CHECK(calls.load() <= 10000);
  }
  // The pool stays usable.
  std::atomic<int> sum{0};
  pool.bulk(10, [&](std::size_t i) { sum += static_cast<int>(i); });
  CHECK(sum.load() == 45);
}

TEST_CASE("nested and concurrent bulk calls complete", "[thread_pool]") {
  thread_pool pool{2};
  std::atomic<std::uint64_t> total{0};
  pool.bulk(8, [&](std::size_t) { pool.bulk(100, [&](std::size_t j) { total.fetch_add(j); }); });
  CHECK(total.load() == 8 * 4950);

  std::atomic<std::uint64_t> total2{0};
  std::vector<std::jthread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) pool.bulk(64, [&](std::size_t j) { total2.fetch_add(j); });
    });
  }
  callers.clear();
  CHECK(total2.load() == std::uint64_t{4} * 50 * (63 * 64 / 2));
}

TEST_CASE("submit returns results and exceptions through futures", "[thread_pool]") {
  thread_pool pool{2};
  auto a = pool.submit([] { return 6 * 7; });
  auto b = pool.submit([]() -> int { throw std::logic_error("no"); });
  auto c = pool.submit([] {});
  CHECK(a.get() == 42);
  CHECK_THROWS_AS(b.get(), std::logic_error);
  c.get();
}

TEST_CASE("tasks that wait for each other run while workers poll or sleep", "[thread_pool]") {
  // After a bulk call one worker polls for work and the other sleeps. Two tasks submitted
  // back to back, the first blocking until the second has run, need both workers: a pool that
  // let the polling worker take the second task's wake-up as well would hang here. Also with
  // a stay_awake guard held throughout (workers poll after every task).
  using namespace std::chrono_literals;
  for (const auto& [spin, awake] : {std::pair{0us, false}, std::pair{50us, false},
                                    std::pair{20000us, false}, std::pair{0us, true}}) {
    CAPTURE(spin.count(), awake);
    thread_pool pool{2, spin};
    CHECK(pool.spin() == spin);
    thread_pool::awake_guard guard;
    if (awake) guard = pool.stay_awake();
    bool all_ran = true;
    for (int i = 0; i < 300 && all_ran; ++i) {
      std::atomic<int> sum{0};
      pool.bulk(2, [&](std::size_t k) { sum.fetch_add(static_cast<int>(k) + 1); });
      REQUIRE(sum.load() == 3);
      auto second_ran = std::make_shared<std::promise<void>>();  // outlives a failed iteration
      auto gate = second_ran->get_future().share();
      auto first = pool.submit([gate] { return gate.wait_for(5s) == std::future_status::ready; });
      auto second = pool.submit([second_ran] { second_ran->set_value(); });
      all_ran = first.wait_for(10s) == std::future_status::ready && first.get();
      if (all_ran) second.get();
    }
    CHECK(all_ran);
  }
}

TEST_CASE("at most threads() - 1 workers poll at once", "[thread_pool]") {
  // Three tasks that wait for each other take all three workers. Afterwards each worker would
  // poll for `spin`, but a bulk call takes at most two helpers, so the third sleeps: a third
  // poller would only take a core from the bulk caller or a helper.
  using namespace std::chrono_literals;
  thread_pool pool{3, 3s};
  CHECK(pool.polling_workers() == 0);
  std::latch started{3};
  std::vector<std::future<void>> tasks;
  for (int i = 0; i < 3; ++i)
    tasks.push_back(pool.submit([&started] { started.arrive_and_wait(); }));
  for (auto& t : tasks) t.get();
  // Watch until two workers have polled for 100 ms (or 2 s have passed).
  std::size_t most = 0;
  const auto start = std::chrono::steady_clock::now();
  auto seen_two = start + 2s;
  for (auto now = start; now < std::min(start + 2s, seen_two + 100ms);
       now = std::chrono::steady_clock::now()) {
    const std::size_t polling = pool.polling_workers();
    if (polling >= 2 && most < 2) seen_two = now;
    most = std::max(most, polling);
    std::this_thread::yield();
  }
  CHECK(most == 2);
  // The pollers still take new work: a bulk call runs on the caller and two helpers.
  std::atomic<int> ran{0};
  pool.bulk(3, [&](std::size_t) { ran.fetch_add(1); });
  CHECK(ran.load() == 3);
}

TEST_CASE("a pool of one polls with its only worker", "[thread_pool]") {
  using namespace std::chrono_literals;
  thread_pool pool{1, 3s};
  pool.submit([] {}).get();
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (pool.polling_workers() == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::yield();
  CHECK(pool.polling_workers() == 1);
}

TEST_CASE("a pool does not poll unless asked; a negative spin is taken as none", "[thread_pool]") {
  CHECK(thread_pool{1}.spin().count() == 0);
  thread_pool pool{1, std::chrono::microseconds{-5}};
  CHECK(pool.spin().count() == 0);
  std::atomic<int> ran{0};
  pool.bulk(4, [&](std::size_t) { ran.fetch_add(1); });
  CHECK(ran.load() == 4);
}

TEST_CASE("stay_awake guards count, move and release; bulk stays correct under them",
          "[thread_pool]") {
  thread_pool pool{1};  // one worker fits any machine, so its guards are active
  CHECK(pool.awake_guards() == 0);
  {
    auto a = pool.stay_awake();
    CHECK(a.active());
    CHECK(pool.awake_guards() == 1);
    auto b = std::move(a);
    CHECK_FALSE(a.active());
    CHECK(b.active());
    CHECK(pool.awake_guards() == 1);
    thread_pool::awake_guard c;
    CHECK_FALSE(c.active());
    c = pool.stay_awake();
    CHECK(pool.awake_guards() == 2);
    c = std::move(b);  // releases c's own guard, takes b's
    CHECK(pool.awake_guards() == 1);
    for (int r = 0; r < 200; ++r) {
      std::atomic<int> sum{0};
      pool.bulk(5, [&](std::size_t i) { sum.fetch_add(static_cast<int>(i)); });
      REQUIRE(sum.load() == 10);
    }
    CHECK(pool.submit([] { return 7; }).get() == 7);
  }
  CHECK(pool.awake_guards() == 0);

  // Guards taken and dropped from several threads while others run bulk calls.
  thread_pool two{std::min<std::size_t>(2, hardware_threads())};
  std::atomic<std::uint64_t> total{0};
  std::vector<std::jthread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int r = 0; r < 100; ++r) {
        thread_pool::awake_guard g;
        if ((r + t) % 2 == 0) g = two.stay_awake();
        two.bulk(16, [&](std::size_t j) { total.fetch_add(j); });
      }
    });
  }
  callers.clear();
  CHECK(total.load() == std::uint64_t{4} * 100 * 120);
  CHECK(two.awake_guards() == 0);
}

TEST_CASE("stay_awake does nothing on an oversubscribed pool or an executor without it",
          "[thread_pool]") {
  thread_pool big{hardware_threads() + 1};
  auto g = big.stay_awake();
  CHECK_FALSE(g.active());
  CHECK(big.awake_guards() == 0);
  std::atomic<int> ran{0};
  big.bulk(32, [&](std::size_t) { ran.fetch_add(1); });
  CHECK(ran.load() == 32);

  inline_executor serial;
  STATIC_REQUIRE(std::is_same_v<decltype(stay_awake(serial)), detail::no_awake_guard>);
  thread_pool pool{1};
  STATIC_REQUIRE(std::is_same_v<decltype(stay_awake(pool)), thread_pool::awake_guard>);
  {
    const auto guard = stay_awake(pool);
    CHECK(guard.active());
    CHECK(pool.awake_guards() == 1);
  }
  CHECK(pool.awake_guards() == 0);
}

TEST_CASE("the destructor finishes the tasks already submitted", "[thread_pool]") {
  std::atomic<int> ran{0};
  std::vector<std::future<void>> futures;
  {
    thread_pool pool{1};
    for (int i = 0; i < 200; ++i) futures.push_back(pool.submit([&] { ran.fetch_add(1); }));
  }
  CHECK(ran.load() == 200);
  for (auto& f : futures) f.get();
}

TEST_CASE("for_each_chunk covers the range once in grain-sized pieces", "[executor]") {
  thread_pool pool{3};
  inline_executor serial;
  for (std::uint64_t total : {0ull, 1ull, 15ull, 16ull, 17ull, 1000ull}) {
    for (std::uint64_t grain : {0ull, 1ull, 16ull, 999ull, 5000ull}) {
      std::vector<std::atomic<int>> hits(total);
      std::atomic<int> pieces{0};
      auto body = [&](std::uint64_t b, std::uint64_t e) {
        REQUIRE(b < e);
        REQUIRE(e - b <= std::max<std::uint64_t>(grain, 1));
        pieces.fetch_add(1);
        for (auto i = b; i < e; ++i) hits[i].fetch_add(1);
      };
      for_each_chunk(pool, total, grain, body);
      for_each_chunk(serial, total, grain, body);
      for (std::uint64_t i = 0; i < total; ++i) REQUIRE(hits[i].load() == 2);
      const std::uint64_t g = std::max<std::uint64_t>(grain, 1);
      CHECK(static_cast<std::uint64_t>(pieces.load()) == 2 * ((total + g - 1) / g));
    }
  }
}

TEST_CASE("balanced_grain respects its minimum and alignment", "[executor]") {
  STATIC_REQUIRE(balanced_grain(1000, 2, 1, 1, 4) == 125);
  STATIC_REQUIRE(balanced_grain(1000, 2, 300, 1, 4) == 300);
  STATIC_REQUIRE(balanced_grain(1000, 2, 1, 64, 4) == 128);
  STATIC_REQUIRE(balanced_grain(0, 2, 0, 16, 4) == 16);
  STATIC_REQUIRE(balanced_grain(std::uint64_t{1} << 40, 2, 1, 16, 4) == std::uint64_t{1} << 37);
}
