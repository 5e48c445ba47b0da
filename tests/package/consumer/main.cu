// SPDX-License-Identifier: Apache-2.0
// The component's include paths, flags and link; what every header compiles to is checked by
// tests/headers, so this includes only what it uses (the umbrella alone is ~40 s of nvcc).
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/float16.hpp>

#include <cstdio>

__global__ void halve(const float* in, stellatrain::fp16* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = stellatrain::fp16{in[i] * 0.5f};
}

int main() {
  if (stellatrain::cuda_device_count() == 0) {
    std::puts("cuda component usable; no CUDA device to run on");
    return 0;
  }
  float* in = nullptr;
  stellatrain::fp16* out = nullptr;
  STELLATRAIN_CUDA_CHECK(cudaMalloc(&in, sizeof(float)));
  STELLATRAIN_CUDA_CHECK(cudaMalloc(&out, sizeof(stellatrain::fp16)));
  const float three = 3.0f;
  STELLATRAIN_CUDA_CHECK(cudaMemcpy(in, &three, sizeof three, cudaMemcpyHostToDevice));
  halve<<<1, 32>>>(in, out, 1);
  STELLATRAIN_CUDA_CHECK(cudaGetLastError());
  stellatrain::fp16 result;
  STELLATRAIN_CUDA_CHECK(cudaMemcpy(&result, out, sizeof result, cudaMemcpyDeviceToHost));
  cudaFree(in);
  cudaFree(out);
  std::printf("1.5 == %g\n", static_cast<double>(static_cast<float>(result)));
  return static_cast<float>(result) == 1.5f ? 0 : 1;
}
