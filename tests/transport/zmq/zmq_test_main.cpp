// SPDX-License-Identifier: Apache-2.0
// Tests of the ZeroMQ backend on loopback. One program in several roles (ctest runs each):
//   threads                 4 ranks as threads of this process; peer list from the environment
//   processes N             N worker processes; endpoints on free ports, exchanged by files
//   kill N | freeze N | stall N
//                           N workers exchanging in a loop; rank 2 is killed (SIGKILL),
//                           frozen (SIGSTOP: only heartbeats notice) or stalls (alive, silent);
//                           every other rank must fail with a stellatrain::error naming the
//                           cause within the bound, none may hang or report success
//   garbage                 a foreign ZeroMQ client sends a malformed frame: the transport
//                           fails with errc::malformed_message, it does not crash
//   worker MODE DIR RANK N  (internal) one rank of the process modes
// Exit status 0: passed. Every wait has a deadline; the supervisor kills what outlives it.
#include "../process_support.hpp"
#include "../scenarios.hpp"

#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/zmq.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace {

using namespace stellatrain;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr int expected_failure = 3;  // a worker saw the stellatrain::error it should

int fail(const std::string& what) {
  std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  return 1;
}

// ---------------------------------------------------------------- threads
int run_threads() {
  constexpr int p = 4;
  std::vector<std::unique_ptr<zmq_listener>> listeners;
  std::string list;
  std::vector<std::string> endpoints;
  for (int r = 0; r < p; ++r) {
    listeners.push_back(std::make_unique<zmq_listener>("tcp://127.0.0.1:*"));
    endpoints.push_back(listeners.back()->endpoint());
    list += (r == 0 ? "" : ",") + endpoints.back();
  }
  // The environment form of the peer list.
  ::setenv("STELLATRAIN_ZMQ_PEERS", list.c_str(), 1);
  ::setenv("STELLATRAIN_RANK", "2", 1);
  const auto parsed = zmq_peer_list::from_environment();
  if (parsed.rank != 2 || parsed.endpoints != endpoints)
    return fail("STELLATRAIN_ZMQ_PEERS parsed wrongly");
  ::setenv("STELLATRAIN_RANK", "4", 1);
  try {
    (void)zmq_peer_list::from_environment();
    return fail("a rank outside the list was accepted");
  } catch (const error& e) {
    if (e.code() != errc::invalid_argument) return fail("wrong error for a bad rank");
  }
  ::unsetenv("STELLATRAIN_ZMQ_PEERS");
  ::unsetenv("STELLATRAIN_RANK");

  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      try {
        zmq_transport t(std::move(*listeners[static_cast<std::size_t>(r)]), r, endpoints,
                        {.connect_timeout = 20s});
        test::run_all_scenarios(t, std::size_t{1} << 20, 11);
        // Payload checksums on: same results.
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  if (failures != 0) return fail("threads: " + std::to_string(failures.load()) + " ranks failed");
  // A second world with payload checksums, and a world whose peer never comes: the
  // constructor times out with a clear error instead of hanging.
  {
    std::vector<std::unique_ptr<zmq_listener>> ls;
    std::vector<std::string> eps;
    for (int r = 0; r < 2; ++r) {
      ls.push_back(std::make_unique<zmq_listener>("tcp://127.0.0.1:*"));
      eps.push_back(ls.back()->endpoint());
    }
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r) {
      ts.emplace_back([&, r] {
        try {
          zmq_transport t(std::move(*ls[static_cast<std::size_t>(r)]), r, eps,
                          {.payload_checksum = true});
          test::allgather_case(
              t, [](int q) { return static_cast<std::size_t>(100000 + q); }, {}, 5);
          test::p2p_case(t, 6, 1);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "checksum world rank %d: %s\n", r, e.what());
          ++failures;
        }
      });
    }
    for (auto& th : ts) th.join();
    if (failures != 0) return fail("checksum world failed");
  }
  {
    zmq_listener absent("tcp://127.0.0.1:*");  // bound, but no transport ever answers
    zmq_listener mine("tcp://127.0.0.1:*");
    const std::vector<std::string> eps{mine.endpoint(), absent.endpoint()};
    const auto t0 = test::steady::now();
    try {
      zmq_transport t(std::move(mine), 0, eps, {.connect_timeout = 500ms});
      return fail("a world with a missing peer was created");
    } catch (const error& e) {
      if (e.code() != errc::timeout || std::string(e.what()).find("rank 1") == std::string::npos) {
        return fail(std::string("wrong error for a missing peer: ") + e.what());
      }
    }
    if (test::steady::now() - t0 > 5s) return fail("the connect timeout was not respected");
  }
  std::puts("zmq threads: passed");
  return 0;
}

