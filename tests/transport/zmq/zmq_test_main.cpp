// SPDX-License-Identifier: Apache-2.0
// Tests of the ZeroMQ backend on loopback. One program in several roles (ctest runs each):
//   threads                 4 ranks as threads of this process; peer list from the environment
//   processes N             N worker processes; endpoints on free ports, exchanged by files
//   kill N | freeze N | stall N
//                           N workers exchanging in a loop; rank 2 is killed (SIGKILL),
//                           frozen (SIGSTOP: only heartbeats notice) or stalls (alive, silent);
//                           every other rank must fail with a stellatrain::error naming the
//                           cause within the bound, none may hang or report success
//   kill-allgather N | kill-allreduce N
//                           rank 2 kills itself at its third send of the all-gather (the
//                           all-reduce) of round 3: every other rank fails in that collective
//                           of that round, within the bound
//   malformed N             rank 2 is a rogue (raw ZeroMQ) that greets correctly, then sends
//                           each rank a frame wrong in another way (no magic, a short payload,
//                           a forged source): every other rank fails naming it, before any
//                           timeout
//   world N                 rank 1 is started with a world of 3: every rank refuses to start,
//                           with that reason, before the connect timeout
//   sizes N                 rank 1 all-reduces a tensor of another length: every rank fails
//   pipeline-kill N         the pipeline trains; rank 2 dies in the middle of an exchange
//                           (from step 4 on): every survivor fails, and each of its tensors holds
//                           exactly the parameters of a step of a reference run (nothing of
//                           the partial exchange applied)
//   pipeline-sizes N        rank 1's model has a tensor of another size: every rank fails
//   garbage                 a foreign ZeroMQ client sends a malformed frame: the transport
//                           fails with errc::malformed_message, it does not crash
//   worker MODE DIR RANK N  (internal) one rank of the process modes
// Exit status 0: passed. Every wait has a deadline; the supervisor kills what outlives it.
#include "../fault_injection.hpp"
#include "../pipeline_workload.hpp"
#include "../process_support.hpp"
#include "../scenarios.hpp"

