// SPDX-License-Identifier: Apache-2.0
// Picks the best optimizer kernels for the running CPU, then checks every variant this CPU can
// run against the portable one on the same steps (they agree to rounding: FMA contraction
// differs between instruction sets) and times the chosen one.
//
//   example_optim_dispatch [elements]      (default 1,000,003)
#include "optim_kernels.hpp"

#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

using dispatch_example::optim_kernels;

struct candidate {
  const optim_kernels* kernels;
  bool runs_here;
};

std::vector<candidate> candidates() {
  std::vector<candidate> c;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (const auto* k = dispatch_example::kernels_avx512()) c.push_back({k, avx512});
  if (const auto* k = dispatch_example::kernels_avx2()) c.push_back({k, avx2});
#endif
  c.push_back({dispatch_example::kernels_portable(), true});
  return c;  // best first
}

struct run_result {
  std::vector<float> params;
  std::vector<stellatrain::bf16> copy;
  double ms_per_dense_step = 0;
};

run_result run(const optim_kernels& k, std::size_t n, stellatrain::thread_pool& pool) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> init(n), grad(n);
  for (auto& x : init) x = dist(rng);
  for (auto& x : grad) x = dist(rng);
  std::vector<std::uint32_t> idx;
  std::vector<float> val;
  for (std::size_t i = 0; i < n; i += 1 + (i % 97)) {
    idx.push_back(static_cast<std::uint32_t>(i));
    val.push_back(dist(rng));
  }
  stellatrain::adam_optimizer opt({.lr = 1e-3f, .weight_decay = 1e-2f, .amsgrad = true});
  const auto t = opt.add_tensor(init, pool);
  run_result r;
  r.copy.resize(n);
  const int steps = 10;
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) k.adam_dense(opt, t, grad, pool, r.copy);
  const auto stop = std::chrono::steady_clock::now();
  r.ms_per_dense_step = std::chrono::duration<double, std::milli>(stop - start).count() / steps;
  k.adam_sparse(opt, t, {idx, val, n}, pool);
  k.adam_dense(opt, t, grad, pool, r.copy);
  r.params.assign(opt.params(t).begin(), opt.params(t).end());
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'003;
  stellatrain::thread_pool pool{2};
  const auto all = candidates();
  const optim_kernels* chosen = nullptr;
  for (const auto& c : all) {
    std::printf("kernels %-9s %s\n", c.kernels->isa,
                c.runs_here ? "supported" : "not supported by this CPU");
    if (chosen == nullptr && c.runs_here) chosen = c.kernels;
  }
  std::printf("chosen: %s\n", chosen->isa);

  const run_result reference = run(*dispatch_example::kernels_portable(), n, pool);
  int failures = 0;
  for (const auto& c : all) {
    if (!c.runs_here) continue;
    const run_result r = run(*c.kernels, n, pool);
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double d = std::fabs(double{r.params[i]} - double{reference.params[i]});
      worst = std::max(worst, d / std::max(1.0, std::fabs(double{reference.params[i]})));
      if (to_float(r.copy[i]) != to_float(stellatrain::bf16(r.params[i]))) ++failures;
    }
    // 12 steps that each move a parameter by ~1e-3: ISAs that round differently (FMA
    // contraction) stay within a few ulp of it.
    const std::size_t conversions = c.kernels->conversion_mismatches();
    const bool ok = worst <= 1e-6 && conversions == 0;
    failures += ok ? 0 : 1;
    std::printf(
        "%-9s %8.3f ms per dense Adam step of %zu params (2 threads); max deviation from portable "
        "%.2e; "
        "fp16/bf16 conversion mismatches %zu: %s\n",
        c.kernels->isa, r.ms_per_dense_step, n, worst, conversions, ok ? "ok" : "FAILED");
  }
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
