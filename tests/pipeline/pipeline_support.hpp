// SPDX-License-Identifier: Apache-2.0
// The toy model the pipeline tests train: tensor sizes, per-rank initial values and
// gradients, the training loop of one rank, and a compressor that fails on purpose.
#pragma once

#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/select/selection.hpp>

#include "catch.hpp"

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

namespace stellatrain::pipeline_test {

// A toy model: tensors of these sizes, initial values from the rank's own seed (the pipeline
// must replace them by rank 0's).
inline const std::vector<std::uint64_t> sizes{3000, 17, 5000, 1, 12000, 64};

inline std::vector<float> initial_values(std::uint64_t n, int rank, std::size_t t) {
  std::mt19937 rng(static_cast<std::uint32_t>(1000 * rank + t));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The gradient of rank r at step s for tensor t: depends on the parameters (so that gates
// matter) and on the rank's own data.
inline void gradient(std::span<const float> params, int rank, std::int64_t step, std::size_t t,
                     std::span<float> g) {
  std::mt19937 rng(static_cast<std::uint32_t>(7919 * rank + 104729 * step + 31 * t));
  std::normal_distribution<float> d(0.0f, 0.1f);
  for (std::size_t i = 0; i < g.size(); ++i)
    g[i] = 0.5f * params[i] + d(rng) + 0.01f * static_cast<float>(rank);
}

// A fixed density that keeps what the pipeline observed.
struct observing_density {
  double d = 0.05;
  std::vector<step_measurement>* seen = nullptr;
  [[nodiscard]] double density() const noexcept { return d; }
  void observe(const step_measurement& m) { seen->push_back(m); }
};

// How the gradients are handed over: copied from the application's buffer, or written into
// the pipeline's own (zero-copy).
enum class handover { copy, zero_copy };

template <class Pipeline>
void train(Pipeline& p, int rank, std::int64_t steps, std::vector<std::vector<float>>& params,
           handover mode = handover::copy) {
  std::vector<float> g;
  for (std::int64_t s = 0; s < steps; ++s) {
    const std::int64_t step = p.steps_pushed();
    for (std::size_t b = 0; b < p.bucket_count(); ++b) {
      p.wait_for_forward(b);
      const auto range = p.bucket(b);
      for (std::size_t t = range.first_tensor; t < range.first_tensor + range.tensor_count; ++t)
        p.copy_params(t, params[t]);
    }
    for (std::size_t t = p.tensor_count(); t-- > 0;) {  // backward: last tensor first
      if (mode == handover::zero_copy) {
        const std::span<float> buffer = p.gradient_buffer(t);
        REQUIRE(buffer.size() == params[t].size());
        gradient(params[t], rank, step, t, buffer);
        p.push_gradient_buffer(t);
      } else {
        g.resize(params[t].size());
        gradient(params[t], rank, step, t, g);
        p.push_gradient(t, g);
      }
    }
  }
  p.flush();
  for (std::size_t t = 0; t < p.tensor_count(); ++t) p.copy_params(t, params[t]);
}

// Registers the toy model's tensors (ids 0, 1, ...) with the initial values of `rank`.
template <class Pipeline>
void add_sizes(Pipeline& p, int rank) {
  for (std::size_t i = 0; i < sizes.size(); ++i)
    p.add_tensor(static_cast<std::uint32_t>(i), initial_values(sizes[i], rank, i));
}

// Every tensor of `a` holds the same bits as in `b`.
inline void require_same_bits(const std::vector<std::vector<float>>& a,
                              const std::vector<std::vector<float>>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t t = 0; t < a.size(); ++t) {
    REQUIRE(a[t].size() == b[t].size());
    REQUIRE(std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) == 0);
  }
}

inline std::vector<std::vector<float>> shaped_like_sizes() {
  std::vector<std::vector<float>> v;
  for (auto n : sizes) v.emplace_back(n);
  return v;
}

// The compressor `Base`, throwing "injected failure" from its `fail_at`-th compress call on
// rank `fail_rank` (set `rank` to the rank it runs on).
template <class Base>
struct failing : Base {
  using Base::Base;
  int rank = 0;
  int fail_rank = -1;
  int calls = 0;
  int fail_at = 0;
  template <executor E>
  selection_stats compress(
      E& ex, std::uint32_t id, std::span<const float> g, std::uint64_t k,
      sparse_buffer<typename Base::value_type, typename Base::index_type>& out) {
    if (rank == fail_rank && ++calls == fail_at) throw std::runtime_error("injected failure");
    return Base::compress(ex, id, g, k, out);
  }
};

}  // namespace stellatrain::pipeline_test
