// SPDX-License-Identifier: Apache-2.0
// The runner of in-process ranks (detail::run_ranks) that run_in_process and
// run_in_process_clusters share: every rank runs, a failing rank aborts its worlds while its
// transports are open, and the cause is rethrown after every thread has ended.
#include "catch.hpp"

#include <stellatrain/stellatrain.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

using namespace stellatrain;
using namespace std::chrono_literals;

namespace {

// The "transport" of a rank in fake_worlds: says while it is open.
class fake_link {
 public:
  fake_link(std::atomic<bool>& open, int rank) : open_(&open), rank_(rank) { open = true; }
  fake_link(fake_link&& other) noexcept
      : open_(std::exchange(other.open_, nullptr)), rank_(other.rank_) {}
  fake_link& operator=(fake_link&&) = delete;
  ~fake_link() {
    if (open_ != nullptr) *open_ = false;
  }
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  std::atomic<bool>* open_;
  int rank_;
};

// Worlds that record what run_ranks asks of them: one fake link per rank.
struct recording_worlds {
  struct abort_call {
    int rank;
    std::string reason;
    bool link_open;  // the rank's link was open when its worlds were aborted
  };

  explicit recording_worlds(int ranks) : link_open(static_cast<std::size_t>(ranks)) {}

  std::tuple<fake_link> open(int rank) {
    return {fake_link(link_open[static_cast<std::size_t>(rank)], rank)};
  }
  void abort(int rank, std::string_view reason) noexcept {
    std::lock_guard lock(mutex);
    aborts.push_back({rank, std::string(reason), link_open[static_cast<std::size_t>(rank)]});
    if (first < 0) first = rank;
  }
  void abort_all(std::string_view reason) noexcept { abort(0, reason); }
  [[nodiscard]] int first_abort() noexcept {
    std::lock_guard lock(mutex);
    return first;
  }

  std::vector<std::atomic<bool>> link_open;
  std::mutex mutex;
  std::vector<abort_call> aborts;
  int first = -1;
};

}  // namespace

TEST_CASE("run_ranks: every rank runs once, on its own link, and nothing is thrown",
          "[transport][in_process]") {
  recording_worlds worlds(5);
  std::vector<std::atomic<int>> ran(5);
  auto fn = [&](fake_link& link) { ++ran[static_cast<std::size_t>(link.rank())]; };
  detail::run_ranks(5, worlds, fn);
  for (auto& r : ran) CHECK(r == 1);
  for (auto& o : worlds.link_open) CHECK_FALSE(o);  // every link closed
  CHECK(worlds.aborts.empty());
}

TEST_CASE("run_ranks: a failing rank aborts its worlds while its link is open",
          "[transport][in_process]") {
  recording_worlds worlds(4);
  std::atomic<int> ran{0};
  auto fn = [&](fake_link& link) {
    ++ran;
    if (link.rank() == 2) throw std::runtime_error("rank 2 failed");
  };
  try {
    detail::run_ranks(4, worlds, fn);
    FAIL("no error");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "rank 2 failed");
  }
  CHECK(ran == 4);
  REQUIRE(worlds.aborts.size() == 1);
  CHECK(worlds.aborts[0].rank == 2);
  CHECK(worlds.aborts[0].reason == "rank 2 failed");
  CHECK(worlds.aborts[0].link_open);
}

TEST_CASE("run_ranks: an exception that is not a std::exception is rethrown as it is",
          "[transport][in_process]") {
  recording_worlds worlds(3);
  auto fn = [&](fake_link& link) {
    if (link.rank() == 0) throw 42;
  };
  try {
    detail::run_ranks(3, worlds, fn);
    FAIL("no error");
  } catch (int v) {
    CHECK(v == 42);
  }
  REQUIRE(worlds.aborts.size() == 1);
  CHECK(worlds.aborts[0].rank == 0);
  CHECK(worlds.aborts[0].reason == "unknown exception");
  CHECK_FALSE(worlds.aborts[0].link_open);  // it unwound through the rank's scope first
}

TEST_CASE("run_ranks: the cause is the exception of the rank that aborted first",
          "[transport][in_process]") {
  // Rank 1 throws first, but the worlds report rank 3 as the first abort (as a collective
  // that aborted before its exception reached the runner would): rank 3's exception wins.
  recording_worlds worlds(4);
  std::atomic<bool> one_threw{false};
  auto fn = [&](fake_link& link) {
    if (link.rank() == 1) {
      {
        std::lock_guard lock(worlds.mutex);
        worlds.first = 3;
      }
      one_threw = true;
      throw std::runtime_error("rank 1");
    }
    if (link.rank() == 3) {
      while (!one_threw) std::this_thread::yield();
      throw std::logic_error("rank 3");
    }
  };
  try {
    detail::run_ranks(4, worlds, fn);
    FAIL("no error");
  } catch (const std::logic_error& e) {
    CHECK(std::string(e.what()) == "rank 3");
  }
  CHECK(worlds.aborts.size() == 2);
}

TEST_CASE("run_ranks: without an abort rank, the first exception recorded is rethrown",
          "[transport][in_process]") {
  struct no_cause_worlds : recording_worlds {
    using recording_worlds::recording_worlds;
    [[nodiscard]] int first_abort() noexcept { return -1; }
  };
  no_cause_worlds worlds(2);
  auto fn = [&](fake_link& link) {
    if (link.rank() == 0) throw std::runtime_error("first");
    // Rank 0's exception is recorded before its worlds are aborted.
    for (;;) {
      {
        std::lock_guard lock(worlds.mutex);
        if (!worlds.aborts.empty()) break;
      }
      std::this_thread::yield();
    }
    throw std::runtime_error("second");
  };
  try {
    detail::run_ranks(2, worlds, fn);
    FAIL("no error");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "first");
  }
}

TEST_CASE("run_in_process_clusters: a failing rank's reason reaches every waiting rank",
          "[transport][in_process]") {
  const auto topo = cluster_topology::parse("2,2");
  std::atomic<int> saw_reason{0};
  std::atomic<int> wrong_lan{0};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_in_process_clusters(topo, [&](in_process_transport& lan, in_process_transport& wan) {
      if (lan.size() != 2) ++wrong_lan;
      if (wan.rank() == 1) throw error(errc::io_error, "rank 1 lost its disk");
      std::vector<std::byte> buf(8);
      try {
        // A receive that only the failure ends: from rank 1 on the WAN.
        wan.irecv(1, 7, std::span<std::byte>(buf)).wait_until(deadline_after(30s));
      } catch (const error& e) {
        if (e.code() == errc::peer_failure &&
            std::string(e.what()).find("lost its disk") != std::string::npos)
          ++saw_reason;
        throw;
      }
    });
    FAIL("no error");
  } catch (const error& e) {
    CHECK(e.code() == errc::io_error);  // the cause, not a peer's failure
  }
  CHECK(saw_reason == 3);
  CHECK(wrong_lan == 0);
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}
