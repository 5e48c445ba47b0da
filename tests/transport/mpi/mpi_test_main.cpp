// SPDX-License-Identifier: Apache-2.0
// Tests of the MPI backend, run by ctest under `mpirun -np 4 --oversubscribe`:
//   scenarios   every collective and point-to-point check, generic algorithms (with small
//               MPI blocks, so multi-block messages are exercised) and MPI's native ones
//   stall       rank 2 stalls (alive, silent) in the middle of an exchange: the others time
//               out, abort notices reach every rank, and every rank reports the failure
//   kill        rank 2 kills itself (SIGKILL) during an exchange: Open MPI ends the job; no
//               rank may report a completed exchange after it (checked by run_mpi_fault.cmake)
//   kill-allgather | kill-allreduce
//               rank 2 kills itself at its third send of that collective in round 3; checked
//               the same way
//   malformed   rank 2 sends the rank it feeds in a ring all-gather a message that is no
//               frame: every other rank fails naming rank 2, before any timeout
//   sizes       rank 1 all-reduces a tensor of another length: every rank fails saying so
// Exit status 0 on every rank: passed.
#include "../fault_injection.hpp"
#include "../scenarios.hpp"

#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/mpi.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace stellatrain;
using namespace std::chrono_literals;

int scenarios(int thread_level) {
  {
    mpi_transport t(MPI_COMM_WORLD, {.max_block_bytes = 4099});
    if (t.rank() == 0)
      std::printf("MPI thread level %d (MPI_THREAD_MULTIPLE = %d)\n", thread_level,
                  MPI_THREAD_MULTIPLE);
    test::run_all_scenarios(t, std::size_t{1} << 20, 31);
    // Several threads per rank, each with its own tag.
    std::vector<std::thread> threads;
    std::vector<int> failed(3, 0);
    for (int k = 0; k < 3; ++k) {
      threads.emplace_back([&, k] {
        try {
          for (int round = 0; round < 5; ++round) {
            test::allgather_case(
                t, [&](int r) { return static_cast<std::size_t>(1000 * k + 7 * r + round); },
                {.tag = static_cast<tag_type>(40 + k), .chunk_bytes = 512},
                static_cast<std::uint64_t>(k * 10 + round));
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "thread %d: %s\n", k, e.what());
          failed[static_cast<std::size_t>(k)] = 1;
        }
      });
    }
    for (auto& th : threads) th.join();
    for (int f : failed) {
      if (f != 0) return 1;
    }
    // Tags at and above MPI_TAG_UB are refused.
    try {
      (void)t.isend(0, 0x7FFFFFFFu, {});
      std::fprintf(stderr, "a tag above MPI_TAG_UB was accepted\n");
      return 1;
    } catch (const error& e) {
      if (e.code() != errc::invalid_argument) return 1;
    }
  }
  {
    mpi_transport t(MPI_COMM_WORLD, {.native_collectives = true, .payload_checksum = true});
    test::run_all_scenarios(t, std::size_t{1} << 20, 32);
    test::allgather_case(
        t, [](int r) { return static_cast<std::size_t>(10 + r); },
        {.algorithm = allgather_algorithm::native}, 33);
    test::allreduce_case<double>(t, 1001,
                                 {.algorithm = allreduce_algorithm::native, .average = true}, 34);
  }
  std::printf("rank: scenarios passed\n");
  return 0;
}

int stall() {
  mpi_transport t;
  const std::vector<std::byte> mine(std::size_t{1} << 16, std::byte{1});
  std::vector<message_buffer> out(static_cast<std::size_t>(t.size()));
  int result = 1;
  for (int round = 0; round < 10; ++round) {
    if (t.rank() == 2 && round == 3) std::this_thread::sleep_for(6s);  // alive but silent
    const auto t0 = std::chrono::steady_clock::now();
    try {
      sparse_allgather(t, mine, out,
                       {.tag = 1,
                        .timeout = 2000ms,
                        .algorithm = allgather_algorithm::ring,
                        .chunk_bytes = 4096});
    } catch (const error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("rank %d: failed as expected in round %d after %.2f s: %s\n", t.rank(), round, s,
                  e.what());
      const bool kind = e.code() == errc::timeout || e.code() == errc::peer_failure;
      result = kind && round == 3 && s < 5.0 ? 0 : 1;
      break;
    }
  }
  if (result != 0) std::printf("rank %d: the stall was not reported as it should\n", t.rank());
  // Leave together on the application's own communicator.
  MPI_Barrier(MPI_COMM_WORLD);
  return result;
}

