// SPDX-License-Identifier: Apache-2.0
// CPU optimizers against the memory traffic they cannot avoid, in the same run:
//   BM_optim_adam_traffic/n/threads          the dense Adam access pattern (read p, g, m, v;
//                                             write p, m, v: 28 B/param) with trivial math, on
//                                             the optimizer's own arrays: the bound
//   BM_optim_adam_dense/n/threads            dense Adam step (L2 decay), 25M and 100M params
//   BM_optim_adamw_dense/n/threads           dense AdamW step (decoupled decay)
//   BM_optim_adam_dense_bf16_copy/n/threads  Adam + fused bf16 copy of the parameters (+2 B)
//   BM_optim_adam_dense_skip_tensor/n/threads  Adam under nonfinite_policy::skip_tensor (one
//                                             extra read of g before the update)
//   BM_optim_sparse_adam_gather_scatter/n/k/threads  gather p, m, v at k sorted indices into
//                                             compact arrays, then scatter them back with
//                                             trivial math: the sparse baseline
//   BM_optim_sparse_adam/n/k/threads         lazy Adam step, k sorted random updates into n
//   BM_optim_sparse_adam_per_element/n/k/threads  the same with per-element steps
//   BM_optim_sparse_sgd_gather_scatter/...   and BM_optim_sparse_sgd/...: SGD with momentum
// n = 25M (the reference's tensor) and 100M; k = 0.1%, 1% and 10% of n. Arrays are allocated
// and pre-faulted once per size and reused by every benchmark of that size (the baselines
// run on the optimizers' own arrays with math that keeps the state valid).
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "bench_support.hpp"

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <tuple>
#include <vector>

namespace sb = stellatrain::bench;
namespace st = stellatrain;

namespace {

constexpr std::int64_t n100m = 100'000'000;

// ------------------------------------------------------------------ cached state per size

struct dense_inputs {
  st::aligned_buffer<float> grad;
  st::aligned_buffer<st::bf16> copy;
};

template <class Optimizer, class Options>
Optimizer& cached_optimizer(const Options& options, std::size_t n, int variant) {
  static std::map<std::pair<std::size_t, int>, std::unique_ptr<Optimizer>> cache;
  auto& slot = cache[{n, variant}];
  if (!slot) {
    slot = std::make_unique<Optimizer>(options);
    auto init = sb::gaussian(n, 7);
    slot->add_tensor(init.span(), sb::pool(2));
  }
  return *slot;
}

st::adam_optimizer& adam_state(std::size_t n) {
  return cached_optimizer<st::adam_optimizer>(st::adam_options{.lr = 1e-4f, .weight_decay = 1e-4f},
                                              n, 0);
}
st::adam_optimizer& adamw_state(std::size_t n) {
  return cached_optimizer<st::adam_optimizer>(st::adamw_defaults, n, 1);
}
st::adam_optimizer& adam_per_element_state(std::size_t n) {
  return cached_optimizer<st::adam_optimizer>(
      st::adam_options{.lr = 1e-4f, .step_mode = st::step_count::per_element}, n, 2);
}
st::sgd_optimizer& sgd_state(std::size_t n) {
  return cached_optimizer<st::sgd_optimizer>(st::sgd_options{.lr = 1e-4f, .momentum = 0.9f}, n, 3);
}

dense_inputs& dense_inputs_for(std::size_t n) {
  static std::map<std::size_t, dense_inputs> cache;
  auto it = cache.find(n);
  if (it == cache.end()) {
    it = cache.emplace(n, dense_inputs{sb::gaussian(n, 11), sb::prefaulted<st::bf16>(n)}).first;
  }
  return it->second;
}

struct sparse_inputs {
  std::vector<std::uint32_t> indices;
  std::vector<float> values;
  std::vector<float> gathered;  // 3 x k: the baseline's compact arrays
};

const sparse_inputs& sparse_inputs_for(std::size_t n, std::size_t k) {
  static std::map<std::pair<std::size_t, std::size_t>, sparse_inputs> cache;
  auto& s = cache[{n, k}];
  if (s.indices.empty()) {
    // k distinct uniform indices, sorted (the order a merge of selections produces).
    std::mt19937_64 rng(k);
    std::vector<std::uint32_t> picked;
    picked.reserve(k + k / 8);
    std::uniform_int_distribution<std::uint32_t> pick(0, static_cast<std::uint32_t>(n - 1));
    while (picked.size() < k) {
      for (std::size_t j = picked.size(); j < k + k / 16 + 16; ++j) picked.push_back(pick(rng));
      std::sort(picked.begin(), picked.end());
      picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
    }
    std::shuffle(picked.begin(), picked.end(), rng);
    picked.resize(k);
    std::sort(picked.begin(), picked.end());
    s.indices = std::move(picked);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    s.values.resize(k);
    for (auto& v : s.values) v = dist(rng);
    s.gathered.assign(3 * k, 0.0f);
  }
  return s;
}

// Runs `fn(executor&)` with the calling thread alone for 1 thread, else the pool.
template <class Fn>
void with_executor(std::size_t threads, Fn&& fn) {
  if (threads <= 1) {
    st::inline_executor ex;
    fn(ex);
  } else {
    fn(sb::pool(threads));
  }
}

float* mutable_data(std::span<const float> s) { return const_cast<float*>(s.data()); }

// ------------------------------------------------------------------ dense

// The Adam access pattern with trivial math that keeps the state valid (v stays >= 0).
template <class Arch = xsimd::default_arch>
void adam_traffic(float* p, const float* g, float* m, float* v, std::size_t b, std::size_t e) {
  using batch = xsimd::batch<float, Arch>;
  const batch half(0.5f);
  const batch tiny(1e-9f);
  std::size_t i = b;
  for (; i + batch::size <= e; i += batch::size) {
    const batch vg = batch::load_unaligned(g + i);
    (batch::load_unaligned(p + i) + tiny * vg).store_unaligned(p + i);
    (half * batch::load_unaligned(m + i) + vg).store_unaligned(m + i);
    (half * batch::load_unaligned(v + i) + vg * vg).store_unaligned(v + i);
  }
  for (; i < e; ++i) {
    p[i] += 1e-9f * g[i];
    m[i] = 0.5f * m[i] + g[i];
    v[i] = 0.5f * v[i] + g[i] * g[i];
  }
}

void set_dense_counters(benchmark::State& state, std::size_t n, std::size_t bytes_per_param) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * bytes_per_param));
}

