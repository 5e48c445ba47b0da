// SPDX-License-Identifier: Apache-2.0
// The one place that looks at CUB_VERSION: whether cub::DeviceTopK (CCCL 3.4.3 and later) is
// there, and a thin call into it. Without it everything here compiles to a constant `false`.
#pragma once

#include <stellatrain/config.hpp>

#include <cuda_runtime_api.h>
#include <cub/version.cuh>

#include <cstddef>
#include <cstdint>

// CUB_VERSION is major * 100000 + minor * 100 + patch (3.0.1 -> 300001).
#ifndef STELLATRAIN_HAS_CUB_DEVICE_TOPK
#if defined(CUB_VERSION) && CUB_VERSION >= 300403 && __has_include(<cub/device/device_topk.cuh>)
#define STELLATRAIN_HAS_CUB_DEVICE_TOPK 1
#else
#define STELLATRAIN_HAS_CUB_DEVICE_TOPK 0
#endif
#endif

#if STELLATRAIN_HAS_CUB_DEVICE_TOPK
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/device/device_topk.cuh>
#include <cuda/std/execution>
#include <cuda/stream_ref>
#endif

namespace stellatrain::detail {

/// True when this build can run the cub::DeviceTopK backend.
inline constexpr bool cub_device_topk_available = STELLATRAIN_HAS_CUB_DEVICE_TOPK != 0;

#if STELLATRAIN_HAS_CUB_DEVICE_TOPK

/// The composite key (magnitude key, then lower index first) as one u64: all keys differ, so
/// the top k of them are unique and equal to the radix select's choice whatever order or tie
/// rule cub::DeviceTopK follows. Requires n <= 2^32.
template <class T, class KeyOf>
struct composite_key_of {
  const T* x;
  KeyOf key_of;
  __host__ __device__ std::uint64_t operator()(std::uint64_t i) const {
    return (static_cast<std::uint64_t>(key_of(x[i])) << 32) |
           (0xffffffffu - static_cast<std::uint32_t>(i));
  }
};

/// cub::DeviceTopK::MaxKeys over the composite keys of x[0, n): `k` keys, unordered, into
/// `keys_out`. With `temp == nullptr` only sets `temp_bytes`.
template <class T, class KeyOf>
cudaError_t cub_topk_composite_keys(void* temp, std::size_t& temp_bytes, const T* x, KeyOf key_of,
                                    std::uint64_t n, std::uint64_t k, std::uint64_t* keys_out,
                                    cudaStream_t stream) {
  auto keys = thrust::make_transform_iterator(thrust::counting_iterator<std::uint64_t>(0),
                                              composite_key_of<T, KeyOf>{x, key_of});
  auto requirements = cuda::execution::require(cuda::execution::determinism::not_guaranteed,
                                               cuda::execution::output_ordering::unsorted);
  auto env = cuda::std::execution::env{cuda::stream_ref{stream}, requirements};
  return cub::DeviceTopK::MaxKeys(temp, temp_bytes, keys, keys_out, n, k, env);
}

#endif

}  // namespace stellatrain::detail
