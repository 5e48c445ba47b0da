// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the benchmarks: pre-faulted inputs, one thread pool per thread count (made
// once, outside any timed region), and a split of a range into one contiguous piece per thread.
#pragma once

#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>

namespace stellatrain::bench {

/// 25M fp32 elements: the tensor size of the reference measurements.
inline constexpr std::int64_t n25m = 25'000'000;

/// A pool with exactly `threads` workers, created on first use and kept for the process.
inline thread_pool& pool(std::size_t threads) {
  static std::mutex m;
  static std::map<std::size_t, std::unique_ptr<thread_pool>> pools;
  std::lock_guard lock(m);
  auto& p = pools[threads];
  if (!p) p = std::make_unique<thread_pool>(threads);
  return *p;
}

/// `count` elements, every page touched before return.
template <class T>
aligned_buffer<T> prefaulted(std::size_t count) {
  return aligned_buffer<T>(count, {.prefault = true}, pool(2));
}

/// `count` floats from N(0, 1), pre-faulted.
inline aligned_buffer<float> gaussian(std::size_t count, std::uint64_t seed = 1) {
  auto b = prefaulted<float>(count);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (auto& x : b) x = dist(rng);
  return b;
}

/// Calls `fn(begin, end)` once per thread on contiguous pieces of `[0, n)` whose starts are
/// multiples of `align`; a single thread runs inline without the pool.
template <class Fn>
void split_per_thread(std::size_t threads, std::size_t n, std::size_t align, Fn&& fn) {
  if (threads <= 1) {
    fn(std::size_t{0}, n);
    return;
  }
  std::size_t piece = (n + threads - 1) / threads;
  piece = (piece + align - 1) / align * align;
  pool(threads).bulk(threads, [&](std::size_t t) {
    const std::size_t begin = std::min(n, t * piece);
    const std::size_t end = std::min(n, begin + piece);
    if (begin < end) fn(begin, end);
  });
}

}  // namespace stellatrain::bench