// ---------------------------------------------------------------- garbage
int run_garbage() {
  // Rank 0 is played by raw ZeroMQ sockets: a ROUTER that rank 1 connects to, and a DEALER
  // that greets rank 1 correctly and then sends junk.
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind("tcp://127.0.0.1:*");
  zmq_listener l1("tcp://127.0.0.1:*");
  const std::vector<std::string> eps{router.get(zmq::sockopt::last_endpoint), l1.endpoint()};
  std::atomic<int> failures{0};
  std::atomic<bool> up{false};
  std::thread rank1([&] {
    try {
      zmq_transport t(std::move(l1), 1, eps);
      up = true;
      std::vector<std::byte> buf(16);
      auto r = t.irecv(0, 1, std::span<std::byte>(buf));
      try {
        wait_or_throw(r, 10s, "a message");
        std::fprintf(stderr, "rank 1 accepted garbage\n");
        ++failures;
      } catch (const error& e) {
        if (std::string(e.what()).find("does not start with the magic") == std::string::npos &&
            std::string(e.what()).find("unknown sender") == std::string::npos) {
          std::fprintf(stderr, "rank 1: unexpected error: %s\n", e.what());
          ++failures;
        }
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank 1: %s\n", e.what());
      ++failures;
    }
  });
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  const char id[5] = {'r', 0, 0, 0, 0};
  d.set(zmq::sockopt::routing_id, std::string_view(id, 5));
  d.connect(eps[1]);
  stellatrain::detail::frame_header hello;
  hello.kind = stellatrain::detail::frame_kind::hello;
  hello.tag = 2;
  stellatrain::detail::frame_bytes hb{};
  stellatrain::detail::encode_frame(hello, hb);
  d.send(zmq::buffer(hb), zmq::send_flags::sndmore);
  d.send(zmq::message_t(), zmq::send_flags::none);
  for (int i = 0; i < 500 && !up; ++i) std::this_thread::sleep_for(10ms);
  const char junk[32] = "this is not a stellatrain frame";
  d.send(zmq::buffer(junk, 32), zmq::send_flags::sndmore);
  d.send(zmq::buffer(junk, 5), zmq::send_flags::none);
  rank1.join();
  if (failures != 0) return fail("garbage");
  std::puts("zmq garbage: passed");
  return 0;
}

// ---------------------------------------------------------------- worker
int run_worker(const std::string& mode, const fs::path& dir, int rank, int p) {
  const auto deadline = test::steady::now() + 30s;
  zmq_listener listener("tcp://127.0.0.1:*");
  test::publish(dir / ("ep." + std::to_string(rank)), listener.endpoint());
  if (rank == 0) {
    std::string peers = "# endpoints of this world, in rank order\n";
    for (int r = 0; r < p; ++r)
      peers += test::await_file(dir / ("ep." + std::to_string(r)), deadline) + "\n";
    test::publish(dir / "peers", peers);
  }
  (void)test::await_file(dir / "peers", deadline);
  // The peer list comes from a file named in the environment.
  ::setenv("STELLATRAIN_ZMQ_PEERS_FILE", (dir / "peers").c_str(), 1);
  ::setenv("STELLATRAIN_RANK", std::to_string(rank).c_str(), 1);
  const auto peers = zmq_peer_list::from_environment();
  zmq_options opt{.connect_timeout = 30s};
  if (mode == "freeze") {
    opt.heartbeat_interval = 200ms;
    opt.heartbeat_timeout = 1000ms;
  }
  zmq_transport t(std::move(listener), peers.rank, peers.endpoints, opt);
  if (mode == "scenarios") {
    test::run_all_scenarios(t, std::size_t{1} << 20, 21);
    std::printf("rank %d: scenarios passed\n", rank);
    return 0;
  }
  // Fault modes: exchange in a loop until something fails.
  const std::vector<std::byte> mine(std::size_t{4} << 20,
                                    std::byte{static_cast<unsigned char>(rank)});
  std::vector<message_buffer> out(static_cast<std::size_t>(p));
  collective_workspace<zmq_transport> ws;
  std::vector<float> grad(std::size_t{1} << 20, 1.0f);
  const auto timeout = mode == "stall" ? 1000ms : 20000ms;
  for (int round = 0;; ++round) {
    if (round == 2) test::publish(dir / ("running." + std::to_string(rank)), "yes");
    if (mode == "stall" && rank == 2 && round == 3)
      std::this_thread::sleep_for(4s);  // alive but silent
    try {
      sparse_allgather(t, mine, out,
                       {.tag = 1,
                        .timeout = timeout,
                        .algorithm = allgather_algorithm::ring,
                        .chunk_bytes = 1 << 18},
                       ws);
      dense_allreduce(t, std::span<float>(grad), {.tag = 2, .timeout = timeout, .average = true});
    } catch (const error& e) {
      std::printf("rank %d: failed as expected in round %d: %s\n", rank, round, e.what());
      // A killed or frozen rank is named; after a stall the first timeout may name any rank.
      const bool named =
          mode == "stall" || std::string(e.what()).find("rank 2") != std::string::npos;
      const bool kind = e.code() == errc::peer_failure || e.code() == errc::timeout;
      return named && kind ? expected_failure : 1;
    }
    for (int r = 0; r < p; ++r) {
      if (out[static_cast<std::size_t>(r)].size() != mine.size() ||
          out[static_cast<std::size_t>(r)].data()[12345] !=
              std::byte{static_cast<unsigned char>(r)}) {
        std::printf("rank %d: wrong all-gather result in round %d\n", rank, round);
        return 1;
      }
    }
    if (round > 1000) {
      std::printf("rank %d: never failed\n", rank);
      return 1;
    }
  }
}

// ---------------------------------------------------------------- supervisor
int run_processes(const char* self, const std::string& mode, int p) {
  test::temp_dir dir;
  std::vector<test::child> kids(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    kids[static_cast<std::size_t>(r)].pid = test::spawn(
        {self, "worker", mode, dir.path.string(), std::to_string(r), std::to_string(p)});
  }
  const auto start = test::steady::now();
  auto fault_at = start;
  if (mode != "scenarios") {
    // Inject the fault once every rank is exchanging.
    for (int r = 0; r < p; ++r) {
      try {
        (void)test::await_file(dir.path / ("running." + std::to_string(r)), start + 60s);
      } catch (const std::exception&) {
        test::wait_all(kids, test::steady::now());
        return fail(mode + ": rank " + std::to_string(r) + " never started exchanging");
      }
    }
    fault_at = test::steady::now();
    if (mode == "kill") kill(kids[2].pid, SIGKILL);
    if (mode == "freeze") kill(kids[2].pid, SIGSTOP);
  }
  const auto bound = mode == "scenarios" ? 100s : 15s;
  bool ok = true;
  std::vector<test::child> others;
  if (mode == "freeze") {
    // Everyone but the frozen rank must end on its own; then the frozen one is killed.
    std::vector<test::child> rest;
    for (int r = 0; r < p; ++r) {
      if (r != 2) rest.push_back(kids[static_cast<std::size_t>(r)]);
    }
    ok = test::wait_all(rest, fault_at + bound);
    kill(kids[2].pid, SIGKILL);
    std::vector<test::child> frozen{kids[2]};
    test::wait_all(frozen, test::steady::now() + 10s);
    for (int r = 0, k = 0; r < p; ++r) {
      if (r != 2) kids[static_cast<std::size_t>(r)] = rest[static_cast<std::size_t>(k++)];
    }
    kids[2] = frozen[0];
  } else {
    ok = test::wait_all(kids, fault_at + bound);
  }
  if (!ok)
    return fail(mode + ": workers did not end within " + std::to_string(bound.count()) +
                " s (killed)");
  int bad = 0;
  for (int r = 0; r < p; ++r) {
    const auto& k = kids[static_cast<std::size_t>(r)];
    const int code = test::exit_code(*k.status);
    const double after = std::chrono::duration<double>(k.ended - fault_at).count();
    std::printf("%s: rank %d ended with %s, %.2f s after the fault\n", mode.c_str(), r,
                test::describe(*k.status).c_str(), after);
    if (mode == "scenarios") {
      bad += code == 0 ? 0 : 1;
    } else if (r == 2 && mode != "stall") {
      bad += WIFSIGNALED(*k.status) ? 0 : 1;
    } else {
      bad += code == expected_failure ? 0 : 1;
    }
  }
  if (bad != 0) return fail(mode + ": " + std::to_string(bad) + " ranks ended wrongly");
  std::printf("zmq %s: passed\n", mode.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "threads") return run_threads();
    if (mode == "garbage") return run_garbage();
    if (mode == "worker" && argc == 6)
      return run_worker(argv[2], argv[3], std::atoi(argv[4]), std::atoi(argv[5]));
    if ((mode == "processes" || mode == "kill" || mode == "freeze" || mode == "stall") &&
        argc == 3) {
      const std::string self = fs::read_symlink("/proc/self/exe").string();
      return run_processes(self.c_str(), mode == "processes" ? "scenarios" : mode,
                           std::atoi(argv[2]));
    }
    std::fprintf(stderr,
                 "usage: %s threads | garbage | processes N | kill N | freeze N | stall N\n",
                 argv[0]);
    return 2;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
