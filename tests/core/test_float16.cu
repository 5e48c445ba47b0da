// SPDX-License-Identifier: Apache-2.0
// fp16/bf16 conversions in device code give the same bits as on the host (all 2^16 patterns
// and a random sample of floats), and agree with CUDA's own __float2half_rn / __float2bfloat16_rn
// for every non-NaN input.
#include <stellatrain/cuda.cuh>

#include "catch.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

struct device_results {
  std::vector<std::uint32_t> fp16_to_float;  // per 16-bit pattern
  std::vector<std::uint32_t> bf16_to_float;
  std::vector<std::uint16_t> float_to_fp16;  // per sample float
  std::vector<std::uint16_t> float_to_bf16;
  std::vector<std::uint16_t> cuda_fp16;
  std::vector<std::uint16_t> cuda_bf16;
};

__global__ void widen_all(std::uint32_t* fp16_out, std::uint32_t* bf16_out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 0x10000u) {
    const auto b = static_cast<std::uint16_t>(i);
    fp16_out[i] = __float_as_uint(stellatrain::fp16::from_bits(b).to_float());
    bf16_out[i] = __float_as_uint(stellatrain::bf16::from_bits(b).to_float());
  }
}

__global__ void narrow(const float* in, std::size_t n, std::uint16_t* fp16_out,
                       std::uint16_t* bf16_out, std::uint16_t* cuda_fp16_out,
                       std::uint16_t* cuda_bf16_out) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) {
    fp16_out[i] = stellatrain::fp16{in[i]}.bits();
    bf16_out[i] = stellatrain::bf16{in[i]}.bits();
    cuda_fp16_out[i] = __half_as_ushort(__float2half_rn(in[i]));
    cuda_bf16_out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
}

template <class T>
struct device_array {
  explicit device_array(std::size_t n) : size(n) {
    STELLATRAIN_CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T)));
  }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> out(size);
    STELLATRAIN_CUDA_CHECK(cudaMemcpy(out.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  T* ptr = nullptr;
  std::size_t size;
};

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

TEST_CASE("device conversions equal the host's", "[float16][cuda]") {
  std::mt19937_64 rng(42);
  std::vector<float> sample(std::size_t{1} << 22);
  for (auto& f : sample) {
    const auto u = static_cast<std::uint32_t>(rng());
    std::memcpy(&f, &u, sizeof f);
  }

  device_array<std::uint32_t> fp16_wide(0x10000), bf16_wide(0x10000);
  widen_all<<<0x10000 / 256, 256>>>(fp16_wide.ptr, bf16_wide.ptr);
  STELLATRAIN_CUDA_CHECK(cudaGetLastError());

  device_array<float> in(sample.size());
  device_array<std::uint16_t> h(sample.size()), b(sample.size()), ch(sample.size()),
      cb(sample.size());
  STELLATRAIN_CUDA_CHECK(
      cudaMemcpy(in.ptr, sample.data(), sample.size() * sizeof(float), cudaMemcpyHostToDevice));
  narrow<<<static_cast<unsigned>((sample.size() + 255) / 256), 256>>>(in.ptr, sample.size(), h.ptr,
                                                                      b.ptr, ch.ptr, cb.ptr);
  STELLATRAIN_CUDA_CHECK(cudaGetLastError());
  STELLATRAIN_CUDA_CHECK(cudaDeviceSynchronize());

  const auto fw = fp16_wide.to_host();
  const auto bw = bf16_wide.to_host();
  for (std::uint32_t p = 0; p < 0x10000; ++p) {
    REQUIRE(fw[p] == bits(stellatrain::fp16::from_bits(static_cast<std::uint16_t>(p)).to_float()));
    REQUIRE(bw[p] == bits(stellatrain::bf16::from_bits(static_cast<std::uint16_t>(p)).to_float()));
  }
  const auto hd = h.to_host();
  const auto bd = b.to_host();
  const auto chd = ch.to_host();
  const auto cbd = cb.to_host();
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < sample.size(); ++i) {
    const float f = sample[i];
    const bool nan = f != f;
    if (hd[i] != stellatrain::fp16{f}.bits() || bd[i] != stellatrain::bf16{f}.bits() ||
        (!nan && (hd[i] != chd[i] || bd[i] != cbd[i]))) {
      ++mismatches;
    }
  }
  REQUIRE(mismatches == 0);
}
