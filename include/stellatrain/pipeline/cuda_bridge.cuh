// SPDX-License-Identifier: Apache-2.0
// The GPU side of the pipeline: selection with error feedback on the device, one
// device-to-host copy of the packed selection per tensor, and the upload of updated
// parameters (the changed elements scattered, or the whole tensor), all on the caller's stream.
#pragma once

#include <stellatrain/compress/error_feedback_cuda.cuh>
#include <stellatrain/config.hpp>
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/select/selection_layout.hpp>
#include <stellatrain/select/selection_scatter.cuh>
#include <stellatrain/select/topk_cuda.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace stellatrain {

/// Settings of a `cuda_gradient_bridge`.
struct cuda_bridge_options {
  /// The largest density the bridge sizes its buffers for (the pipeline's policy must stay
  /// at or below it; a larger request throws `errc::out_of_range`).
  double max_density = 0.1;
  /// Tensors of at most this many elements send every element (as the pipeline's option).
  std::uint64_t send_all_below = 0;
  topk_cuda_options selection{};
};

/// Connects a `pipeline` to gradients and parameters in GPU memory. Construct it after
/// `pipeline::start` (it sizes its buffers by the tensors and the number of ranks).
///
/// Per tensor the bridge owns, allocated once at construction: the fp32 error-feedback residual
/// on the device, the selection's device workspace and output, and a pinned host buffer of
/// the same layout (`selection_layout.hpp`), plus a pinned staging buffer for parameters
/// (4 bytes per element) and, when the pipeline records updates, a device buffer for the
/// changed elements (at most the bytes of the tensor in the recorded precision).
///
/// - `push_device_gradient(t, grad, stream)`: acc = grad + residual, exact top-k of |acc| on
///   the device (`error_feedback_topk`, k from the pipeline's next density), one
///   device-to-host copy of the selection, then `pipeline::push_selection`. It synchronises
///   `stream` once (the pipeline needs the bytes on the host); nothing else waits.
/// - `upload_params(t, device_params, stream)`: after `wait_for_forward`, brings the tensor's
///   parameters on the device (float, fp16 or bf16) up to date, ordered on `stream`. When the
///   pipeline records updates in that precision (its `Record` parameter) and the
///   device copy is at most two steps behind, only the changed elements travel (one
///   host-to-device copy of indices and values, then `scatter_values`); otherwise the whole
///   tensor (one host-to-device copy through the pinned staging buffer). The bridge tracks
///   which version each device copy holds: keep one device copy per tensor, and call
///   `forget_upload(t)` when something else writes it.
///
/// The residual of a GPU-selected tensor lives here, not in the pipeline's compressor, so
/// pipeline checkpoints do not hold it (save it with `residual(t)` if needed).
///
/// \code
///   stellatrain::cuda_gradient_bridge bridge(pipe, {.max_density = 0.05});
///   // after backward produced tensor t's gradient on `stream`:
///   bridge.push_device_gradient(t, d_grad[t], stellatrain::cuda_stream{stream});
///   // before the next forward:
///   pipe.wait_for_forward(pipe.bucket_of(t));
///   bridge.upload_params(t, d_param[t], stellatrain::cuda_stream{stream});  // float*, fp16* or
///   bf16*
/// \endcode
template <class Pipeline>
class cuda_gradient_bridge {
  using value_t = typename Pipeline::compressor_type::value_type;
  using index_t = typename Pipeline::compressor_type::index_type;

 public:
  cuda_gradient_bridge(Pipeline& p, cuda_bridge_options options = {})
      : pipeline_(p), options_(options) {
    if (!(options_.max_density > 0 && options_.max_density <= 1)) {
      throw_error(errc::invalid_argument, "cuda_gradient_bridge: max_density must be in (0, 1]");
    }
    try {
      for (std::size_t t = 0; t < p.tensor_count(); ++t) {
        tensor_buffers& b =
            buffers_.emplace_back();  // released by release() if a step below throws
        b.n = p.tensor_size(t);
        b.max_k = b.n <= options_.send_all_below
                      ? b.n
                      : std::min<std::uint64_t>(
                            b.n, static_cast<std::uint64_t>(
                                     std::ceil(options_.max_density * static_cast<double>(b.n))) +
                                     1);
        b.out_bytes = topk_output_bytes<value_t, index_t>(b.n, b.max_k);
        b.workspace_bytes = error_feedback_workspace_bytes(b.n, b.max_k, options_.selection);
        STELLATRAIN_CUDA_CHECK(cudaMalloc(&b.residual, b.n * sizeof(float)));
        STELLATRAIN_CUDA_CHECK(cudaMemset(b.residual, 0, b.n * sizeof(float)));
        STELLATRAIN_CUDA_CHECK(cudaMalloc(&b.device_out, b.out_bytes));
        STELLATRAIN_CUDA_CHECK(cudaMalloc(&b.workspace, b.workspace_bytes));
        STELLATRAIN_CUDA_CHECK(cudaMallocHost(&b.host_out, b.out_bytes));
        STELLATRAIN_CUDA_CHECK(cudaMallocHost(&b.host_params, b.n * sizeof(float)));
        b.change_capacity = change_capacity(b);
        if (b.change_capacity > 0) {
          STELLATRAIN_CUDA_CHECK(cudaMalloc(
              &b.device_changes, b.change_capacity * (sizeof(index_t) + recorded_bytes())));
        }
      }
    } catch (...) {
      release();
      throw;
    }
  }

