// SPDX-License-Identifier: Apache-2.0
// The generic collectives on the in-process backend: every collective and algorithm for
// P = 1..8, empty and huge messages, mismatched sizes, concurrent tags, and failing ranks.
#include "catch.hpp"
#include "scenarios.hpp"

#include <stellatrain/stellatrain.hpp>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

using namespace stellatrain;
using namespace std::chrono_literals;

namespace {

// The in-process transport without its receive of unknown length: the collectives take
// their length-prefixed paths on it, as on any plain `transport`.
struct span_only {
  using request_type = in_process_request;
  in_process_transport& t;
  int rank() const noexcept { return t.rank(); }
  int size() const noexcept { return t.size(); }
  request_type isend(int p, tag_type g, std::span<const std::byte> b) { return t.isend(p, g, b); }
  request_type irecv(int p, tag_type g, std::span<std::byte> b) { return t.irecv(p, g, b); }
  void abort(std::string_view why) noexcept { t.abort(why); }
};
static_assert(transport<span_only> && !message_transport<span_only>);

errc first_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const error& e) {
    return static_cast<errc>(e.code().value());
  }
  return errc{};
}

}  // namespace

TEST_CASE("sparse_allgather: every algorithm, P = 1..8, lengths from 0 to 1 MiB",
          "[transport][allgather]") {
  for (int p = 1; p <= 8; ++p) {
    CAPTURE(p);
    run_in_process(p, [&](in_process_transport& t) {
      collective_workspace<in_process_transport> ws;
      std::vector<message_buffer> out;
      for (auto algorithm : {allgather_algorithm::automatic, allgather_algorithm::ring,
                             allgather_algorithm::direct}) {
        for (std::size_t chunk : {std::size_t{0}, std::size_t{1000}, std::size_t{256} << 10}) {
          // All empty; one byte; odd lengths differing per rank; one big; mixed empty/big.
          test::allgather_case(
              t, [](int) { return std::size_t{0}; }, {.algorithm = algorithm, .chunk_bytes = chunk},
              1, ws, out);
          test::allgather_case(
              t, [](int) { return std::size_t{1}; }, {.algorithm = algorithm, .chunk_bytes = chunk},
              2, ws, out);
          test::allgather_case(
              t, [](int r) { return static_cast<std::size_t>(4093 + 977 * r); },
              {.algorithm = algorithm, .chunk_bytes = chunk}, 3, ws, out);
          test::allgather_case(
              t,
              [&](int r) {
                return r % 2 == 0 ? std::size_t{0}
                                  : (std::size_t{1} << 20) + static_cast<std::size_t>(r);
              },
              {.tag = 3, .algorithm = algorithm, .chunk_bytes = chunk}, 4, ws, out);
        }
      }
    });
  }
}

TEST_CASE("sparse_allgather: on a transport without variable-length receives",
          "[transport][allgather]") {
  for (int p : {2, 3, 5}) {
    CAPTURE(p);
    run_in_process(p, [&](in_process_transport& raw) {
      span_only t{raw};
      for (auto algorithm : {allgather_algorithm::ring, allgather_algorithm::direct}) {
        test::allgather_case(
            t, [](int r) { return static_cast<std::size_t>(r == 1 ? 0 : 5000 + 3 * r); },
            {.algorithm = algorithm, .chunk_bytes = 1024}, 1);
      }
      test::broadcast_case(t, p - 1, 7777, {.chunk_bytes = 1000}, 2);
      test::p2p_case(t, 3, 10);
    });
  }
  // Announced lengths above the limit are refused before the receive buffer grows.
  CHECK(first_error_of([] {
          run_in_process(3, [](in_process_transport& raw) {
            span_only t{raw};
            const std::vector<std::byte> mine(t.rank() == 1 ? 5000 : 10);
            std::vector<message_buffer> out(3);
            sparse_allgather(t, mine, out,
                             {.timeout = 10s,
                              .algorithm = allgather_algorithm::direct,
                              .max_message_bytes = 1000});
          });
        }) == errc::malformed_message);
}

TEST_CASE("sparse_allgather: huge messages (16 MiB per rank) through the pipelined ring",
          "[transport][allgather]") {
  run_in_process(3, [](in_process_transport& t) {
    test::allgather_case(
        t, [](int r) { return (std::size_t{16} << 20) + static_cast<std::size_t>(r) * 4097; },
        {.algorithm = allgather_algorithm::ring, .chunk_bytes = std::size_t{1} << 20}, 9);
  });
}

