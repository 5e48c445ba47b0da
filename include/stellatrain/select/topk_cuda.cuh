// SPDX-License-Identifier: Apache-2.0
// GPU top-k selection by magnitude (exact, threshold, sampled threshold) of fp32/fp16/bf16
// device buffers into the host-bound selection layout.
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
#include <type_traits>

namespace stellatrain {

namespace detail {
template <class Out, class In>
using out_value_t = std::conditional_t<std::is_void_v<Out>, In, Out>;
}  // namespace detail

/// Bytes of device workspace a GPU selection of `k` of `n` elements of type `T` needs with
/// `options` (the same for exact, threshold and sampled-threshold selection). About
/// n/8 bytes (a bitmap) + two candidate buffers (`candidate_fraction` x n and
/// max(that, `threshold_candidate_factor` x k) entries of 4 bytes, 8 past 2^32 elements) +
/// 200 KiB. Host only; no device work.
///
/// \code
///   auto bytes = stellatrain::topk_workspace_bytes<float>(n, k);
///   void* ws;  cudaMalloc(&ws, bytes);   // once, reused every step
/// \endcode
template <value_type T>
[[nodiscard]] std::size_t topk_workspace_bytes(std::uint64_t n, std::uint64_t k,
                                               const topk_cuda_options& options = {}) {
  return detail::topk_workspace_layout<T>(n, k, options, "topk_workspace_bytes").total;
}

/// Bytes of the output of a selection of `k` of `n` elements: `selection_bytes(min(k, n))`.
template <value_type Value, index_type Index = std::uint32_t>
[[nodiscard]] constexpr std::size_t topk_output_bytes(std::uint64_t n, std::uint64_t k) noexcept {
  return selection_bytes<Value, Index>(k < n ? k : n);
}

/// Exact top-k by magnitude of the device tensor `x[0, n)`, written to `device_out` in the
/// selection layout (header, indices, values; selection_layout.hpp) so that one copy of
/// `topk_output_bytes` bytes brings it to the host.
///
/// Semantics (shared with the CPU selectors): elements rank by the bit pattern of |x| as an
/// unsigned integer (+0 == -0; +inf above every finite value; NaN above +inf), exactly
/// min(k, n) are selected, ties at the threshold go to the lowest indices, and the output
/// lists the indices strictly ascending with the values found there (converted to `Out`,
/// default `T`: the same type is copied bit for bit).
///
/// How: a radix select on the magnitude key, 11 bits per pass (3 passes for fp32, 2 for 16-bit
/// values), then on the index for ties. The first pass histograms the top digit; each later
/// pass filters by the bucket chosen so far, marks the elements above it in a bitmap and
/// histograms the next digit of the tied ones; once the tied bucket fits in a candidate buffer
/// the passes read only the buffer. The last block of each pass picks the next bucket on the
/// device, so there is no host round trip; a compaction of the bitmap writes the output in
/// index order. Typically two reads of `x` plus small traffic. Every call is stream-ordered
/// on `ctx.stream`, allocates nothing, never synchronises, and can be captured in a CUDA graph.
///
/// Preconditions: `x` holds n elements of device memory (may be null when n == 0);
/// `device_out` is device memory of at least `topk_output_bytes<Out, Index>(n, k)` bytes,
/// 64-byte aligned; `device_workspace` holds `topk_workspace_bytes<T>(n, k, options)` bytes and
/// is not used by another call in flight. Throws `error` (`errc::invalid_argument`) for
/// arguments that break these, `errc::unsupported` for what this build cannot do, and
/// `errc::cuda_error` when a launch fails. A broken device-side invariant is reported in the
/// header's status (`read_selection` throws on it).
///
/// \code
///   auto out_bytes = stellatrain::topk_output_bytes<float>(n, k);
///   stellatrain::select_topk(stellatrain::cuda_stream{s}, d_grad, n, k,
///                            {d_out, out_bytes}, {d_ws, ws_bytes});
///   cudaMemcpyAsync(h_out, d_out, out_bytes, cudaMemcpyDeviceToHost, s);   // pinned h_out
///   cudaStreamSynchronize(s);
///   auto sel = stellatrain::read_selection<float, std::uint32_t>({h_out, out_bytes});
/// \endcode
template <index_type Index = std::uint32_t, class Out = void, value_type T>
void select_topk(cuda_stream ctx, const T* x, std::uint64_t n, std::uint64_t k,
                 std::span<std::byte> device_out, std::span<std::byte> device_workspace,
                 const topk_cuda_options& options = {}) {
  using out_t = detail::out_value_t<Out, T>;
  const auto call = detail::prepare_topk_call<T, Index, out_t>(
      "select_topk", ctx, x, n, k, device_out, device_workspace, nullptr, options);
  const std::size_t value_offset = selection_value_offset(call.k, dtype_of<Index>);
  detail::plain_emitter<T, out_t, Index> emit{
      x, reinterpret_cast<Index*>(device_out.data() + selection_index_offset()),
      reinterpret_cast<out_t*>(device_out.data() + value_offset), call.k};
  detail::run_selection<T, Index, out_t>(call, detail::device_plain_source<T>{x}, x, emit);
}

/// Top-k by magnitude with a persistent per-tensor threshold: one pass keeps the elements at
/// or above the threshold in `device_state` as candidates, and the radix select then runs on
/// those alone, so the result is still exactly the top min(k, n) (same output as
/// `select_topk`). When the threshold misses (fewer than k candidates, or more than the
/// candidate buffer holds) the full exact select runs in the same call, and the header's flags
/// say so. The call then moves the threshold to (1 - slack) x the k-th magnitude for the next
/// step. A zeroed state (`reset_threshold_state`) means no threshold yet: that call is exact.
///
/// Typically one read of `x` plus small traffic while the gradient statistics drift slowly.
/// Preconditions as `select_topk`, plus: `device_state` points to one `topk_threshold_state`
/// in device memory, used by one tensor, not concurrently. `options.backend` is ignored.
///
/// \code
///   stellatrain::reset_threshold_state(ctx, d_state);                    // once per tensor
///   for (;;) stellatrain::select_topk_threshold(ctx, d_grad, n, k, d_state, out, ws);
/// \endcode
template <index_type Index = std::uint32_t, class Out = void, value_type T>
void select_topk_threshold(cuda_stream ctx, const T* x, std::uint64_t n, std::uint64_t k,
                           topk_threshold_state* device_state, std::span<std::byte> device_out,
                           std::span<std::byte> device_workspace,
                           const topk_cuda_options& options = {}) {
  using out_t = detail::out_value_t<Out, T>;
  if (device_state == nullptr)
    throw_error(errc::invalid_argument, "select_topk_threshold: null threshold state");
  const auto call = detail::prepare_topk_call<T, Index, out_t>(
      "select_topk_threshold", ctx, x, n, k, device_out, device_workspace, device_state, options);
  const std::size_t value_offset = selection_value_offset(call.k, dtype_of<Index>);
  detail::plain_emitter<T, out_t, Index> emit{
      x, reinterpret_cast<Index*>(device_out.data() + selection_index_offset()),
      reinterpret_cast<out_t*>(device_out.data() + value_offset), call.k};
  detail::run_selection<T, Index, out_t>(call, detail::device_plain_source<T>{x}, x, emit);
}

/// Sets the threshold in `device_state` from a sample of `x`: `options.sample_size` elements at
/// jittered strides, the key at the sample's share of k widened by `options.sample_oversample`.
/// Use it to start threshold selection without an exact first step, or before every step for
/// a threshold that does not depend on the previous one. Statistics in the state are kept.
/// Workspace: the same as for the selection. Asynchronous on `ctx.stream`.
template <value_type T>
void estimate_threshold_sampled(cuda_stream ctx, const T* x, std::uint64_t n, std::uint64_t k,
                                topk_threshold_state* device_state,
                                std::span<std::byte> device_workspace,
                                const topk_cuda_options& options = {}) {
  if (n != 0 && x == nullptr)
    throw_error(errc::invalid_argument, "estimate_threshold_sampled: null input");
  detail::run_sampled_threshold<T>(ctx.stream, detail::device_plain_source<T>{x}, n, k,
                                   device_state, device_workspace, options,
                                   "estimate_threshold_sampled");
}

/// Clears a threshold state (no threshold, no statistics), asynchronously on `ctx.stream`.
inline void reset_threshold_state(cuda_stream ctx, topk_threshold_state* device_state) {
  if (device_state == nullptr)
    throw_error(errc::invalid_argument, "reset_threshold_state: null state");
  STELLATRAIN_CUDA_CHECK(
      cudaMemsetAsync(device_state, 0, sizeof(topk_threshold_state), ctx.stream));
}

}  // namespace stellatrain
