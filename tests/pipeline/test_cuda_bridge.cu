// SPDX-License-Identifier: Apache-2.0
// The GPU bridge against the host pipeline: selection with error feedback on the device (exact
// top-k) must give the same parameters as the CPU compressor's exact top-k, step for step.
#include <stellatrain/cuda.cuh>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"

#include <cstring>
#include <random>
#include <vector>

using namespace stellatrain;

namespace {
const std::vector<std::uint64_t> sizes{5000, 33, 70000};

std::vector<float> grad_of(int rank, int step, std::size_t t) {
  std::mt19937 rng(static_cast<std::uint32_t>(1000 * rank + 10 * step + t));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(sizes[t]);
  for (auto& x : g) x = d(rng);
  return g;
}

template <class Push>
std::vector<std::vector<float>> train(in_process_transport& t, Push&& push_for) {
  thread_pool pool{1};
  pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
             sgd_optimizer({.lr = 0.1f, .momentum = 0.9f}), {.bucket_bytes = 0, .staleness = 0},
             fixed_density{0.02});
  for (std::size_t i = 0; i < sizes.size(); ++i)
    p.add_tensor(static_cast<std::uint32_t>(i), std::vector<float>(sizes[i], 1.0f));
  p.start();
  auto push = push_for(p);
  for (int step = 0; step < 4; ++step) {
    for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
    for (std::size_t i = sizes.size(); i-- > 0;) push(i, grad_of(t.rank(), step, i));
  }
  p.flush();
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    out.emplace_back(sizes[i]);
    p.copy_params(i, out.back());
  }
  return out;
}
}  // namespace

TEST_CASE("GPU selection through the bridge equals the CPU compressor", "[pipeline][cuda]") {
  std::vector<std::vector<float>> cpu, gpu;
  run_in_process(2, [&](in_process_transport& t) {
    auto r = train(t, [](auto& p) {
      return [&p](std::size_t i, const std::vector<float>& g) { p.push_gradient(i, g); };
    });
    if (t.rank() == 0) cpu = std::move(r);
  });
  run_in_process(2, [&](in_process_transport& t) {
    cudaStream_t s;
    STELLATRAIN_CUDA_CHECK(cudaStreamCreate(&s));
    std::vector<float*> d_grad(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i)
      STELLATRAIN_CUDA_CHECK(cudaMalloc(&d_grad[i], sizes[i] * sizeof(float)));
    std::unique_ptr<void, void (*)(void*)> bridge_holder(nullptr, [](void*) {});
    auto r = train(t, [&](auto& p) {
      using bridge_t = cuda_gradient_bridge<std::remove_reference_t<decltype(p)>>;
      auto* bridge = new bridge_t(p, {.max_density = 0.05});
      bridge_holder = std::unique_ptr<void, void (*)(void*)>(
          bridge, [](void* b) { delete static_cast<bridge_t*>(b); });
      return [&, bridge](std::size_t i, const std::vector<float>& g) {
        STELLATRAIN_CUDA_CHECK(cudaMemcpyAsync(d_grad[i], g.data(), g.size() * sizeof(float),
                                               cudaMemcpyHostToDevice, s));
        bridge->push_device_gradient(i, d_grad[i], cuda_stream{s});
      };
    });
    bridge_holder.reset();
    for (auto* d : d_grad) cudaFree(d);
    cudaStreamDestroy(s);
    if (t.rank() == 0) gpu = std::move(r);
  });
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    REQUIRE(std::memcmp(cpu[i].data(), gpu[i].data(), sizes[i] * sizeof(float)) == 0);
  }
}

TEST_CASE("the bridge keeps bf16 device parameters equal to the pipeline's, scattering the changes",
          "[pipeline][cuda]") {
  run_in_process(2, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-2f}), {.bucket_bytes = 0, .staleness = 0},
               fixed_density{0.02}, record_updates<bf16>);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      p.add_tensor(static_cast<std::uint32_t>(i), std::vector<float>(sizes[i], 1.0f));
    p.start();
    cuda_gradient_bridge bridge(p, {.max_density = 0.05});
    cudaStream_t s;
    STELLATRAIN_CUDA_CHECK(cudaStreamCreate(&s));
    std::vector<bf16*> d_param(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i)
      STELLATRAIN_CUDA_CHECK(cudaMalloc(&d_param[i], sizes[i] * sizeof(bf16)));
    // A tensor index past the registered ones: stellatrain::error, not std::out_of_range.
    REQUIRE_THROWS_AS(bridge.residual(sizes.size()), stellatrain::error);
    REQUIRE_THROWS_AS(bridge.upload_params(sizes.size(), d_param[0], cuda_stream{s}),
                      stellatrain::error);
    int sparse = 0, whole = 0;
    for (int step = 0; step < 6; ++step) {
      for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const param_changes_kind k = bridge.upload_params(i, d_param[i], cuda_stream{s});
        sparse += k == param_changes_kind::sparse;
        whole += k == param_changes_kind::whole;
        std::vector<bf16> on_device(sizes[i]), expected(sizes[i]);
        STELLATRAIN_CUDA_CHECK(cudaMemcpyAsync(on_device.data(), d_param[i],
                                               sizes[i] * sizeof(bf16), cudaMemcpyDeviceToHost, s));
        STELLATRAIN_CUDA_CHECK(cudaStreamSynchronize(s));
        p.copy_params(i, std::span(expected));
        REQUIRE(std::memcmp(on_device.data(), expected.data(), sizes[i] * sizeof(bf16)) == 0);
      }
      for (std::size_t i = sizes.size(); i-- > 0;) p.push_gradient(i, grad_of(t.rank(), step, i));
    }
    p.flush();
    CHECK(whole >= 3);    // the first upload of each tensor
    CHECK(sparse >= 10);  // the 5000- and 70000-element tensors after every step
    for (auto* d : d_param) cudaFree(d);
    cudaStreamDestroy(s);
  });
}