int kill_rank() {
  mpi_transport t;
  const std::vector<std::byte> mine(std::size_t{1} << 20,
                                    std::byte{static_cast<unsigned char>(t.rank())});
  std::vector<message_buffer> out(static_cast<std::size_t>(t.size()));
  for (int round = 0; round < 1000; ++round) {
    if (t.rank() == 2 && round == 5) {
      std::printf("rank 2: killing itself during round %d\n", round);
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    sparse_allgather(
        t, mine, out,
        {.tag = 1, .timeout = 30s, .algorithm = allgather_algorithm::ring, .chunk_bytes = 65536});
    if (round >= 5)
      std::printf("rank %d: exchange completed after the kill (round %d)\n", t.rank(), round);
    std::fflush(stdout);
  }
  return 1;
}

// Rank 2 kills itself at its third send of `what` (the all-gather or the all-reduce) in round
// 3: Open MPI ends the job; no rank may report that collective of a round >= 3 as completed
// (checked by run_mpi_fault.cmake).
int kill_in(const std::string& what) {
  mpi_transport t;
  test::dies_on_send<mpi_transport> dying(t);
  const int rank = t.rank();
  const std::vector<std::byte> mine(std::size_t{1} << 20,
                                    std::byte{static_cast<unsigned char>(rank)});
  std::vector<message_buffer> out(static_cast<std::size_t>(t.size()));
  std::vector<float> grad(std::size_t{1} << 18, 1.0f);
  auto round_of = [&](auto& tr, int round) {
    sparse_allgather(
        tr, mine, out,
        {.tag = 1, .timeout = 30s, .algorithm = allgather_algorithm::ring, .chunk_bytes = 65536});
    if (round >= 3 && what == "allgather")
      std::printf("rank %d: exchange completed after the kill (round %d)\n", rank, round);
    dense_allreduce(tr, std::span<float>(grad), {.tag = 2, .timeout = 30s, .chunk_bytes = 65536});
    if (round >= 3 && what == "allreduce")
      std::printf("rank %d: exchange completed after the kill (round %d)\n", rank, round);
    std::fflush(stdout);
  };
  for (int round = 0; round < 1000; ++round) {
    if (rank == 2) {
      if (round == 3) dying.die_at_send(what == "allgather" ? 1 : 2, 3);
      round_of(dying, round);
    } else {
      round_of(t, round);
    }
  }
  return 1;
}

// Every rank but rank 2 fails, within the bound and before any timeout, with an error that
// names it; then all leave together through a barrier of the application's communicator.
int leave(mpi_transport& t, bool ok) {
  if (!ok) std::printf("rank %d: the fault was not reported as it should\n", t.rank());
  std::fflush(stdout);
  MPI_Barrier(MPI_COMM_WORLD);
  return ok ? 0 : 1;
}

// Rank 2 sends, in round 3 of a ring all-gather, a message that is no frame (no magic) to the
// rank that receives from it, on the collective's tag of the transport's own communicator.
// That rank must reject it as malformed; the others learn it from its abort.
int malformed() {
  mpi_transport t;
  const std::vector<std::byte> mine(std::size_t{1} << 16, std::byte{1});
  std::vector<message_buffer> out(static_cast<std::size_t>(t.size()));
  for (int round = 0; round < 10; ++round) {
    if (t.rank() == 2 && round == 3) {
      // As long as a frame with the 8-byte length the receiver waits for, so that only its
      // header can give it away.
      char junk[40] = "this is not a stellatrain frame........";
      MPI_Send(junk, sizeof junk, MPI_BYTE, 3, 1, t.communicator());
      std::printf("rank 2: sent a malformed frame to rank 3\n");
      return leave(t, true);
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      sparse_allgather(
          t, mine, out,
          {.tag = 1, .timeout = 30s, .algorithm = allgather_algorithm::ring, .chunk_bytes = 4096});
    } catch (const error& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("rank %d: failed as expected in round %d after %.2f s: %s\n", t.rank(), round, s,
                  e.what());
      const std::string what = e.what();
      const bool kind = e.code() == errc::malformed_message || e.code() == errc::peer_failure;
      const bool named = what.find("rank 2") != std::string::npos &&
                         what.find("does not start with the magic") != std::string::npos;
      return leave(t, kind && named && round == 3 && s < 10.0);
    }
  }
  return leave(t, false);
}

// Rank 1 all-reduces a tensor of another length: every rank fails with an error that says
// what differs (directly or through an abort that quotes it).
int sizes() {
  mpi_transport t;
  std::vector<float> grad((std::size_t{1} << 18) - (t.rank() == 1 ? 100 : 0), 1.0f);
  try {
    dense_allreduce(t, std::span<float>(grad), {.tag = 2, .timeout = 30s});
  } catch (const error& e) {
    std::printf("rank %d: failed as expected: %s\n", t.rank(), e.what());
    const bool kind = e.code() == errc::size_mismatch || e.code() == errc::peer_failure;
    return leave(t, kind && std::string(e.what()).find("elements of") != std::string::npos);
  }
  return leave(t, false);
}

}  // namespace

int main(int argc, char** argv) {
  mpi_environment env(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "scenarios") return scenarios(env.thread_level());
    if (mode == "stall") return stall();
    if (mode == "kill") return kill_rank();
    if (mode == "kill-allgather") return kill_in("allgather");
    if (mode == "kill-allreduce") return kill_in("allreduce");
    if (mode == "malformed") return malformed();
    if (mode == "sizes") return sizes();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fprintf(stderr,
               "usage: mpirun -np 4 %s scenarios | stall | kill | kill-allgather | "
               "kill-allreduce | malformed | sizes\n",
               argv[0]);
  return 2;
}