  cuda_gradient_bridge(const cuda_gradient_bridge&) = delete;
  cuda_gradient_bridge& operator=(const cuda_gradient_bridge&) = delete;
  ~cuda_gradient_bridge() { release(); }

  /// Selects from `device_grad` (n floats, device memory) with error feedback and hands the
  /// selection to the pipeline. Ordered after prior work on `ctx.stream`; returns once the
  /// selection is on the host.
  void push_device_gradient(std::size_t t, const float* device_grad, cuda_stream ctx) {
    tensor_buffers& b = buffer_of(t);
    const double density = pipeline_.next_density();
    std::uint64_t k =
        b.n <= options_.send_all_below
            ? b.n
            : static_cast<std::uint64_t>(std::ceil(density * static_cast<double>(b.n)));
    k = std::min(b.n, std::max<std::uint64_t>(k, pipeline_.options().min_k));
    if (k > b.max_k) {
      throw_error(errc::out_of_range, "cuda_gradient_bridge: tensor " + std::to_string(t) +
                                          " needs k = " + std::to_string(k) +
                                          ", the buffers hold " + std::to_string(b.max_k) +
                                          " (raise max_density)");
    }
    error_feedback_topk<index_t, value_t>(
        ctx, device_grad, b.residual, b.n, k,
        std::span<std::byte>(static_cast<std::byte*>(b.device_out), b.out_bytes),
        std::span<std::byte>(static_cast<std::byte*>(b.workspace), b.workspace_bytes),
        options_.selection);
    const std::size_t bytes = topk_output_bytes<value_t, index_t>(b.n, k);
    STELLATRAIN_CUDA_CHECK(
        cudaMemcpyAsync(b.host_out, b.device_out, bytes, cudaMemcpyDeviceToHost, ctx.stream));
    STELLATRAIN_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    const auto selection = read_selection<value_t, index_t>(
        std::span<const std::byte>(static_cast<const std::byte*>(b.host_out), bytes),
        "GPU selection");
    pipeline_.push_selection(t, selection);
  }

  /// Brings tensor t's parameters at `device_params` (n values of `Param`: float, fp16 or
  /// bf16) up to date with the pipeline, ordered on `ctx.stream`: the changed elements only
  /// where the pipeline keeps them in `Param`'s precision, else the whole tensor. Returns once
  /// the copies are issued (the staging buffers are reused after a synchronisation of the
  /// stream at the next upload of the same tensor). Returns what travelled.
  template <class Param>
  param_changes_kind upload_params(std::size_t t, Param* device_params, cuda_stream ctx) {
    static_assert(value_type<Param>, "upload_params: parameters are float, fp16 or bf16");
    tensor_buffers& b = buffer_of(t);
    if (b.uploading) {
      STELLATRAIN_CUDA_CHECK(cudaStreamSynchronize(b.upload_stream));
      b.uploading = false;
    }
    if constexpr (std::is_same_v<typename Pipeline::record_type, Param>) {
      if (b.change_capacity > 0) {
        if (const auto kind = upload_changes(b, t, device_params, ctx)) return *kind;
      }
    }
    b.held = param_version{};
    const param_version v =
        pipeline_.copy_params(t, std::span<Param>(static_cast<Param*>(b.host_params), b.n));
    STELLATRAIN_CUDA_CHECK(cudaMemcpyAsync(device_params, b.host_params, b.n * sizeof(Param),
                                           cudaMemcpyHostToDevice, ctx.stream));
    b.upload_stream = ctx.stream;
    b.uploading = true;
    b.held = v;
    return param_changes_kind::whole;
  }

