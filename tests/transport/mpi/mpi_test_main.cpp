// SPDX-License-Identifier: Apache-2.0
// Tests of the MPI backend, run by ctest under `mpirun -np 4 --oversubscribe`:
//   scenarios   every collective and point-to-point check, generic algorithms (with small
//               MPI blocks, so multi-block messages are exercised) and MPI's native ones
//   stall       rank 2 stalls (alive, silent) in the middle of an exchange: the others time
//               out, abort notices reach every rank, and every rank reports the failure
//   kill        rank 2 kills itself (SIGKILL) during an exchange: Open MPI ends the job; no
//               rank may report a completed exchange after it (checked by run_mpi_fault.cmake)
// Exit status 0 on every rank: passed.
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

}  // namespace

int main(int argc, char** argv) {
  mpi_environment env(argc, argv);
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "scenarios") return scenarios(env.thread_level());
    if (mode == "stall") return stall();
    if (mode == "kill") return kill_rank();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  std::fprintf(stderr, "usage: mpirun -np 4 %s scenarios | stall | kill\n", argv[0]);
  return 2;
}
