// SPDX-License-Identifier: Apache-2.0
// CUDA error handling and the stream context type of the GPU API.
//
// Internal GPU code returns `cudaError_t`; public `.cuh` wrappers turn a failure into a
// `stellatrain::error` (`errc::cuda_error`) whose message names the call, file and line.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cuda_runtime_api.h>

#include <source_location>
#include <string>

namespace stellatrain {

/// The context argument that selects the GPU overload of an operation: work is enqueued on
/// `stream` and nothing synchronises with the host.
///
/// \code
///   cudaStream_t s;  cudaStreamCreate(&s);
///   stellatrain::cuda_stream ctx{s};
/// \endcode
struct cuda_stream {
  cudaStream_t stream = nullptr;
};

/// Throws `error(errc::cuda_error, ...)` if `status` is not `cudaSuccess`; the message holds
/// `what` (the failed call), the CUDA error name and text, and the caller's file and line.
inline void check_cuda(cudaError_t status, const char* what = "CUDA call",
                       std::source_location where = std::source_location::current()) {
  if (status == cudaSuccess) [[likely]]
    return;
  std::string message = std::string(where.file_name()) + ":" + std::to_string(where.line()) + ": " +
                        what + " failed: " + cudaGetErrorName(status) + " (" +
                        cudaGetErrorString(status) + ")";
  throw error(errc::cuda_error, message);
}

/// Number of CUDA devices this process can use; 0 when there is no device or no driver
/// (never throws: callers use it to decide whether to run GPU work at all).
[[nodiscard]] inline int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return count;
}

}  // namespace stellatrain

/// Evaluates a CUDA runtime call and throws `stellatrain::error` if it failed.
#define STELLATRAIN_CUDA_CHECK(call) ::stellatrain::check_cuda((call), #call)
