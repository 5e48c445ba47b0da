// SPDX-License-Identifier: Apache-2.0
// Fused error feedback on the GPU against its scalar definition over several steps: the
// selection of |g + residual|, the values sent (fp32 or rounded to bf16/fp16) and the residual
// left behind, bit for bit; the threshold variant gives the same results.
#include <stellatrain/compress/error_feedback_cuda.cuh>
#include <stellatrain/select/topk_cuda.cuh>

#include "catch.hpp"
#include "cuda_test_support.cuh"
#include "selection_oracle.hpp"

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace {

using namespace stellatrain;
using stellatrain::test::device_buffer;
using stellatrain::test::fetch_selection;
using stellatrain::test::random_normal;
using stellatrain::test::raw_bits;

/// The scalar definition of one step; updates `residual`, returns (indices, values sent).
template <class G, class Out>
std::pair<std::vector<std::uint64_t>, std::vector<Out>> reference_step(const std::vector<G>& g,
                                                                       std::vector<float>& residual,
                                                                       std::uint64_t k) {
  std::vector<float> acc(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) acc[i] = to_float(g[i]) + residual[i];
  auto idx = test::reference_topk_indices<float>(std::span<const float>(acc), k);
  std::vector<Out> sent(idx.size());
  residual = acc;
  for (std::size_t j = 0; j < idx.size(); ++j) {
    residual[idx[j]] = detail::quantize_with_feedback(acc[idx[j]], sent[j]);
  }
  return {idx, sent};
}

template <class G, class Out>
void check_feedback_steps(std::size_t n, std::uint64_t k, bool threshold) {
  test::stream s;
  const cuda_stream ctx{s.get()};
  std::vector<float> residual(n, 0.0f);
  device_buffer<float> dres(residual);
  device_buffer<G> dg(n);
  const std::size_t out_bytes = topk_output_bytes<Out>(n, k);
  device_buffer<std::byte> out(out_bytes);
  device_buffer<std::byte> ws(error_feedback_workspace_bytes(n, k));
  device_buffer<topk_threshold_state> state(1);
  reset_threshold_state(ctx, state.get());
  for (int step = 0; step < 4; ++step) {
    auto g = random_normal<G>(n, 1000 + static_cast<std::uint64_t>(step));
    if (step == 2 && n > 10) {  // a non-finite gradient is sent, not fed back
      g[7] = from_float<G>(std::numeric_limits<float>::infinity());
      g[9] = from_float<G>(std::numeric_limits<float>::quiet_NaN());
    }
    dg.upload(g);
    if (threshold) {
      error_feedback_topk_threshold<std::uint32_t, Out>(ctx, dg.get(), dres.get(), n, k,
                                                        state.get(), out.bytes(), ws.bytes());
    } else {
      error_feedback_topk<std::uint32_t, Out>(ctx, dg.get(), dres.get(), n, k, out.bytes(),
                                              ws.bytes());
    }
    const auto got = fetch_selection<Out, std::uint32_t>(out.bytes(), out_bytes, s);
    const auto [want_idx, want_val] = reference_step<G, Out>(g, residual, k);
    INFO("n = " << n << ", k = " << k << ", step " << step
                << (threshold ? ", threshold" : ", exact"));
    REQUIRE(got.indices == want_idx);
    std::size_t bad = 0;
    for (std::size_t j = 0; j < want_val.size(); ++j)
      bad += raw_bits(got.values[j]) != raw_bits(want_val[j]);
    CHECK(bad == 0);
    const auto r = dres.download();
    bad = 0;
    for (std::size_t i = 0; i < n; ++i) bad += raw_bits(r[i]) != raw_bits(residual[i]);
    CHECK(bad == 0);
  }
}

}  // namespace