TEST_CASE("sparse_allgather: output count and announced lengths are validated",
          "[transport][allgather]") {
  run_in_process(2, [](in_process_transport& t) {
    std::vector<message_buffer> wrong(3);
    const std::vector<std::byte> mine(10);
    CHECK(first_error_of([&] { sparse_allgather(t, mine, wrong); }) == errc::invalid_argument);
  });
  // A length above the receivers' limit is refused before anything is allocated; the
  // failing rank aborts, so the other ranks fail too instead of waiting.
  CHECK(first_error_of([] {
          run_in_process(3, [](in_process_transport& t) {
            const std::vector<std::byte> mine(t.rank() == 1 ? 5000 : 10);
            std::vector<message_buffer> out(3);
            sparse_allgather(t, mine, out, {.timeout = 10s, .max_message_bytes = 1000});
          });
        }) == errc::malformed_message);
}

TEST_CASE("sparse_allgather: concurrent calls on distinct tags", "[transport][allgather]") {
  run_in_process(4, [](in_process_transport& t) {
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int k = 0; k < 4; ++k) {
      threads.emplace_back([&, k] {
        try {
          collective_workspace<in_process_transport> ws;
          std::vector<message_buffer> out;
          for (int round = 0; round < 10; ++round) {
            const auto algorithm =
                k % 2 == 0 ? allgather_algorithm::ring : allgather_algorithm::direct;
            test::allgather_case(
                t, [&](int r) { return static_cast<std::size_t>(100 * (k + 1) + 31 * r + round); },
                {.tag = static_cast<tag_type>(50 + k), .algorithm = algorithm, .chunk_bytes = 64},
                static_cast<std::uint64_t>(k * 100 + round), ws, out);
          }
          std::vector<float> v(1000);
          for (int round = 0; round < 5; ++round) {
            test::allreduce_case<float>(t, 777 + static_cast<std::size_t>(k),
                                        {.tag = static_cast<tag_type>(60 + k), .chunk_bytes = 256},
                                        static_cast<std::uint64_t>(k + round));
          }
        } catch (...) {
          ++failures;
        }
      });
    }
    for (auto& th : threads) th.join();
    if (failures != 0)
      throw test::scenario_failure(std::to_string(failures.load()) +
                                   " concurrent collectives failed");
  });
}

TEST_CASE("dense_allreduce: float, double, integers, average, P = 1..8", "[transport][allreduce]") {
  for (int p = 1; p <= 8; ++p) {
    CAPTURE(p);
    std::mutex m;
    std::vector<std::vector<float>> results(static_cast<std::size_t>(p));
    run_in_process(p, [&](in_process_transport& t) {
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                            std::size_t{9}, std::size_t{1000}, std::size_t{65537}}) {
        for (std::size_t chunk : {std::size_t{0}, std::size_t{4}, std::size_t{4096}}) {
          if (chunk == 4 && n > 1000) continue;  // one element per message: slow, covered below
          test::allreduce_case<float>(t, n, {.chunk_bytes = chunk}, n + chunk);
          test::allreduce_case<double>(t, n, {.chunk_bytes = chunk, .average = true},
                                       n + chunk + 1);
        }
        test::allreduce_case<std::int32_t>(t, n, {}, n + 2);
        test::allreduce_case<std::uint8_t>(t, n, {.chunk_bytes = 3}, n + 3);
      }
      // Bit-identical results on every rank for inexact float sums.
      std::vector<float> v(10007);
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = 0.1f * static_cast<float>(i % 13) + 1e-3f * static_cast<float>(t.rank());
      dense_allreduce(t, std::span<float>(v), {.chunk_bytes = 1024, .average = true});
      std::lock_guard lock(m);
      results[static_cast<std::size_t>(t.rank())] = std::move(v);
    });
    for (int r = 1; r < p; ++r) CHECK(results[static_cast<std::size_t>(r)] == results[0]);
  }
}

TEST_CASE("dense_reduce_scatter: each rank owns the sum of its segment, P = 1..8",
          "[transport][allreduce]") {
  for (int p = 1; p <= 8; ++p) {
    CAPTURE(p);
    run_in_process(p, [&](in_process_transport& t) {
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{9},
                            std::size_t{1000}, std::size_t{65537}}) {
        for (std::size_t chunk : {std::size_t{0}, std::size_t{12}, std::size_t{4096}}) {
          test::reduce_scatter_case<float>(t, n, {.chunk_bytes = chunk}, n + chunk);
          test::reduce_scatter_case<double>(t, n, {.chunk_bytes = chunk, .average = true},
                                            n + chunk + 1);
        }
        test::reduce_scatter_case<std::int32_t>(t, n, {}, n + 2);
      }
      // The segments tile the data in rank order.
      std::uint64_t next = 0;
      for (int r = 0; r < p; ++r) {
        const auto s = segment_of(1003, p, r);
        CHECK(s.begin == next);
        next = s.end;
      }
      CHECK(next == 1003);
      std::vector<float> v(10);
      CHECK_THROWS_AS(
          dense_reduce_scatter(t, std::span<float>(v), {.algorithm = allreduce_algorithm::native}),
          error);
    });
  }
  // A rank that reduces another size fails on every rank.
  CHECK_THROWS_AS(run_in_process(3,
                                 [](in_process_transport& t) {
                                   std::vector<float> v(t.rank() == 1 ? 11 : 10);
                                   dense_reduce_scatter(t, std::span<float>(v), {.timeout = 20s});
                                 }),
                  error);
}