  /// The device copy of tensor t was written elsewhere: its next upload copies it whole.
  void forget_upload(std::size_t t) { buffer_of(t).held = param_version{}; }

  /// The device residual of tensor t (n floats).
  [[nodiscard]] float* residual(std::size_t t) { return buffer_of(t).residual; }

 private:
  struct tensor_buffers {
    std::uint64_t n = 0;
    std::uint64_t max_k = 0;
    std::size_t out_bytes = 0;
    std::size_t workspace_bytes = 0;
    float* residual = nullptr;
    void* device_out = nullptr;
    void* workspace = nullptr;
    void* host_out = nullptr;
    void* host_params = nullptr;  // n * 4 bytes: parameters, or changed indices + values
    std::uint64_t change_capacity = 0;
    void* device_changes = nullptr;  // change_capacity indices, then as many values
    param_version held{};            // what the device copy holds
    cudaStream_t upload_stream = nullptr;
    bool uploading = false;
  };

  static constexpr std::size_t recorded_bytes() noexcept {
    if constexpr (Pipeline::records_updates) {
      return sizeof(typename Pipeline::record_type);
    } else {
      return 0;
    }
  }

  // The changed elements of tensor t, when the pipeline has them: none or sparse (done), or
  // nothing when the tensor must travel whole.
  template <class Param>
  std::optional<param_changes_kind> upload_changes(tensor_buffers& b, std::size_t t,
                                                   Param* device_params, cuda_stream ctx) {
    // Staging: indices first, then values, in the pinned parameter buffer.
    auto* idx = static_cast<index_t*>(b.host_params);
    auto* val = reinterpret_cast<Param*>(idx + b.change_capacity);
    const param_changes c =
        pipeline_.copy_changes(t, b.held, std::span<index_t>(idx, b.change_capacity),
                               std::span<Param>(val, b.change_capacity));
    if (c.kind == param_changes_kind::none) return c.kind;
    if (c.kind != param_changes_kind::sparse) return std::nullopt;
    auto* d_idx = static_cast<index_t*>(b.device_changes);
    auto* d_val = reinterpret_cast<Param*>(d_idx + b.change_capacity);
    b.held = param_version{};  // until the copies below are issued
    STELLATRAIN_CUDA_CHECK(
        cudaMemcpyAsync(d_idx, idx, c.count * sizeof(index_t), cudaMemcpyHostToDevice, ctx.stream));
    STELLATRAIN_CUDA_CHECK(
        cudaMemcpyAsync(d_val, val, c.count * sizeof(Param), cudaMemcpyHostToDevice, ctx.stream));
    scatter_values(ctx, d_idx, d_val, c.count, device_params, b.n);
    b.upload_stream = ctx.stream;
    b.uploading = true;
    b.held = c.version;
    return c.kind;
  }

  // Changes worth sending: fewer bytes than the whole tensor in the recorded precision (so
  // they also fit the staging buffer of n * 4 bytes), and at most what the ranks' selections
  // of two steps can change.
  std::uint64_t change_capacity(const tensor_buffers& b) const noexcept {
    if constexpr (Pipeline::records_updates) {
      const std::uint64_t by_bytes = b.n * recorded_bytes() / (sizeof(index_t) + recorded_bytes());
      const std::uint64_t by_selections =
          2 * static_cast<std::uint64_t>(pipeline_.ranks()) * b.max_k;
      return std::min(by_bytes, by_selections);
    } else {
      return 0;
    }
  }

  tensor_buffers& buffer_of(std::size_t t) {
    if (t >= buffers_.size()) {
      throw_error(errc::invalid_argument, "cuda_gradient_bridge: tensor " + std::to_string(t) +
                                              " is not registered (" +
                                              std::to_string(buffers_.size()) + " tensors)");
    }
    return buffers_[t];
  }

  void release() noexcept {
    for (auto& b : buffers_) {
      if (b.uploading) (void)cudaStreamSynchronize(b.upload_stream);
      (void)cudaFree(b.residual);
      (void)cudaFree(b.device_out);
      (void)cudaFree(b.workspace);
      (void)cudaFreeHost(b.host_out);
      (void)cudaFreeHost(b.host_params);
      (void)cudaFree(b.device_changes);
    }
    buffers_.clear();
  }

  Pipeline& pipeline_;
  cuda_bridge_options options_;
  std::vector<tensor_buffers> buffers_;
};

}  // namespace stellatrain
