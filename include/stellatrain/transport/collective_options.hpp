// SPDX-License-Identifier: Apache-2.0
// The options of the collectives and their algorithm enums, apart from the algorithms: the
// backends with native collectives (MPI, NCCL) take them without the generic collectives.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/concept.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace stellatrain {

/// How `sparse_allgather` moves the messages.
enum class allgather_algorithm {
  automatic,  ///< the backend's native collective where it offers (and enables) one, else
              ///< direct for up to `direct_max_ranks` ranks (default 2), else ring
  ring,       ///< P-1 steps to the right neighbour, pipelined in chunks of `chunk_bytes`
  direct,     ///< every rank sends its message to every other rank at once (one step)
  native,     ///< the backend's own collective (e.g. MPI_Allgatherv); `errc::unsupported`
              ///< where there is none
};

/// Options of `sparse_allgather`. Every rank must pass the same values (except `timeout`).
struct allgather_options {
  tag_type tag = 0;                           ///< tag of every message of the call
  std::chrono::milliseconds timeout{60'000};  ///< bound on the whole call
  allgather_algorithm algorithm = allgather_algorithm::automatic;
  /// Ring pipelining unit; 0 = whole messages; `auto_chunk_bytes`: the transport's choice
  std::size_t chunk_bytes = auto_chunk_bytes;
  /// `automatic`: direct up to this many ranks, ring above (see `allgather_algorithm`)
  int direct_max_ranks = 2;
  /// Longer announced lengths are errors (before anything is allocated).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  bool abort_on_failure = true;  ///< on failure, abort the transport (every rank fails now)
};

/// How `dense_allreduce` moves the data.
enum class allreduce_algorithm {
  automatic,  ///< the backend's native collective where it offers one, else ring
  ring,       ///< reduce-scatter + all-gather around the ring, pipelined in chunks
  native,     ///< the backend's own (MPI_Allreduce, ncclAllReduce); `errc::unsupported` else
};

/// Options of `dense_allreduce`. Every rank must pass the same values (except `timeout`).
struct allreduce_options {
  tag_type tag = 0;                           ///< tag of every message of the call
  std::chrono::milliseconds timeout{60'000};  ///< bound on the whole call
  allreduce_algorithm algorithm = allreduce_algorithm::automatic;
  /// Pipelining unit; 0 = whole segments; `auto_chunk_bytes`: the transport's choice
  std::size_t chunk_bytes = auto_chunk_bytes;
  bool average = false;          ///< divide the sum by the number of ranks (floating point)
  bool abort_on_failure = true;  ///< on failure, abort the transport (every rank fails now)
};

/// Options of `barrier`.
struct barrier_options {
  tag_type tag = 0;                           ///< tag of every message of the call
  std::chrono::milliseconds timeout{60'000};  ///< bound on the whole call
  bool abort_on_failure = true;  ///< on failure, abort the transport (every rank fails now)
};

/// Options of `broadcast`. Every rank must pass the same values (except `timeout`).
struct broadcast_options {
  tag_type tag = 0;                           ///< tag of every message of the call
  std::chrono::milliseconds timeout{60'000};  ///< bound on the whole call
  /// Pipelining unit; 0 = whole message; `auto_chunk_bytes`: the transport's choice
  std::size_t chunk_bytes = auto_chunk_bytes;
  /// Longer announced lengths are errors (before anything is allocated).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  bool abort_on_failure = true;  ///< on failure, abort the transport (every rank fails now)
};

}  // namespace stellatrain
