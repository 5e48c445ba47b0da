// SPDX-License-Identifier: Apache-2.0
// Device and pinned host buffers, a stream, and the round trip of a selection, for the GPU
// selection tests.
#pragma once

#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/selection_layout.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

namespace stellatrain::test {

template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t n) : size_(n) {
    if (n != 0) STELLATRAIN_CUDA_CHECK(cudaMalloc(&ptr_, n * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& host) : device_buffer(host.size()) { upload(host); }
  ~device_buffer() { cudaFree(ptr_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  void upload(const std::vector<T>& host) {
    if (!host.empty())
      STELLATRAIN_CUDA_CHECK(
          cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> out(size_);
    if (size_ != 0)
      STELLATRAIN_CUDA_CHECK(
          cudaMemcpy(out.data(), ptr_, size_ * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  [[nodiscard]] T* get() const { return ptr_; }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::span<std::byte> bytes() const {
    return {reinterpret_cast<std::byte*>(ptr_), size_ * sizeof(T)};
  }

 private:
  T* ptr_ = nullptr;
  std::size_t size_;
};

class pinned_bytes {
 public:
  explicit pinned_bytes(std::size_t n) : size_(n) {
    STELLATRAIN_CUDA_CHECK(cudaMallocHost(&ptr_, n == 0 ? 1 : n));
  }
  ~pinned_bytes() { cudaFreeHost(ptr_); }
  pinned_bytes(const pinned_bytes&) = delete;
  pinned_bytes& operator=(const pinned_bytes&) = delete;
  [[nodiscard]] std::span<std::byte> span() const { return {static_cast<std::byte*>(ptr_), size_}; }

 private:
  void* ptr_ = nullptr;
  std::size_t size_;
};

class stream {
 public:
  stream() { STELLATRAIN_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~stream() { cudaStreamDestroy(s_); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  [[nodiscard]] cudaStream_t get() const { return s_; }
  void sync() const { STELLATRAIN_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
};

/// What one device-to-host copy of a selection brought, checked by read_selection.
template <class Value, class Index>
struct host_selection {
  selection_header header{};
  std::vector<std::uint64_t> indices;
  std::vector<Value> values;
};

template <class Value, class Index>
host_selection<Value, Index> fetch_selection(std::span<const std::byte> device_out,
                                             std::size_t bytes, const stream& s) {
  pinned_bytes host(bytes);
  STELLATRAIN_CUDA_CHECK(cudaMemcpyAsync(host.span().data(), device_out.data(), bytes,
                                         cudaMemcpyDeviceToHost, s.get()));
  s.sync();
  host_selection<Value, Index> out;
  out.header = read_selection_header(host.span());
  const auto view = read_selection<Value, Index>(host.span());
  out.indices.assign(view.indices().begin(), view.indices().end());
  out.values.assign(view.values().begin(), view.values().end());
  return out;
}

template <class T>
std::vector<T> random_normal(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<T> x(n);
  for (auto& v : x) v = from_float<T>(dist(rng));
  return x;
}

template <class T>
std::uint32_t raw_bits(T v) {
  if constexpr (sizeof(T) == 4) {
    std::uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
  } else {
    return v.bits();
  }
}

}  // namespace stellatrain::test