#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/zmq.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
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
// The fault modes' exchange: an all-gather and an all-reduce per round until one fails. Rank 2
// of kill-allgather / kill-allreduce dies at its third send of that collective in round 3.
// On failure the rank writes "ROUND STAGE" to failed.RANK, checks that the failed transport
// refuses the next exchange at once, and returns expected_failure when the error is of the
// kind the mode calls for.
template <class T>
int exchange_until_failure(T& t, const std::string& mode, const fs::path& dir, int rank, int p,
                           test::dies_on_send<zmq_transport>* dying) {
  const std::vector<std::byte> mine(std::size_t{4} << 20,
                                    std::byte{static_cast<unsigned char>(rank)});
  std::vector<message_buffer> out(static_cast<std::size_t>(p));
  collective_workspace<T> ws;
  // Rank 1 of "sizes" holds a tensor of another length than the others.
  std::vector<float> grad((std::size_t{1} << 20) - (mode == "sizes" && rank == 1 ? 1000 : 0), 1.0f);
  const auto timeout = mode == "stall" ? 1000ms : 20000ms;
  const int announce = mode == "malformed" || mode == "sizes" ? 0 : 2;
  std::string stage;
  for (int round = 0;; ++round) {
    if (round == announce) test::publish(dir / ("running." + std::to_string(rank)), "yes");
    if (mode == "stall" && rank == 2 && round == 3)
      std::this_thread::sleep_for(4s);  // alive but silent
    if (dying != nullptr && round == 3) dying->die_at_send(mode == "kill-allgather" ? 1 : 2, 3);
    try {
      stage = "allgather";
      sparse_allgather(t, mine, out,
                       {.tag = 1,
                        .timeout = timeout,
                        .algorithm = allgather_algorithm::ring,
                        .chunk_bytes = 1 << 18},
                       ws);
      stage = "allreduce";
      dense_allreduce(t, std::span<float>(grad), {.tag = 2, .timeout = timeout, .average = true});
    } catch (const error& e) {
      std::printf("rank %d: failed as expected in round %d (%s): %s\n", rank, round, stage.c_str(),
                  e.what());
      test::publish(dir / ("failed." + std::to_string(rank)), std::to_string(round) + " " + stage);
      // A failed transport refuses what comes next at once; it never waits for a timeout.
      const auto t0 = test::steady::now();
      try {
        sparse_allgather(t, mine, out, {.tag = 3, .timeout = 10s}, ws);
        std::printf("rank %d: an exchange succeeded on the failed transport\n", rank);
        return 1;
      } catch (const error&) {
        if (test::steady::now() - t0 > 2s) {
          std::printf("rank %d: the failed transport waited before refusing\n", rank);
          return 1;
        }
      }
      const std::string what = e.what();
      if (mode == "sizes") {
        // Every rank learns what differs, directly or from an abort that quotes it.
        const bool kind = e.code() == errc::size_mismatch || e.code() == errc::peer_failure;
        return kind && what.find("elements of") != std::string::npos ? expected_failure : 1;
      }
      // A killed, frozen or rogue rank is named; after a stall the first timeout may name any
      // rank. Frames, not a timeout, must end the malformed world.
      const bool named = mode == "stall" || what.find("rank 2") != std::string::npos;
      const bool kind =
          e.code() == errc::peer_failure || (e.code() == errc::timeout && mode != "malformed");
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

// Rank 2 of "malformed", played by raw ZeroMQ sockets: it greets every rank as a
// zmq_transport would, waits until they are exchanging (and so waiting for it), then sends
// each a frame that is wrong in another way, and stays connected, so that only the frames can
// end the others' exchange.
int run_rogue(const fs::path& dir, int rank, int p) {
  const auto deadline = test::steady::now() + 30s;
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind("tcp://127.0.0.1:*");
  test::publish(dir / ("ep." + std::to_string(rank)), router.get(zmq::sockopt::last_endpoint));
  std::vector<std::string> endpoints;
  {
    std::istringstream in(test::await_file(dir / "peers", deadline));
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && line[0] != '#') endpoints.push_back(line);
  }
  std::byte id[5] = {std::byte{'r'}};
  stellatrain::detail::frame_store_u32(id + 1, static_cast<std::uint32_t>(rank));
  std::vector<zmq::socket_t> dealers;
  for (int q = 0; q < p; ++q) {
    dealers.emplace_back(ctx, zmq::socket_type::dealer);
    if (q == rank) continue;
    auto& d = dealers.back();
    d.set(zmq::sockopt::linger, 0);
    d.set(zmq::sockopt::routing_id, zmq::const_buffer(id, sizeof id));
    d.connect(endpoints[static_cast<std::size_t>(q)]);
    stellatrain::detail::frame_header hello;
    hello.kind = stellatrain::detail::frame_kind::hello;
    hello.source = static_cast<std::uint32_t>(rank);
    hello.tag = static_cast<std::uint32_t>(p);
    stellatrain::detail::frame_bytes hb{};
    stellatrain::detail::encode_frame(hello, hb);
    d.send(zmq::buffer(hb), zmq::send_flags::sndmore);
    d.send(zmq::message_t(), zmq::send_flags::none);
  }
  for (int q = 0; q < p; ++q)
    if (q != rank) (void)test::await_file(dir / ("running." + std::to_string(q)), deadline);
  const char payload[5] = "junk";
  auto send = [&](int q, const stellatrain::detail::frame_bytes& header) {
    dealers[static_cast<std::size_t>(q)].send(zmq::buffer(header), zmq::send_flags::sndmore);
    dealers[static_cast<std::size_t>(q)].send(zmq::buffer(payload, 5), zmq::send_flags::none);
  };
  // Rank 0: no frame magic. Rank 1: 100 bytes announced, 5 sent. Rank 3: another source.
  stellatrain::detail::frame_bytes junk{};
  std::memcpy(junk.data(), "this is not a stellatrain frame", junk.size());
  send(0, junk);
  stellatrain::detail::frame_header h;
  h.source = static_cast<std::uint32_t>(rank);
  h.tag = 1;
  h.length = 100;
  stellatrain::detail::frame_bytes longer{};
  stellatrain::detail::encode_frame(h, longer);
  send(1, longer);
  h.source = 3;
  h.length = 5;
  stellatrain::detail::frame_bytes other{};
  stellatrain::detail::encode_frame(h, other);
  if (p > 3) send(3, other);
  std::printf("rank %d: sent malformed frames\n", rank);
  std::fflush(stdout);
  std::this_thread::sleep_for(60s);  // the supervisor ends it
  return 1;
}

// The pipeline modes: a user's job over the transport. pipeline-kill: rank 2 dies (SIGKILL) at
// its fifth send after step 4 begins, in the middle of the exchanges then in flight (of step 3
// or 4); each survivor writes what
// its tensors hold after the failure to params.RANK ("TENSOR STEP CRC" lines), which the
// supervisor compares with the steps of a reference run. pipeline-sizes: rank 1's model has
// a tensor of another size; every rank must fail, saying so.
constexpr int job_steps = 8;
constexpr int job_kill_step = 4;

int run_pipeline_worker(const std::string& mode, const fs::path& dir, int rank, zmq_transport t) {
  test::param_record record, at_failure;
  test::publish(dir / ("running." + std::to_string(rank)), "yes");
  try {
    if (mode == "pipeline-kill" && rank == 2) {
      test::dies_on_send<zmq_transport> dying(t);
      test::train_job(dying, job_steps, record, nullptr, [&](int step) {
        if (step == job_kill_step) dying.die_at_send(test::dies_on_send<zmq_transport>::any_tag, 5);
      });
    } else {
      auto sizes = test::job_sizes;
      if (mode == "pipeline-sizes" && rank == 1) sizes[2] += 1;
      test::train_job(t, job_steps, record, &at_failure, {}, sizes);
    }
  } catch (const error& e) {
    std::printf("rank %d: failed as expected: %s\n", rank, e.what());
    std::string lines;
    for (const auto& [key, crc] : at_failure)
      lines += std::to_string(key.first) + " " + std::to_string(key.second) + " " +
               std::to_string(crc) + "\n";
    test::publish(dir / ("params." + std::to_string(rank)), lines);
    const std::string what = e.what();
    if (mode == "pipeline-sizes")
      return what.find("elements") != std::string::npos ? expected_failure : 1;
    const bool kind = e.code() == errc::peer_failure || e.code() == errc::timeout;
    return kind && what.find("rank 2") != std::string::npos ? expected_failure : 1;
  }
  std::printf("rank %d: the job never failed\n", rank);
  return 1;
}

// The reference of pipeline-kill: the same job by p threads over the in-process transport
// (the pipeline's results do not depend on the backend). Every rank's record must agree.
test::param_record reference_job(int p) {
  std::vector<test::param_record> records(static_cast<std::size_t>(p));
  run_in_process(p, [&](in_process_transport& t) {
    const int r = t.rank();
    test::train_job(t, job_steps, records[static_cast<std::size_t>(r)]);
  });
  for (const auto& r : records)
    if (r != records[0]) throw std::runtime_error("the reference ranks disagree");
  return records[0];
}

// Each survivor's tensors hold exactly a step that the reference also reached: the failure
// applied nothing of a partial exchange. Returns the number of wrong ranks.
int check_survivor_params(const fs::path& dir, int p, const test::param_record& reference) {
  int bad = 0;
  for (int r = 0; r < p; ++r) {
    if (r == 2) continue;
    const auto path = dir / ("params." + std::to_string(r));
    std::istringstream in(fs::exists(path) ? test::await_file(path, test::steady::now()) : "");
    std::size_t tensors = 0;
    std::string steps;
    bool ok = true;
    std::size_t t = 0;
    std::int64_t step = 0;
    std::uint64_t crc = 0;
    while (in >> t >> step >> crc) {
      ++tensors;
      steps += (steps.empty() ? "" : ",") + std::to_string(step);
      const auto it = reference.find({t, step});
      if (it == reference.end() || it->second != static_cast<std::uint32_t>(crc)) ok = false;
    }
    ok = ok && tensors == test::job_sizes.size();
    std::printf("pipeline-kill: rank %d holds, per tensor, the parameters of steps %s: %s\n", r,
                steps.c_str(), ok ? "each equal to the reference's" : "NOT the reference's");
    bad += ok ? 0 : 1;
  }
  return bad;
}

int run_worker(const std::string& mode, const fs::path& dir, int rank, int p) {
  if (mode == "malformed" && rank == 2) return run_rogue(dir, rank, p);
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
  auto peers = zmq_peer_list::from_environment();
  zmq_options opt{.connect_timeout = 30s};
  if (mode == "freeze") {
    opt.heartbeat_interval = 200ms;
    opt.heartbeat_timeout = 1000ms;
  }
  if (mode == "world") {
    // Rank 1 believes the world has 3 ranks: every rank must refuse to start, none may hang.
    opt.connect_timeout = 5s;
    if (rank == 1) peers.endpoints.resize(3);
    try {
      zmq_transport t(std::move(listener), peers.rank, peers.endpoints, opt);
      std::printf("rank %d: a world of mixed sizes started\n", rank);
      return 1;
    } catch (const error& e) {
      std::printf("rank %d: refused to start as expected: %s\n", rank, e.what());
      const std::string what = e.what();
      // Every rank learns the reason, rank 3 too (which rank 1 does not know) from the ranks
      // that found the mismatch, before the connect timeout.
      const bool clear =
          e.code() == errc::peer_failure && what.find("belongs to a world of") != std::string::npos;
      return clear ? expected_failure : 1;
    }
  }
  zmq_transport t(std::move(listener), peers.rank, peers.endpoints, opt);
  if (mode == "scenarios") {
    test::run_all_scenarios(t, std::size_t{1} << 20, 21);
    std::printf("rank %d: scenarios passed\n", rank);
    return 0;
  }
  if (mode == "pipeline-kill" || mode == "pipeline-sizes")
    return run_pipeline_worker(mode, dir, rank, std::move(t));
  if ((mode == "kill-allgather" || mode == "kill-allreduce") && rank == 2) {
    test::dies_on_send<zmq_transport> dying(t);
    return exchange_until_failure(dying, mode, dir, rank, p, &dying);
  }
  return exchange_until_failure(t, mode, dir, rank, p, nullptr);
}

// ---------------------------------------------------------------- supervisor
int run_processes(const char* self, const std::string& mode, int p) {
  test::temp_dir dir;
  const test::param_record reference =
      mode == "pipeline-kill" ? reference_job(p) : test::param_record{};
  std::vector<test::child> kids(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    kids[static_cast<std::size_t>(r)].pid = test::spawn(
        {self, "worker", mode, dir.path.string(), std::to_string(r), std::to_string(p)});
  }
  const auto start = test::steady::now();
  auto fault_at = start;
  // Rank 2 is the one that dies (or is ended by the supervisor), except where the whole world
  // is wrong (world, sizes) or rank 2 only stalls.
  const bool rank2_dies = mode == "kill" || mode == "freeze" || mode == "kill-allgather" ||
                          mode == "kill-allreduce" || mode == "malformed" ||
                          mode == "pipeline-kill";
  if (mode != "scenarios" && mode != "world") {
    // Inject the fault once every rank is exchanging (the rogue of "malformed" only waits).
    for (int r = 0; r < p; ++r) {
      if (mode == "malformed" && r == 2) continue;
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
  if (mode == "freeze" || mode == "malformed") {
    // Everyone but rank 2 (frozen, or the rogue that stays connected) must end on its own;
    // then rank 2 is killed.
    std::vector<test::child> rest;
    for (int r = 0; r < p; ++r) {
      if (r != 2) rest.push_back(kids[static_cast<std::size_t>(r)]);
    }
    ok = test::wait_all(rest, fault_at + bound);
    kill(kids[2].pid, SIGKILL);
    std::vector<test::child> held{kids[2]};
    test::wait_all(held, test::steady::now() + 10s);
    for (int r = 0, k = 0; r < p; ++r) {
      if (r != 2) kids[static_cast<std::size_t>(r)] = rest[static_cast<std::size_t>(k++)];
    }
    kids[2] = held[0];
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
    } else if (r == 2 && rank2_dies) {
      bad += WIFSIGNALED(*k.status) ? 0 : 1;
    } else {
      bad += code == expected_failure ? 0 : 1;
    }
    // A rank that died in the middle of a collective: every survivor failed in that
    // collective of that round, none took the partial exchange for a complete one.
    if ((mode == "kill-allgather" || mode == "kill-allreduce") && r != 2) {
      const auto path = dir.path / ("failed." + std::to_string(r));
      const std::string want = mode == "kill-allgather" ? "3 allgather" : "3 allreduce";
      const std::string got = fs::exists(path) ? test::await_file(path, test::steady::now()) : "";
      if (got != want) {
        std::printf("%s: rank %d failed in '%s', expected '%s'\n", mode.c_str(), r, got.c_str(),
                    want.c_str());
        ++bad;
      }
    }
  }
  if (mode == "pipeline-kill") bad += check_survivor_params(dir.path, p, reference);
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
    const std::vector<std::string> faults{
        "kill",      "freeze", "stall", "kill-allgather", "kill-allreduce",
        "malformed", "world",  "sizes", "pipeline-kill",  "pipeline-sizes"};
    if ((mode == "processes" || std::find(faults.begin(), faults.end(), mode) != faults.end()) &&
        argc == 3) {
      const std::string self = fs::read_symlink("/proc/self/exe").string();
      return run_processes(self.c_str(), mode == "processes" ? "scenarios" : mode,
                           std::atoi(argv[2]));
    }
    std::fprintf(stderr,
                 "usage: %s threads | garbage | processes N | kill N | freeze N | stall N |\n"
                 "       kill-allgather N | kill-allreduce N | malformed N | world N | sizes N |\n"
                 "       pipeline-kill N | pipeline-sizes N\n",
                 argv[0]);
    return 2;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
