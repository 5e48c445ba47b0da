// SPDX-License-Identifier: Apache-2.0
// GPU top-k selection against the scalar oracle: exact selection of fp32/fp16/bf16 on random,
// tied, constant, zero, NaN, tiny and large inputs (past 2^32 elements), threshold and sampled
// threshold selection over several steps, determinism and CUDA graph capture, the scatter back,
// and argument errors.
#include <stellatrain/select/selection_scatter.cuh>
#include <stellatrain/select/topk_cuda.cuh>

#include "catch.hpp"
#include "cuda_test_support.cuh"
#include "selection_oracle.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

namespace {

using namespace stellatrain;
using stellatrain::test::device_buffer;
using stellatrain::test::fetch_selection;
using stellatrain::test::random_normal;
using stellatrain::test::raw_bits;

/// Runs select_topk on `x` and compares everything with the oracle: indices, values (bit for
/// bit), header. Returns the header.
template <class T, class Index = std::uint32_t, class Out = T>
selection_header check_select(const std::vector<T>& x, std::uint64_t k,
                              const topk_cuda_options& options = {}) {
  test::stream s;
  const std::uint64_t n = x.size();
  device_buffer<T> dx(x);
  const std::size_t out_bytes = topk_output_bytes<Out, Index>(n, k);
  device_buffer<std::byte> out(out_bytes);
  device_buffer<std::byte> ws(topk_workspace_bytes<T>(n, k, options));
  select_topk<Index, Out>(cuda_stream{s.get()}, dx.get(), n, k, out.bytes(), ws.bytes(), options);
  const auto got = fetch_selection<Out, Index>(out.bytes(), out_bytes, s);
  const auto want = test::reference_topk_indices<T>(std::span<const T>(x), k);
  INFO("n = " << n << ", k = " << k);
  REQUIRE(got.indices == want);
  std::size_t bad_values = 0;
  for (std::size_t j = 0; j < want.size(); ++j) {
    if (raw_bits(got.values[j]) != raw_bits(detail::convert_value<Out>(x[want[j]]))) ++bad_values;
  }
  CHECK(bad_values == 0);
  CHECK(got.header.count == want.size());
  CHECK(got.header.dense_size == n);
  CHECK(got.header.flags == 0);
  return got.header;
}

template <class T>
std::vector<T> with_specials(std::vector<T> x) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (x.size() > 100) {
    x[3] = from_float<T>(nan);
    x[17] = from_float<T>(-inf);
    x[40] = from_float<T>(inf);
    x[41] = from_float<T>(-nan);
    for (std::size_t i = 50; i < 100; ++i) x[i] = from_float<T>(i % 2 ? 0.0f : -0.0f);
  }
  return x;
}

}  // namespace