TEST_CASE("group_transport: collectives inside subsets of the ranks", "[transport][group]") {
  run_in_process(6, [](in_process_transport& t) {
    // Two interleaved groups, members listed out of order: {4, 0, 2} and {1, 3, 5}.
    const bool even = t.rank() % 2 == 0;
    group_transport<in_process_transport> g(
        t, even ? std::vector<int>{4, 0, 2} : std::vector<int>{1, 3, 5});
    REQUIRE(g.size() == 3);
    CHECK(g.parent_rank(g.rank()) == t.rank());
    test::allreduce_case<float>(g, 1001, {.tag = 21, .chunk_bytes = 512}, even ? 5 : 6);
    test::reduce_scatter_case<double>(g, 333, {.tag = 22}, even ? 7 : 8);
    std::vector<message_buffer> got(3);
    const std::vector<std::byte> mine(static_cast<std::size_t>(10 + t.rank()),
                                      static_cast<std::byte>(t.rank()));
    sparse_allgather(g, std::span<const std::byte>(mine), std::span<message_buffer>(got),
                     {.tag = 23});
    for (int r = 0; r < 3; ++r) {
      const int parent = g.parent_rank(r);
      REQUIRE(got[static_cast<std::size_t>(r)].size() == static_cast<std::size_t>(10 + parent));
      CHECK(got[static_cast<std::size_t>(r)].data()[0] == static_cast<std::byte>(parent));
    }
    CHECK_THROWS_AS(group_transport<in_process_transport>(t, {even ? 1 : 0}), error);
    CHECK_THROWS_AS(group_transport<in_process_transport>(t, {t.rank(), t.rank()}), error);
    CHECK_THROWS_AS(group_transport<in_process_transport>(t, {t.rank(), 6}), error);
    barrier(t, {.tag = 24});
  });
}

TEST_CASE("dense_allreduce: a large gradient (4M floats) across 4 ranks",
          "[transport][allreduce]") {
  run_in_process(4, [](in_process_transport& t) {
    test::allreduce_case<float>(t, (std::size_t{4} << 20) + 3,
                                {.chunk_bytes = std::size_t{1} << 20}, 5);
  });
}

TEST_CASE("dense_allreduce: mismatched sizes or types fail on every rank",
          "[transport][allreduce]") {
  for (int bad_rank : {0, 2}) {
    std::atomic<int> threw{0};
    std::atomic<int> size_mismatch{0};
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(first_error_of([&] {
            run_in_process(4, [&](in_process_transport& t) {
              std::vector<float> v(t.rank() == bad_rank ? 1001 : 1000, 1.0f);
              try {
                dense_allreduce(t, std::span<float>(v), {.timeout = 20s});
              } catch (const error& e) {
                ++threw;
                if (e.code() == errc::size_mismatch) ++size_mismatch;
                throw;
              }
            });
          }) == errc::size_mismatch);
    CHECK(threw == 4);  // no rank completes with a mixed-up result
    CHECK(size_mismatch >= 1);
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // the abort, not the timeout
  }
  std::atomic<int> threw{0};
  CHECK(first_error_of([&] {
          run_in_process(2, [&](in_process_transport& t) {
            try {
              if (t.rank() == 0) {
                std::vector<float> v(100, 1.0f);
                dense_allreduce(t, std::span<float>(v));
              } else {
                std::vector<std::int32_t> v(100, 1);  // same size, other type
                dense_allreduce(t, std::span<std::int32_t>(v));
              }
            } catch (...) {
              ++threw;
              throw;
            }
          });
        }) == errc::size_mismatch);
  CHECK(threw == 2);
  run_in_process(1, [](in_process_transport& t) {
    std::vector<int> v(3, 1);
    CHECK(first_error_of([&] { dense_allreduce(t, std::span<int>(v), {.average = true}); }) ==
          errc::invalid_argument);
  });
}

