// SPDX-License-Identifier: Apache-2.0
// Four ranks as threads, linked by an emulated 100 Mbit/s WAN with 20 ms round trips: a sparse
// all-gather of 800 kB per rank (a 1% selection of 10M gradients) and a dense all-reduce of
// 1M floats, with what the metering decorator saw.
#include <stellatrain/stellatrain.hpp>

#include <chrono>
#include <cstdio>
#include <span>
#include <vector>

int main() {
  stellatrain::run_in_process(4, [](stellatrain::in_process_transport& raw) {
    // Emulate a 100 Mbit/s WAN with 20 ms RTT inside one process, and meter it.
    stellatrain::metered_transport t(stellatrain::shaped_transport(
        std::move(raw), {.bits_per_second = 100e6, .latency = std::chrono::milliseconds(10)}));
    const std::vector<std::byte> my_packed_selection(800'000, std::byte{1});
    std::vector<float> grad(1 << 20, 1.0f);

    const auto t0 = std::chrono::steady_clock::now();
    std::vector<stellatrain::message_buffer> got(static_cast<std::size_t>(t.size()));
    stellatrain::sparse_allgather(t, my_packed_selection, got, {.tag = 1});  // ring or direct
    const auto t1 = std::chrono::steady_clock::now();
    stellatrain::dense_allreduce(t, std::span<float>(grad), {.tag = 2, .average = true});
    const auto t2 = std::chrono::steady_clock::now();

    const auto s = t.snapshot();
    if (t.rank() == 0) {
      std::printf(
          "sparse all-gather of 4 x 800 kB: %.3f s; dense all-reduce of 4 MiB: %.3f s (mean "
          "%.1f)\n",
          std::chrono::duration<double>(t1 - t0).count(),
          std::chrono::duration<double>(t2 - t1).count(), static_cast<double>(grad[0]));
      std::printf("rank 0 sent %llu bytes in %llu messages at %.1f Mbit/s while sending\n",
                  static_cast<unsigned long long>(s.total.bytes_sent),
                  static_cast<unsigned long long>(s.total.messages_sent),
                  s.send_bits_per_second() / 1e6);
    }
  });
}
