// SPDX-License-Identifier: Apache-2.0
// The pipeline as a user's job runs it, for the multi-process fault tests: a few tensors in
// several buckets, deterministic gradients, a fixed density (so that every run takes the
// same steps), and a record of each tensor's parameters at each applied step. Run in one
// process over the in-process transport it gives the reference that a faulty world's
// survivors are checked against: whatever a survivor holds after the failure must be exactly
// the parameters of a completed step, never a partly applied one.
#pragma once

#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/pipeline/pipeline.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace stellatrain::test {

/// Tensor sizes of the job: with 64 KiB buckets, five buckets.
inline const std::vector<std::size_t> job_sizes{40000, 3000, 60000, 500, 20000};

/// (tensor, applied step) -> CRC32C of the tensor's parameters.
using param_record = std::map<std::pair<std::size_t, std::int64_t>, std::uint32_t>;

inline std::uint32_t checksum(std::span<const float> v) { return crc32c(std::as_bytes(v)); }

/// The parameters every tensor holds now, as (tensor, applied step) -> checksum.
template <class Pipeline>
void record_params(Pipeline& p, param_record& into) {
  std::vector<float> buf;
  for (std::size_t t = 0; t < p.tensor_count(); ++t) {
    buf.resize(job_sizes[t]);
    const auto v = p.copy_params(t, std::span<float>(buf));
    into[{t, v.step}] = checksum(buf);
  }
}

template <class Pipeline>
void run_steps(Pipeline& p, int rank, int steps, std::vector<std::vector<float>>& params,
               param_record& record, const std::function<void(int)>& before_step);

/// Trains `steps` steps on `link` and records the parameters before each step and at the end
/// (into `record`). When the training fails, records what the tensors hold then into
/// `at_failure` and rethrows. `before_step(step)` runs at the start of each step (a test arms
/// its fault there). `sizes` overrides the tensor sizes (a rank of another model).
template <class Transport>
void train_job(Transport& link, int steps, param_record& record, param_record* at_failure = nullptr,
               const std::function<void(int)>& before_step = {},
               const std::vector<std::size_t>& sizes = job_sizes) {
  const int rank = link.rank();
  thread_pool pool{1};
  pipeline p(link, pool, error_feedback_compressor<threshold_selector<>, bf16>(),
             adam_optimizer({.lr = 1e-2f}),
             {.bucket_bytes = 64 << 10, .staleness = 0, .timeout = std::chrono::seconds(20)},
             fixed_density{0.05});
  std::vector<std::vector<float>> params(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::mt19937 rng(static_cast<std::uint32_t>(1000 * rank + t));
    std::normal_distribution<float> d(0.0f, 1.0f);
    params[t].resize(sizes[t]);
    for (auto& x : params[t]) x = d(rng);
    p.add_tensor(static_cast<std::uint32_t>(t), params[t]);
  }
  p.start();
  try {
    run_steps(p, rank, steps, params, record, before_step);
  } catch (...) {
    if (at_failure != nullptr) record_params(p, *at_failure);
    throw;
  }
}

template <class Pipeline>
void run_steps(Pipeline& p, int rank, int steps, std::vector<std::vector<float>>& params,
               param_record& record, const std::function<void(int)>& before_step) {
  std::vector<float> g;
  for (int step = 0; step < steps; ++step) {
    if (before_step) before_step(step);
    for (std::size_t b = 0; b < p.bucket_count(); ++b) {
      p.wait_for_forward(b);
      const auto range = p.bucket(b);
      for (std::size_t t = range.first_tensor; t < range.first_tensor + range.tensor_count; ++t)
        p.copy_params(t, std::span<float>(params[t]));
    }
    record_params(p, record);
    for (std::size_t t = p.tensor_count(); t-- > 0;) {
      std::mt19937 rng(static_cast<std::uint32_t>(7919 * rank + 104729 * step + 31 * t));
      std::normal_distribution<float> d(0.0f, 0.1f);
      g.resize(params[t].size());
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = 0.5f * params[t][i] + d(rng) + 0.01f * static_cast<float>(rank);
      p.push_gradient(t, g);
    }
  }
  p.flush();
  record_params(p, record);
}

}  // namespace stellatrain::test