TEST_CASE("broadcast and barrier, P = 1..8", "[transport][broadcast][barrier]") {
  for (int p = 1; p <= 8; ++p) {
    CAPTURE(p);
    std::atomic<int> arrived{0};
    run_in_process(p, [&](in_process_transport& t) {
      for (int root = 0; root < p; ++root) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{100000}}) {
          test::broadcast_case(t, root, n, {.chunk_bytes = 4096},
                               static_cast<std::uint64_t>(root) + n);
        }
      }
      // Nobody leaves a barrier before everybody has arrived.
      for (int round = 1; round <= 5; ++round) {
        if (t.rank() == round % p) std::this_thread::sleep_for(5ms);
        ++arrived;
        barrier(t, {.tag = 4});
        if (arrived.load() < round * p) throw test::scenario_failure("barrier left early");
        barrier(t, {.tag = 4});
      }
    });
  }
  // A rank whose span has the wrong size fails, and so do the ranks after it in the chain.
  CHECK(first_error_of([] {
          run_in_process(3, [](in_process_transport& t) {
            std::vector<std::byte> b(t.rank() == 1 ? 99 : 100);
            broadcast(t, 0, std::span<std::byte>(b), {.timeout = 20s});
          });
        }) == errc::size_mismatch);
  CHECK(first_error_of([] {
          run_in_process(2, [](in_process_transport& t) {
            message_buffer m;
            broadcast(t, 2, m);
          });
        }) == errc::invalid_argument);
}

TEST_CASE("faults: a rank that throws, returns early or stalls never hangs the others",
          "[transport][fault]") {
  // Throws before the collective: the others fail at once with peer_failure.
  for (auto algorithm : {allgather_algorithm::ring, allgather_algorithm::direct}) {
    std::atomic<int> peer_failures{0};
    const auto t0 = std::chrono::steady_clock::now();
    try {
      run_in_process(4, [&](in_process_transport& t) {
        if (t.rank() == 2) throw error(errc::io_error, "rank 2 lost its disk");
        std::vector<message_buffer> out(4);
        try {
          sparse_allgather(t, std::vector<std::byte>(1000), out,
                           {.timeout = 30s, .algorithm = algorithm});
        } catch (const error& e) {
          if (e.code() == errc::peer_failure &&
              std::string(e.what()).find("lost its disk") != std::string::npos)
            ++peer_failures;
          throw;
        }
      });
      FAIL("no error");
    } catch (const error& e) {
      CHECK(e.code() == errc::io_error);  // the cause is what run_in_process rethrows
    }
    CHECK(peer_failures == 3);
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  }
  // Returns early (its thread stops): its transport closes; receives from it fail at once.
  {
    std::atomic<int> failures{0};
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(first_error_of([&] {
            run_in_process(4, [&](in_process_transport& t) {
              if (t.rank() == 1) return;
              std::vector<float> v(100000, 1.0f);
              try {
                dense_allreduce(t, std::span<float>(v), {.timeout = 30s});
              } catch (const error&) {
                ++failures;
                throw;
              }
            });
          }) == errc::peer_failure);
    CHECK(failures == 3);
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
  }
  // Stalls (alive, silent): the others time out within the configured bound; the first
  // timeout aborts the transport, so the rest fail right after it.
  {
    std::atomic<int> failures{0};
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(first_error_of([&] {
            run_in_process(4, [&](in_process_transport& t) {
              if (t.rank() == 3) std::this_thread::sleep_for(1500ms);
              std::vector<message_buffer> out(4);
              try {
                sparse_allgather(t, std::vector<std::byte>(100), out,
                                 {.timeout = 300ms, .algorithm = allgather_algorithm::ring});
              } catch (const error&) {
                ++failures;
                throw;
              }
            });
          }) == errc::timeout);
    CHECK(failures == 4);  // the stalled rank finds the transport aborted when it wakes
    CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  }
  // Without abort_on_failure each rank times out on its own, and the messages say so.
  {
    std::atomic<int> timeouts{0};
    in_process_world world(3);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, t = world.transport(r)]() mutable {
        std::vector<message_buffer> out(3);
        try {
          sparse_allgather(t, std::vector<std::byte>(10), out,
                           {.timeout = 200ms,
                            .algorithm = allgather_algorithm::direct,
                            .abort_on_failure = false});
        } catch (const error& e) {
          if (e.code() == errc::timeout &&
              std::string(e.what()).find("sparse_allgather (direct, tag 0) on rank") !=
                  std::string::npos) {
            ++timeouts;
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    CHECK(timeouts == 2);
    CHECK_FALSE(world.failed());
  }
}
