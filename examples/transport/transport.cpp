// SPDX-License-Identifier: Apache-2.0
// Four ranks as threads, linked by an emulated 100 Mbit/s WAN with 20 ms round trips: a sparse
// all-gather of 800 kB per rank (a 1% selection of 10M gradients) and a dense all-reduce of
// 1M floats, with what the metering decorator saw. The README's "Transports" block is the
// regions "includes" and "transports".
// [includes]
#include <stellatrain/stellatrain.hpp>  // in-process backend, collectives, decorators
// Other backends, each with its own header and target:
// #include <stellatrain/transport/zmq.hpp>   // ZeroMQ (target stellatrain::zmq)
// #include <stellatrain/transport/mpi.hpp>   // MPI    (target stellatrain::mpi)
// #include <stellatrain/transport/nccl.cuh>  // NCCL   (target stellatrain::nccl)
// [includes]

#include <chrono>
#include <cstdio>
#include <span>
#include <vector>

int main() {
  stellatrain::traffic_snapshot seen;  // rank 0's
  const auto start = std::chrono::steady_clock::now();
  // [transports]
  stellatrain::run_in_process(4, [&](stellatrain::in_process_transport& raw) {
    // Emulate a 100 Mbit/s WAN with 20 ms RTT inside one process, and meter it.
    stellatrain::metered_transport t(stellatrain::shaped_transport(
        std::move(raw), {.bits_per_second = 100e6, .latency = std::chrono::milliseconds(10)}));
    const std::vector<std::byte> my_packed_selection(800'000, std::byte{1});
    std::vector<float> grad(1 << 20, 1.0f);
    std::vector<stellatrain::message_buffer> got(static_cast<std::size_t>(t.size()));
    stellatrain::sparse_allgather(t, my_packed_selection, got, {.tag = 1});  // ring or direct
    stellatrain::dense_allreduce(t, std::span<float>(grad), {.tag = 2, .average = true});
    if (t.rank() == 0) seen = t.snapshot();  // bytes and messages per peer, achieved rates
  });
  // [transports]
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  std::printf("sparse all-gather of 4 x 800 kB, then dense all-reduce of 4 MiB: %.3f s\n",
              took.count());
  std::printf("rank 0 sent %llu bytes in %llu messages at %.1f Mbit/s while sending\n",
              static_cast<unsigned long long>(seen.total.bytes_sent),
              static_cast<unsigned long long>(seen.total.messages_sent),
              seen.send_bits_per_second() / 1e6);
}
