// SPDX-License-Identifier: Apache-2.0
// Fused error feedback and top-k selection on the GPU: acc = g + residual, select by |acc|,
// send the selected acc (optionally rounded to fp16/bf16), keep the rest in the residual.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/select/detail/radix_select_driver.cuh>
#include <stellatrain/select/selection_layout.hpp>
#include <stellatrain/select/topk_cuda_options.hpp>
#include <stellatrain/select/topk_threshold_state.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace stellatrain {

/// Bytes of device workspace `error_feedback_topk` needs (the selection runs on fp32 acc).
[[nodiscard]] inline std::size_t error_feedback_workspace_bytes(
    std::uint64_t n, std::uint64_t k, const topk_cuda_options& options = {}) {
  return detail::topk_workspace_layout<float>(n, k, options, "error_feedback_workspace_bytes")
      .total;
}

/// One step of top-k compression with error feedback, fused on the GPU:
///
///   acc[i]      = g[i] + residual[i]                      (in fp32)
///   selected    = exact top min(k, n) of |acc|            (semantics of `select_topk`)
///   sent[j]     = Out(acc[idx[j]])                        (rounded to nearest even)
///   residual[i] = acc[i] - sent  for selected i           (0 when Out is float)
///   residual[i] = acc[i]         for the others
///
/// The selection goes to `device_out` in the selection layout (indices ascending, values of
/// type `Out`). A non-finite rounding error (acc NaN or infinite, or too large for `Out`) is
/// not fed back: that residual becomes 0 and the non-finite value is sent.
///
/// Passes: the first reads g and residual and writes acc into the residual; the radix passes
/// then read acc; the compaction rewrites the residual only where selected. So about
/// 4 x 4n bytes of traffic plus small, against 3 x 4n for a bare "read g and residual, write
/// residual" kernel. Asynchronous on `ctx.stream`; no allocation or synchronisation.
///
/// Preconditions: `grad` and `residual` hold n elements of device memory and do not overlap;
/// `residual` starts at zero for a new tensor; output and workspace as for `select_topk`
/// (workspace: `error_feedback_workspace_bytes`). Throws `error` as `select_topk` does.
///
/// \code
///   // bf16 gradients, fp32 residual, bf16 values on the wire
///   stellatrain::error_feedback_topk<std::uint32_t, stellatrain::bf16>(
///       stellatrain::cuda_stream{s}, d_grad_bf16, d_residual, n, k, {d_out, out_bytes}, {d_ws,
///       ws_bytes});
/// \endcode
template <index_type Index = std::uint32_t, value_type Out = float, value_type G>
void error_feedback_topk(cuda_stream ctx, const G* grad, float* residual, std::uint64_t n,
                         std::uint64_t k, std::span<std::byte> device_out,
                         std::span<std::byte> device_workspace,
                         const topk_cuda_options& options = {}) {
  if (n != 0 && residual == nullptr)
    throw_error(errc::invalid_argument, "error_feedback_topk: null residual");
  const auto call = detail::prepare_topk_call<float, Index, Out>(
      "error_feedback_topk", ctx, grad, n, k, device_out, device_workspace, nullptr, options);
  const std::size_t value_offset = selection_value_offset(call.k, dtype_of<Index>);
  detail::feedback_emitter<Out, Index> emit{
      residual, reinterpret_cast<Index*>(device_out.data() + selection_index_offset()),
      reinterpret_cast<Out*>(device_out.data() + value_offset), call.k};
  if (call.k == 0) {
    // Nothing is selected, yet the residual still accumulates the gradient.
    if (n != 0) {
      detail::accumulate_kernel<<<static_cast<unsigned>((n + 255) / 256 < 65536 ? (n + 255) / 256
                                                                                : 65536),
                                  256, 0, ctx.stream>>>(detail::feedback_source<G>{grad, residual},
                                                        n);
      detail::check_launch("accumulate kernel launch");
    }
  }
  detail::run_selection<float, Index, Out>(call, detail::feedback_source<G>{grad, residual},
                                           residual, emit);
}

/// `error_feedback_topk` with a persistent per-tensor threshold on |acc| (see
/// `select_topk_threshold`): typically the first pass (g + residual -> acc) is the only full
/// one. The output is the same exact selection.
template <index_type Index = std::uint32_t, value_type Out = float, value_type G>
void error_feedback_topk_threshold(cuda_stream ctx, const G* grad, float* residual, std::uint64_t n,
                                   std::uint64_t k, topk_threshold_state* device_state,
                                   std::span<std::byte> device_out,
                                   std::span<std::byte> device_workspace,
                                   const topk_cuda_options& options = {}) {
  if (n != 0 && residual == nullptr)
    throw_error(errc::invalid_argument, "error_feedback_topk_threshold: null residual");
  if (device_state == nullptr)
    throw_error(errc::invalid_argument, "error_feedback_topk_threshold: null threshold state");
  const auto call = detail::prepare_topk_call<float, Index, Out>(
      "error_feedback_topk_threshold", ctx, grad, n, k, device_out, device_workspace, device_state,
      options);
  const std::size_t value_offset = selection_value_offset(call.k, dtype_of<Index>);
  detail::feedback_emitter<Out, Index> emit{
      residual, reinterpret_cast<Index*>(device_out.data() + selection_index_offset()),
      reinterpret_cast<Out*>(device_out.data() + value_offset), call.k};
  if (call.k == 0 && n != 0) {
    detail::accumulate_kernel<<<static_cast<unsigned>((n + 255) / 256 < 65536 ? (n + 255) / 256
                                                                              : 65536),
                                256, 0, ctx.stream>>>(detail::feedback_source<G>{grad, residual},
                                                      n);
    detail::check_launch("accumulate kernel launch");
  }
  detail::run_selection<float, Index, Out>(call, detail::feedback_source<G>{grad, residual},
                                           residual, emit);
}

/// Sets the threshold of |g + residual| in `device_state` from a sample (see
/// `estimate_threshold_sampled`); reads g and the residual, writes neither.
template <value_type G>
void estimate_feedback_threshold_sampled(cuda_stream ctx, const G* grad, const float* residual,
                                         std::uint64_t n, std::uint64_t k,
                                         topk_threshold_state* device_state,
                                         std::span<std::byte> device_workspace,
                                         const topk_cuda_options& options = {}) {
  if (n != 0 && (grad == nullptr || residual == nullptr)) {
    throw_error(errc::invalid_argument, "estimate_feedback_threshold_sampled: null input");
  }
  // The sample only reads: the feedback source's write-back is not called by the sampler.
  detail::run_sampled_threshold<float>(
      ctx.stream, detail::feedback_source<G>{grad, const_cast<float*>(residual)}, n, k,
      device_state, device_workspace, options, "estimate_feedback_threshold_sampled");
}

}  // namespace stellatrain
