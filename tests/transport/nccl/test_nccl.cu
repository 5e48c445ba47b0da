// SPDX-License-Identifier: Apache-2.0
// The NCCL backend on the GPUs of this machine (one rank per GPU, ranks as threads; the
// in-process transport carries the unique id). Skipped without a CUDA device.
#include "catch.hpp"

#include <stellatrain/cuda.cuh>
#include <stellatrain/transport/nccl.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

using namespace stellatrain;

namespace {

int gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return std::min(n, 4);
}

// Runs fn(nccl_transport&) on one thread per GPU.
template <class Fn>
void on_every_gpu(Fn&& fn) {
  const int p = gpus();
  REQUIRE(p >= 1);
  std::atomic<int> failures{0};
  run_in_process(p, [&](in_process_transport& host) {
    check_cuda(cudaSetDevice(host.rank()));
    cudaStream_t s = nullptr;
    check_cuda(cudaStreamCreate(&s));
    try {
      nccl_transport t(host, s);
      fn(t);
    } catch (...) {
      ++failures;
      cudaStreamDestroy(s);
      throw;
    }
    cudaStreamDestroy(s);
  });
  CHECK(failures == 0);
}

}  // namespace

TEST_CASE("nccl: all-reduce, broadcast and barrier through the generic functions",
          "[transport][nccl]") {
  on_every_gpu([](nccl_transport& t) {
    const std::size_t n = 1 << 20;
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i)
      host[i] = static_cast<float>((i % 7) + static_cast<std::size_t>(t.rank()));
    float* dev = nullptr;
    check_cuda(cudaMalloc(&dev, n * sizeof(float)));
    check_cuda(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    dense_allreduce(t, std::span<float>(dev, n));
    check_cuda(cudaMemcpy(host.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost));
    const int p = t.size();
    for (std::size_t i = 0; i < n; i += 4099) {
      const float want = static_cast<float>(p * static_cast<int>(i % 7) + p * (p - 1) / 2);
      if (host[i] != want) throw error(errc::invalid_argument, "all-reduce result wrong");
    }
    std::vector<std::byte> bytes(1000, std::byte{static_cast<unsigned char>(t.rank() + 1)});
    check_cuda(cudaMemcpy(dev, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
    broadcast(t, 0, std::span<std::byte>(reinterpret_cast<std::byte*>(dev), bytes.size()));
    check_cuda(cudaMemcpy(bytes.data(), dev, bytes.size(), cudaMemcpyDeviceToHost));
    if (bytes[999] != std::byte{1}) throw error(errc::invalid_argument, "broadcast result wrong");
    barrier(t);
    check_cuda(cudaFree(dev));
  });
}

TEST_CASE("nccl: variable-length all-gather and point-to-point on device memory",
          "[transport][nccl]") {
  on_every_gpu([](nccl_transport& t) {
    const int p = t.size();
    const std::size_t capacity = 1 << 16;
    const std::size_t mine_n = 1000 + 17 * static_cast<std::size_t>(t.rank());
    std::byte* mine = nullptr;
    std::byte* out = nullptr;
    check_cuda(cudaMalloc(&mine, capacity));
    check_cuda(cudaMalloc(&out, capacity * static_cast<std::size_t>(p)));
    std::vector<std::byte> host(mine_n, std::byte{static_cast<unsigned char>(10 + t.rank())});
    check_cuda(cudaMemcpy(mine, host.data(), mine_n, cudaMemcpyHostToDevice));
    std::vector<std::uint64_t> lengths(static_cast<std::size_t>(p));
    auto r = t.sparse_allgather(std::span<const std::byte>(mine, mine_n), out, capacity, lengths,
                                std::chrono::seconds(30));
    wait_or_throw(r, std::chrono::seconds(30), "all-gather");
    for (int q = 0; q < p; ++q) {
      if (lengths[static_cast<std::size_t>(q)] != 1000 + 17 * static_cast<std::uint64_t>(q))
        throw error(errc::invalid_argument, "length wrong");
      std::byte last{};
      check_cuda(cudaMemcpy(
          &last,
          out + static_cast<std::size_t>(q) * capacity + lengths[static_cast<std::size_t>(q)] - 1,
          1, cudaMemcpyDeviceToHost));
      if (last != std::byte{static_cast<unsigned char>(10 + q)})
        throw error(errc::invalid_argument, "all-gather bytes wrong");
    }
    // A ring step: send right, receive from the left, together.
    const int right = (t.rank() + 1) % p;
    const int left = (t.rank() + p - 1) % p;
    nccl_request s, rr;
    t.group([&] {
      s = t.isend(right, 0, std::span<const std::byte>(mine, 1000));
      rr = t.irecv(left, 0, std::span<std::byte>(out, 1000));
    });
    wait_or_throw(s, std::chrono::seconds(30), "send");
    wait_or_throw(rr, std::chrono::seconds(30), "receive");
    std::byte first{};
    check_cuda(cudaMemcpy(&first, out, 1, cudaMemcpyDeviceToHost));
    if (first != std::byte{static_cast<unsigned char>(10 + left)})
      throw error(errc::invalid_argument, "ring step wrong");
    check_cuda(cudaFree(mine));
    check_cuda(cudaFree(out));
  });
}