TEST_CASE("fused error feedback equals its scalar definition", "[select][cuda][feedback]") {
  SECTION("fp32 gradients, fp32 values") {
    check_feedback_steps<float, float>(300'000, 3000, false);
  }
  SECTION("bf16 gradients, bf16 values") { check_feedback_steps<bf16, bf16>(300'000, 3000, false); }
  SECTION("fp16 gradients, fp16 values, tiny tensor") {
    check_feedback_steps<fp16, fp16>(37, 5, false);
  }
  SECTION("fp32 gradients, bf16 values, 10%") {
    check_feedback_steps<float, bf16>(1'000'003, 100'000, false);
  }
}

TEST_CASE("fused error feedback with a persistent threshold gives the same steps",
          "[select][cuda][feedback]") {
  check_feedback_steps<float, float>(2'000'000, 20'000, true);
  check_feedback_steps<bf16, bf16>(500'000, 500, true);
}

TEST_CASE("error feedback with k = 0 only accumulates", "[select][cuda][feedback]") {
  test::stream s;
  const std::size_t n = 1000;
  const auto g = random_normal<float>(n, 5);
  std::vector<float> r0(n, 0.25f);
  device_buffer<float> dg(g), dres(r0);
  device_buffer<std::byte> out(topk_output_bytes<float>(n, 0));
  device_buffer<std::byte> ws(error_feedback_workspace_bytes(n, 0));
  error_feedback_topk(cuda_stream{s.get()}, dg.get(), dres.get(), n, 0, out.bytes(), ws.bytes());
  const auto got = fetch_selection<float, std::uint32_t>(out.bytes(), out.size(), s);
  CHECK(got.header.count == 0);
  const auto r = dres.download();
  for (std::size_t i = 0; i < n; ++i) REQUIRE(r[i] == g[i] + 0.25f);
}

// The README's "GPU selection" block is the text between the two "// [gpu_selection]" lines;
// the code around it provides its buffers and checks what it selected.
TEST_CASE("the README's GPU selection block sends error feedback's top k", "[select][cuda]") {
  const std::size_t n = 100'000;
  const std::uint64_t k = 1000;
  test::stream s;
  const cudaStream_t stream = s.get();
  const auto g = random_normal<float>(n, 11);
  device_buffer<float> grad(g), residual(std::vector<float>(n, 0.0f));
  device_buffer<std::byte> out(topk_output_bytes<bf16>(n, k));
  device_buffer<std::byte> ws(error_feedback_workspace_bytes(n, k));
  test::pinned_bytes host(out.size());
  const float* d_grad = grad.get();
  float* d_residual = residual.get();
  std::byte* d_out = out.get();
  std::byte* d_ws = ws.get();
  std::byte* h_out = host.span().data();
  // [gpu_selection]
  stellatrain::cuda_stream ctx{stream};
  const auto out_bytes = stellatrain::topk_output_bytes<stellatrain::bf16>(n, k);
  const auto ws_bytes = stellatrain::error_feedback_workspace_bytes(n, k);
  // acc = grad + residual; top-k of |acc|; bf16 values sent, rounding error kept in residual
  stellatrain::error_feedback_topk<std::uint32_t, stellatrain::bf16>(
      ctx, d_grad, d_residual, n, k, {d_out, out_bytes}, {d_ws, ws_bytes});
  cudaMemcpyAsync(h_out, d_out, out_bytes, cudaMemcpyDeviceToHost, stream);  // h_out: pinned
  cudaStreamSynchronize(stream);
  auto sel = stellatrain::read_selection<stellatrain::bf16, std::uint32_t>({h_out, out_bytes});
  // [gpu_selection]
  std::vector<float> want_residual(n, 0.0f);
  const auto [want_idx, want_val] = reference_step<float, bf16>(g, want_residual, k);
  REQUIRE(sel.size() == want_idx.size());
  std::size_t bad = 0;
  for (std::size_t j = 0; j < want_idx.size(); ++j) {
    bad += sel.indices()[j] != want_idx[j] || raw_bits(sel.values()[j]) != raw_bits(want_val[j]);
  }
  CHECK(bad == 0);
}
