// SPDX-License-Identifier: Apache-2.0
// Uses the mpi component: one rank (an MPI singleton) gathers its own message.
#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/mpi.hpp>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  stellatrain::mpi_environment env(argc, argv);
  stellatrain::mpi_transport t;
  const std::vector<std::byte> mine(100, std::byte{7});
  std::vector<stellatrain::message_buffer> got(static_cast<std::size_t>(t.size()));
  stellatrain::sparse_allgather(t, mine, got);
  stellatrain::barrier(t);
  std::printf("mpi component: %d rank(s), %zu bytes gathered\n", t.size(), got[0].size());
  return got[0].size() == 100 ? 0 : 1;
}