void BM_optim_adam_traffic(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& opt = adam_state(n);
  auto& in = dense_inputs_for(n);
  float* p = opt.params(0).data();
  float* m = mutable_data(opt.exp_avg(0));
  float* v = mutable_data(opt.exp_avg_sq(0));
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t b, std::size_t e) {
      adam_traffic(p, in.grad.data(), m, v, b, e);
    });
    benchmark::ClobberMemory();
  }
  set_dense_counters(state, n, 28);
}

template <st::adam_optimizer& (*State)(std::size_t), bool Copy = false>
void dense_adam(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& opt = State(n);
  auto& in = dense_inputs_for(n);
  const std::span<const float> g = in.grad.span();
  with_executor(threads, [&](auto& ex) {
    for (auto _ : state) {
      if constexpr (Copy) {
        opt.step(0, g, ex, st::param_copy<st::bf16>{in.copy.span()});
      } else {
        opt.step(0, g, ex);
      }
      benchmark::ClobberMemory();
    }
  });
  set_dense_counters(state, n, Copy ? 30 : 28);
}

void BM_optim_adam_dense(benchmark::State& state) { dense_adam<adam_state>(state); }
void BM_optim_adamw_dense(benchmark::State& state) { dense_adam<adamw_state>(state); }
void BM_optim_adam_dense_bf16_copy(benchmark::State& state) { dense_adam<adam_state, true>(state); }

void BM_optim_adam_dense_skip_tensor(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& opt = cached_optimizer<st::adam_optimizer>(
      st::adam_options{.lr = 1e-4f, .nonfinite = st::nonfinite_policy::skip_tensor}, n, 4);
  const std::span<const float> g = dense_inputs_for(n).grad.span();
  with_executor(threads, [&](auto& ex) {
    for (auto _ : state) {
      opt.step(0, g, ex);
      benchmark::ClobberMemory();
    }
  });
  set_dense_counters(state, n, 28);
}

void dense_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"});
  for (std::int64_t n : {sb::n25m, n100m}) {
    for (std::int64_t threads : {1, 2}) b->Args({n, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void dense_args_25m(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "threads"});
  for (std::int64_t threads : {1, 2}) b->Args({sb::n25m, threads});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_optim_adam_traffic)->Apply(dense_args);
BENCHMARK(BM_optim_adam_dense)->Apply(dense_args);
BENCHMARK(BM_optim_adamw_dense)->Apply(dense_args);
BENCHMARK(BM_optim_adam_dense_bf16_copy)->Apply(dense_args_25m);
BENCHMARK(BM_optim_adam_dense_skip_tensor)->Apply(dense_args_25m);

// ------------------------------------------------------------------ sparse

void set_sparse_counters(benchmark::State& state, std::size_t k, std::size_t arrays) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * k));
  // Bytes the updates move: index + value, and each touched state element read and written.
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * k * (8 + arrays * 8)));
}