TEST_CASE("select_topk equals the oracle for fp32", "[select][cuda]") {
  SECTION("random, sizes around warp and block boundaries, all densities") {
    for (std::size_t n : {1, 2, 31, 32, 33, 255, 256, 257, 4095, 4097, 65537}) {
      const auto x = random_normal<float>(n, n);
      for (std::uint64_t k :
           {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{n / 100}, std::uint64_t{n / 10},
            std::uint64_t{n / 2}, std::uint64_t{n - 1}, std::uint64_t{n}, std::uint64_t{n + 5}}) {
        check_select(x, k);
      }
    }
  }
  SECTION("2^22 + 3 elements at 0.1%, 1%, 10%") {
    const auto x = random_normal<float>((std::size_t{1} << 22) + 3, 5);
    for (std::uint64_t k : {4194, 41943, 419430}) check_select(x, k);
  }
  SECTION("NaN, infinities, signed zeros") {
    const auto x = with_specials(random_normal<float>(10'000, 6));
    for (std::uint64_t k : {1, 2, 3, 4, 5, 1000, 9960}) check_select(x, k);
  }
  SECTION("all equal, all zero, few distinct values (ties resolved by index)") {
    std::vector<float> same(300'000, 0.75f);
    for (std::size_t i = 0; i < same.size(); i += 3) same[i] = -0.75f;
    std::vector<float> zero(300'000, 0.0f);
    std::vector<float> few(300'000);
    for (std::size_t i = 0; i < few.size(); ++i) few[i] = static_cast<float>((i * 7919) % 5) - 2.0f;
    for (std::uint64_t k : {1, 2, 1000, 150'000, 299'999}) {
      check_select(same, k);
      check_select(zero, k);
      check_select(few, k);
    }
  }
  SECTION("n = 0") { check_select(std::vector<float>{}, 10); }
}

TEST_CASE("select_topk equals the oracle for fp16 and bf16", "[select][cuda]") {
  for (std::size_t n : {1, 33, 1000, 100'003}) {
    const auto h = with_specials(random_normal<fp16>(n, 7 + n));
    const auto b = with_specials(random_normal<bf16>(n, 8 + n));
    for (std::uint64_t k :
         {std::uint64_t{1}, std::uint64_t{n / 100 + 1}, std::uint64_t{n / 3}, std::uint64_t{n}}) {
      check_select(h, k);
      check_select(b, k);
    }
  }
  // bf16 gaussians tie heavily at any threshold.
  const auto b = random_normal<bf16>(2'000'000, 9);
  for (std::uint64_t k : {2000, 20'000, 200'000}) check_select(b, k);
}

TEST_CASE("select_topk converts values and writes 64-bit indices", "[select][cuda]") {
  const auto x = random_normal<float>(123'457, 10);
  check_select<float, std::uint64_t, bf16>(x, 1234);
  check_select<float, std::uint32_t, fp16>(x, 1234);
  const auto h = random_normal<fp16>(123'457, 11);
  check_select<fp16, std::uint64_t, float>(h, 999);
}

TEST_CASE("select_topk with the smallest candidate buffers still selects exactly",
          "[select][cuda]") {
  // Buffers of 65536 entries cannot hold a tie of 10^6 elements: passes read the tensor.
  std::vector<float> x(1'000'000, 1.0f);
  for (std::size_t i = 0; i < x.size(); i += 1000) x[i] = 2.0f;
  const topk_cuda_options small{.candidate_fraction = 1e-9, .threshold_candidate_factor = 0.0};
  for (std::uint64_t k : {500, 1000, 1001, 777'777}) check_select(x, k, small);
}

TEST_CASE("the cub::DeviceTopK backend selects the same elements", "[select][cuda]") {
  if constexpr (detail::cub_device_topk_available) {
    const topk_cuda_options cub_backend{.backend = topk_backend::cub_device_topk};
    const auto x = with_specials(random_normal<float>(300'001, 16));
    for (std::uint64_t k : {1, 300, 3000, 30'000}) check_select(x, k, cub_backend);
    const auto b = random_normal<bf16>(1'000'000, 17);  // many ties: composite keys decide
    for (std::uint64_t k : {1000, 10'000}) check_select(b, k, cub_backend);
  } else {
    WARN("skipped: this CCCL (CUB " << CUB_VERSION << ") has no cub::DeviceTopK");
  }
}

TEST_CASE("select_topk is deterministic and can be captured in a CUDA graph", "[select][cuda]") {
  const auto x = random_normal<bf16>(1'000'000, 12);
  const std::uint64_t k = 10'000;
  test::stream s;
  device_buffer<bf16> dx(x);
  const std::size_t out_bytes = topk_output_bytes<bf16>(x.size(), k);
  device_buffer<std::byte> out1(out_bytes), out2(out_bytes);
  device_buffer<std::byte> ws(topk_workspace_bytes<bf16>(x.size(), k));
  select_topk(cuda_stream{s.get()}, dx.get(), x.size(), k, out1.bytes(), ws.bytes());

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  STELLATRAIN_CUDA_CHECK(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeThreadLocal));
  select_topk(cuda_stream{s.get()}, dx.get(), x.size(), k, out2.bytes(), ws.bytes());
  STELLATRAIN_CUDA_CHECK(cudaStreamEndCapture(s.get(), &graph));
  STELLATRAIN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) STELLATRAIN_CUDA_CHECK(cudaGraphLaunch(exec, s.get()));
  s.sync();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  const auto a = fetch_selection<bf16, std::uint32_t>(out1.bytes(), out_bytes, s);
  const auto b = fetch_selection<bf16, std::uint32_t>(out2.bytes(), out_bytes, s);
  CHECK(a.indices == b.indices);
  CHECK(std::memcmp(a.values.data(), b.values.data(), a.values.size() * sizeof(bf16)) == 0);
  CHECK(a.indices == test::reference_topk_indices<bf16>(std::span<const bf16>(x), k));
}

TEST_CASE("threshold selection is exact at every step and stops missing", "[select][cuda]") {
  const std::size_t n = 3'000'000;
  const std::uint64_t k = 30'000;
  test::stream s;
  const cuda_stream ctx{s.get()};
  auto base = random_normal<float>(n, 13);
  device_buffer<float> dx(n);
  device_buffer<std::byte> out(topk_output_bytes<float>(n, k));
  device_buffer<std::byte> ws(topk_workspace_bytes<float>(n, k));
  device_buffer<topk_threshold_state> state(1);
  reset_threshold_state(ctx, state.get());
  std::vector<std::uint32_t> flags;
  for (int step = 0; step < 8; ++step) {
    // Slow drift plus fresh noise, as gradients do between steps.
    auto x = base;
    std::mt19937_64 rng(100 + static_cast<std::uint64_t>(step));
    std::normal_distribution<float> noise(0.0f, 0.05f);
    for (auto& v : x) v = v * (1.0f + 0.01f * static_cast<float>(step)) + noise(rng);
    dx.upload(x);
    select_topk_threshold(ctx, dx.get(), n, k, state.get(), out.bytes(), ws.bytes());
    const auto got = fetch_selection<float, std::uint32_t>(out.bytes(), out.size(), s);
    REQUIRE(got.indices == test::reference_topk_indices<float>(std::span<const float>(x), k));
    flags.push_back(got.header.flags);
  }
  const auto st = state.download()[0];
  CHECK(st.calls == 8);
  CHECK(flags[0] == 0);  // no threshold yet: exact
  for (std::size_t i = 1; i < flags.size(); ++i)
    CHECK((flags[i] & selection_flag_threshold_used) != 0);
  CHECK(st.misses <= 1);
  CHECK((flags.back() & selection_flag_threshold_fallback) == 0);
  CHECK(st.candidates >= k);
  CHECK(st.candidates <= 2 * k);
}

TEST_CASE("a sampled threshold starts threshold selection without an exact step",
          "[select][cuda]") {
  for (std::size_t n : {std::size_t{50'000}, std::size_t{5'000'000}}) {
    const auto x = random_normal<bf16>(n, 14 + n);
    const std::uint64_t k = n / 100;
    test::stream s;
    const cuda_stream ctx{s.get()};
    device_buffer<bf16> dx(x);
    device_buffer<std::byte> out(topk_output_bytes<bf16>(n, k));
    device_buffer<std::byte> ws(topk_workspace_bytes<bf16>(n, k));
    device_buffer<topk_threshold_state> state(1);
    reset_threshold_state(ctx, state.get());
    estimate_threshold_sampled(ctx, dx.get(), n, k, state.get(), ws.bytes());
    const auto estimated = state.download()[0];
    CHECK(estimated.key != 0);
    select_topk_threshold(ctx, dx.get(), n, k, state.get(), out.bytes(), ws.bytes());
    const auto got = fetch_selection<bf16, std::uint32_t>(out.bytes(), out.size(), s);
    CHECK(got.indices == test::reference_topk_indices<bf16>(std::span<const bf16>(x), k));
    CHECK((got.header.flags & selection_flag_threshold_used) != 0);
    if (n >= 5'000'000) CHECK((got.header.flags & selection_flag_threshold_fallback) == 0);
  }
}

TEST_CASE("scatter_selection writes updated values back at the selected indices",
          "[select][cuda]") {
  const std::size_t n = 200'001;
  const std::uint64_t k = 2'000;
  const auto x = random_normal<float>(n, 15);
  test::stream s;
  const cuda_stream ctx{s.get()};
  device_buffer<float> dx(x);
  const std::size_t bytes = topk_output_bytes<float>(n, k);
  device_buffer<std::byte> out(bytes);
  device_buffer<std::byte> ws(topk_workspace_bytes<float>(n, k));
  select_topk(ctx, dx.get(), n, k, out.bytes(), ws.bytes());
  const auto sel = fetch_selection<float, std::uint32_t>(out.bytes(), bytes, s);

  // The host "optimizer" halves the selected values and sends them back as bf16.
  const std::size_t back_bytes = selection_bytes<bf16, std::uint32_t>(k);
  test::pinned_bytes host(back_bytes);
  write_selection_header<bf16, std::uint32_t>(host.span(), k, n);
  auto idx = selection_indices<std::uint32_t>(host.span(), k);
  auto val = selection_values<bf16, std::uint32_t>(host.span(), k);
  for (std::size_t j = 0; j < k; ++j) {
    idx[j] = static_cast<std::uint32_t>(sel.indices[j]);
    val[j] = bf16{sel.values[j] * 0.5f};
  }
  device_buffer<std::byte> back(back_bytes);
  STELLATRAIN_CUDA_CHECK(
      cudaMemcpyAsync(back.get(), host.span().data(), back_bytes, cudaMemcpyHostToDevice, s.get()));
  device_buffer<bf16> param(n);
  std::vector<bf16> param0(n, bf16{3.0f});
  param.upload(param0);
  device_buffer<std::uint64_t> rejected(1);
  STELLATRAIN_CUDA_CHECK(cudaMemsetAsync(rejected.get(), 0, sizeof(std::uint64_t), s.get()));
  scatter_selection(ctx, read_selection_header(host.span()), back.get(), param.get(), n, {},
                    rejected.get());
  s.sync();
  auto p = param.download();
  for (std::size_t j = 0; j < k; ++j) {
    REQUIRE(p[idx[j]].bits() == val[j].bits());
    p[idx[j]] = bf16{3.0f};
  }
  for (const auto& v : p) REQUIRE(v.bits() == bf16{3.0f}.bits());
  CHECK(rejected.download()[0] == 0);

  // Accumulate, and an index out of range is skipped and counted.
  idx[0] = static_cast<std::uint32_t>(n);
  STELLATRAIN_CUDA_CHECK(
      cudaMemcpyAsync(back.get(), host.span().data(), back_bytes, cudaMemcpyHostToDevice, s.get()));
  param.upload(param0);
  scatter_selection(ctx, read_selection_header(host.span()), back.get(), param.get(), n,
                    {.accumulate = true}, rejected.get());
  s.sync();
  p = param.download();
  CHECK(rejected.download()[0] == 1);
  for (std::size_t j = 1; j < k; ++j)
    CHECK(p[idx[j]].bits() == bf16{3.0f + val[j].to_float()}.bits());

  CHECK_THROWS_AS(
      scatter_selection(ctx, read_selection_header(host.span()), back.get(), param.get(), n + 1),
      error);
}

TEST_CASE("GPU selection rejects bad arguments with stellatrain::error", "[select][cuda]") {
  test::stream s;
  const cuda_stream ctx{s.get()};
  const std::size_t n = 1000;
  device_buffer<float> dx(n);
  device_buffer<std::byte> out(topk_output_bytes<float>(n, 10));
  device_buffer<std::byte> ws(topk_workspace_bytes<float>(n, 10));
  auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const error& e) {
      return e.code();
    }
    return std::error_code{};
  };
  CHECK(code_of([&] { select_topk(ctx, dx.get(), n, 10, out.bytes().first(64), ws.bytes()); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { select_topk(ctx, dx.get(), n, 10, out.bytes(), ws.bytes().first(100)); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { select_topk(ctx, dx.get(), n, 10, out.bytes().subspan(8), ws.bytes()); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] {
          select_topk(ctx, static_cast<const float*>(nullptr), n, 10, out.bytes(), ws.bytes());
        }) == errc::invalid_argument);
  CHECK(code_of([&] {
          select_topk(ctx, dx.get(), (std::uint64_t{1} << 32) + 1, 10, out.bytes(), ws.bytes());
        }) == errc::invalid_argument);  // u32 indices cannot address it
  CHECK(code_of([&] {
          select_topk_threshold(ctx, dx.get(), n, 10, nullptr, out.bytes(), ws.bytes());
        }) == errc::invalid_argument);
  CHECK(code_of([&] {
          select_topk(ctx, dx.get(), n, 10, out.bytes(), ws.bytes(), {.candidate_fraction = 0.0});
        }) == errc::invalid_argument);
  if constexpr (!detail::cub_device_topk_available) {
    CHECK(code_of([&] {
            select_topk(ctx, dx.get(), n, 10, out.bytes(), ws.bytes(),
                        {.backend = topk_backend::cub_device_topk});
          }) == errc::unsupported);
  }
  // A selection that broke nothing reads back; a header with a status does not.
  select_topk(ctx, dx.get(), n, 10, out.bytes(), ws.bytes());
  test::pinned_bytes host(out.size());
  STELLATRAIN_CUDA_CHECK(
      cudaMemcpy(host.span().data(), out.get(), out.size(), cudaMemcpyDeviceToHost));
  CHECK_NOTHROW(read_selection<float, std::uint32_t>(host.span()));
  CHECK_THROWS_AS((read_selection<bf16, std::uint32_t>(host.span())), error);
  selection_header h = read_selection_header(host.span());
  h.status = static_cast<std::uint32_t>(selection_status::wrong_total);
  std::memcpy(host.span().data(), &h, sizeof h);
  CHECK_THROWS_AS((read_selection<float, std::uint32_t>(host.span())), error);
}

TEST_CASE("select_topk past 2^32 elements (64-bit offsets and indices)", "[select][cuda][large]") {
  const std::uint64_t n = (std::uint64_t{1} << 32) + (std::uint64_t{3} << 20) + 7;
  const std::uint64_t k = 12;
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STELLATRAIN_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const std::size_t ws_bytes = topk_workspace_bytes<bf16>(n, k);
  const std::size_t need = n * sizeof(bf16) + ws_bytes + (std::size_t{1} << 28);
  if (free_bytes < need) {
    WARN("skipped: needs " << need / (1 << 20) << " MiB of device memory, "
                           << free_bytes / (1 << 20) << " free");
    return;
  }
  test::stream s;
  device_buffer<bf16> dx(n);
  STELLATRAIN_CUDA_CHECK(cudaMemsetAsync(dx.get(), 0, n * sizeof(bf16), s.get()));
  // Distinct magnitudes planted on both sides of 2^32; the other k - 6 picks are the first zeros.
  const std::vector<std::pair<std::uint64_t, float>> planted{{5, 1.0f},
                                                             {(std::uint64_t{1} << 32) - 1, -2.0f},
                                                             {std::uint64_t{1} << 32, 3.0f},
                                                             {(std::uint64_t{1} << 32) + 77, -4.0f},
                                                             {n - 1, 5.0f},
                                                             {std::uint64_t{3} << 30, 6.0f}};
  for (const auto& [i, v] : planted) {
    const bf16 b{v};
    STELLATRAIN_CUDA_CHECK(
        cudaMemcpyAsync(dx.get() + i, &b, sizeof b, cudaMemcpyHostToDevice, s.get()));
  }
  const std::size_t out_bytes = topk_output_bytes<bf16, std::uint64_t>(n, k);
  device_buffer<std::byte> out(out_bytes);
  device_buffer<std::byte> ws(ws_bytes);
  select_topk<std::uint64_t>(cuda_stream{s.get()}, dx.get(), n, k, out.bytes(), ws.bytes());
  const auto got = fetch_selection<bf16, std::uint64_t>(out.bytes(), out_bytes, s);
  std::vector<std::uint64_t> want{0, 1, 2, 3, 4, 5, 6};  // 5 is planted; zeros 0..4 and 6
  for (const auto& [i, v] : planted) {
    if (i != 5) want.push_back(i);
  }
  std::sort(want.begin(), want.end());
  REQUIRE(want.size() == k);
  CHECK(got.indices == want);
  CHECK(got.header.dense_size == n);
  for (std::size_t j = 0; j < want.size(); ++j) {
    float expect = 0.0f;
    for (const auto& [i, v] : planted) {
      if (i == want[j]) expect = v;
    }
    CHECK(got.values[j].to_float() == expect);
  }
}
