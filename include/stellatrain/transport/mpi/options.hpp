// SPDX-License-Identifier: Apache-2.0
// The options of the MPI backend (`mpi_options`).
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace stellatrain {

/// Options of `mpi_transport`.
struct mpi_options {
  /// Use MPI's own collectives where `sparse_allgather`, `dense_allreduce` and `barrier` are
  /// called with the `automatic` (or `native`) algorithm: MPI_Iallgather + MPI_Iallgatherv
  /// (through a staging buffer, when the total fits in an int), MPI_Iallreduce,
  /// MPI_Ibarrier. Off: the generic algorithms run over point-to-point messages.
  bool native_collectives = false;
  /// Also protect every payload with a CRC32C (headers always have one).
  bool payload_checksum = false;
  /// Messages announcing more bytes are refused.
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// The collectives' default pipelining chunk on this transport (`auto_chunk_bytes`).
  /// Below Open MPI's TCP eager limit (64 KiB with headers) every chunk is sent eagerly: a
  /// larger one waits for a rendezvous handshake, one round trip each on a WAN (measured
  /// under wan-emu, 100 Mbit/s, 20 ms RTT: 256 KiB chunks gave 76%, 32 kB 88% of the link).
  std::size_t chunk_bytes = 32000;
  /// Messages are sent as blocks of at most this many bytes (MPI counts are int).
  std::size_t max_block_bytes = std::size_t{1} << 30;
  /// Waits poll MPI (which also drives its progress); between polls they sleep, starting
  /// at 1 us and doubling up to this.
  std::chrono::microseconds max_poll_sleep{200};
  /// A receive dropped after its message matched (the caller gave up on an exchange that
  /// failed elsewhere) still writes into the caller's memory until it completes; its sender has
  /// the message under way, so the drop waits for it, at most this long (see `mpi_request`).
  std::chrono::milliseconds drop_wait{10000};
};

}  // namespace stellatrain