// Gather the arrays at the indices into compact buffers, then scatter them back with trivial
// math (two plain loops, as code that densifies per touched element would be written).
template <std::size_t Arrays>
void gather_scatter(float* const (&a)[Arrays], const std::uint32_t* idx, const float* val,
                    float* compact, std::size_t b, std::size_t e, std::size_t k) {
  for (std::size_t j = b; j < e; ++j) {
    const std::uint32_t i = idx[j];
    for (std::size_t r = 0; r < Arrays; ++r) compact[r * k + j] = a[r][i];
  }
  for (std::size_t j = b; j < e; ++j) {
    const std::uint32_t i = idx[j];
    const float g = val[j];
    a[0][i] = compact[j] + 1e-9f * g;
    if constexpr (Arrays > 1) a[1][i] = 0.5f * compact[k + j] + g;
    if constexpr (Arrays > 2) a[2][i] = 0.5f * compact[2 * k + j] + g * g;
  }
}

template <std::size_t Arrays, class Optimizer>
void sparse_baseline(benchmark::State& state, Optimizer& opt, float* const (&a)[Arrays]) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto& in = sparse_inputs_for(n, k);
  (void)opt;
  float* compact = const_cast<float*>(in.gathered.data());
  for (auto _ : state) {
    sb::split_per_thread(threads, k, 1, [&](std::size_t b, std::size_t e) {
      gather_scatter(a, in.indices.data(), in.values.data(), compact, b, e, k);
    });
    benchmark::ClobberMemory();
  }
  set_sparse_counters(state, k, Arrays);
}

void BM_optim_sparse_adam_gather_scatter(benchmark::State& state) {
  auto& opt = adam_state(static_cast<std::size_t>(state.range(0)));
  float* const a[3] = {opt.params(0).data(), mutable_data(opt.exp_avg(0)),
                       mutable_data(opt.exp_avg_sq(0))};
  sparse_baseline(state, opt, a);
}

void BM_optim_sparse_sgd_gather_scatter(benchmark::State& state) {
  auto& opt = sgd_state(static_cast<std::size_t>(state.range(0)));
  float* const a[2] = {opt.params(0).data(), mutable_data(opt.momentum_buffer(0))};
  sparse_baseline(state, opt, a);
}

template <class Optimizer>
void sparse_step(benchmark::State& state, Optimizer& opt, std::size_t arrays) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto& in = sparse_inputs_for(n, k);
  const st::sparse_view<const float, const std::uint32_t> g{in.indices, in.values, n};
  with_executor(threads, [&](auto& ex) {
    for (auto _ : state) {
      opt.step(0, g, ex);
      benchmark::ClobberMemory();
    }
  });
  set_sparse_counters(state, k, arrays);
}

void BM_optim_sparse_adam(benchmark::State& state) {
  sparse_step(state, adam_state(static_cast<std::size_t>(state.range(0))), 3);
}
void BM_optim_sparse_adam_per_element(benchmark::State& state) {
  sparse_step(state, adam_per_element_state(static_cast<std::size_t>(state.range(0))), 4);
}
void BM_optim_sparse_sgd(benchmark::State& state) {
  sparse_step(state, sgd_state(static_cast<std::size_t>(state.range(0))), 2);
}

void sparse_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "k", "threads"});
  for (std::int64_t k : {sb::n25m / 1000, sb::n25m / 100, sb::n25m / 10}) {
    for (std::int64_t threads : {1, 2}) b->Args({sb::n25m, k, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void sparse_args_1pct(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "k", "threads"});
  for (std::int64_t threads : {1, 2}) b->Args({sb::n25m, sb::n25m / 100, threads});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_optim_sparse_adam_gather_scatter)->Apply(sparse_args);
BENCHMARK(BM_optim_sparse_adam)->Apply(sparse_args);
BENCHMARK(BM_optim_sparse_adam_per_element)->Apply(sparse_args_1pct);
BENCHMARK(BM_optim_sparse_sgd_gather_scatter)->Apply(sparse_args);
BENCHMARK(BM_optim_sparse_sgd)->Apply(sparse_args);

}  // namespace
