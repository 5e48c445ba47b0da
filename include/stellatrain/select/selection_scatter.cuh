// SPDX-License-Identifier: Apache-2.0
// Scatter of (index, value) pairs into a dense device tensor: the way back of a selection, e.g.
// parameters updated on the host at the selected indices and copied to the device in the
// selection layout.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/select/detail/radix_select_plan.hpp>
#include <stellatrain/select/selection_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <string>

namespace stellatrain {

/// How `scatter_values` combines a value with the element it lands on.
struct scatter_options {
  /// false: param[idx] = value; true: param[idx] = param[idx] + value (in fp32, rounded once).
  bool accumulate = false;
};

namespace detail {

template <class Param, class Index, class Value>
__global__ void scatter_kernel(const Index* indices, const Value* values, std::uint64_t count,
                               Param* param, std::uint64_t n, bool accumulate,
                               unsigned long long* rejected) {
  for (std::uint64_t j = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < count; j += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t i = indices[j];
    if (i >= n) {  // never write outside the tensor
      if (rejected != nullptr) atomicAdd(rejected, 1ull);
      continue;
    }
    if (accumulate) {
      param[i] = from_float<Param>(to_float(param[i]) + to_float(values[j]));
    } else {
      param[i] = convert_value<Param>(values[j]);
    }
  }
}

template <class Param, class Index, class Value>
void launch_scatter(cudaStream_t stream, const Index* indices, const Value* values,
                    std::uint64_t count, Param* param, std::uint64_t n, bool accumulate,
                    std::uint64_t* rejected) {
  if (count == 0) return;
  const std::uint64_t blocks = (count + 255) / 256;
  scatter_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(
      indices, values, count, param, n, accumulate,
      reinterpret_cast<unsigned long long*>(rejected));
  check_cuda(cudaGetLastError(), "scatter kernel launch");
}

}  // namespace detail

/// Writes `values[j]` (converted to `Param`) to `param[indices[j]]` for j < count, on the device.
/// Indices at or past `n` are skipped (never written) and counted into `*device_rejected` when
/// that is not null. Preconditions: device pointers; indices unique (two writes to one element
/// race). Asynchronous on `ctx.stream`; O(count).
///
/// \code
///   stellatrain::scatter_values(ctx, d_idx, d_val, count, d_param_bf16, n);
/// \endcode
template <value_type Param, index_type Index, value_type Value>
void scatter_values(cuda_stream ctx, const Index* indices, const Value* values, std::uint64_t count,
                    Param* param, std::uint64_t n, const scatter_options& options = {},
                    std::uint64_t* device_rejected = nullptr) {
  if (count != 0 && (indices == nullptr || values == nullptr || param == nullptr)) {
    throw_error(errc::invalid_argument,
                "scatter_values: null pointer with " + std::to_string(count) + " pairs");
  }
  detail::launch_scatter(ctx.stream, indices, values, count, param, n, options.accumulate,
                         device_rejected);
}

/// Scatters a selection that lies in device memory in the selection layout (for example after
/// one host-to-device copy of a buffer written with `write_selection_header`,
/// `selection_indices` and `selection_values`). `header` is the host's copy of its header: it
/// is checked (magic, version, dtypes, `dense_size == n`) and supplies the count, so the device
/// header is not read back. Throws `error` (`errc::malformed_message` / `errc::size_mismatch`).
///
/// \code
///   write_selection_header<float, std::uint32_t>(host_buf, count, n);   // + indices, values
///   cudaMemcpyAsync(d_buf, host_buf.data(), bytes, cudaMemcpyHostToDevice, s);
///   stellatrain::scatter_selection(ctx, stellatrain::read_selection_header(host_buf), d_buf,
///   d_param, n);
/// \endcode
template <value_type Param>
void scatter_selection(cuda_stream ctx, const selection_header& header,
                       const std::byte* device_layout, Param* param, std::uint64_t n,
                       const scatter_options& options = {},
                       std::uint64_t* device_rejected = nullptr) {
  auto fail = [](errc code, const std::string& why) {
    throw_error(code, "scatter_selection: " + why);
  };
  if (header.magic != selection_magic) fail(errc::malformed_message, "bad magic");
  if (header.version != selection_version)
    fail(errc::version_mismatch, "layout version " + std::to_string(header.version));
  if (header.dense_size != n) {
    fail(errc::size_mismatch, "selection of a " + std::to_string(header.dense_size) +
                                  "-element tensor scattered into one of " + std::to_string(n));
  }
  if (header.count > n)
    fail(errc::malformed_message, "count " + std::to_string(header.count) + " > dense size");
  const auto index = static_cast<dtype>(header.index_dtype);
  const auto value = static_cast<dtype>(header.value_dtype);
  if (index != dtype::u32 && index != dtype::u64) {
    fail(errc::malformed_message,
         "index dtype " + std::to_string(header.index_dtype) + " is not u32 or u64");
  }
  if (value != dtype::f32 && value != dtype::f16 && value != dtype::bf16) {
    fail(errc::malformed_message,
         "value dtype " + std::to_string(header.value_dtype) + " is not f32, f16 or bf16");
  }
  if (header.index_offset != selection_index_offset() ||
      header.value_offset != selection_value_offset(header.count, index)) {
    fail(errc::malformed_message, "offsets do not match the count");
  }
  if (header.count != 0 && (device_layout == nullptr || param == nullptr))
    fail(errc::invalid_argument, "null pointer");
  const std::byte* idx = device_layout + header.index_offset;
  const std::byte* val = device_layout + header.value_offset;
  auto with_index = [&](auto index_tag) {
    using I = decltype(index_tag);
    const auto* indices = reinterpret_cast<const I*>(idx);
    switch (value) {
      case dtype::f32:
        return detail::launch_scatter(ctx.stream, indices, reinterpret_cast<const float*>(val),
                                      header.count, param, n, options.accumulate, device_rejected);
      case dtype::f16:
        return detail::launch_scatter(ctx.stream, indices, reinterpret_cast<const fp16*>(val),
                                      header.count, param, n, options.accumulate, device_rejected);
      case dtype::bf16:
        return detail::launch_scatter(ctx.stream, indices, reinterpret_cast<const bf16*>(val),
                                      header.count, param, n, options.accumulate, device_rejected);
      default:
        fail(errc::malformed_message, "value dtype " + std::to_string(header.value_dtype));
    }
  };
  switch (index) {
    case dtype::u32:
      with_index(std::uint32_t{});
      break;
    case dtype::u64:
      with_index(std::uint64_t{});
      break;
    default:
      fail(errc::malformed_message, "index dtype " + std::to_string(header.index_dtype));
  }
}

}  // namespace stellatrain
