// SPDX-License-Identifier: Apache-2.0
// CPU optimizers against the memory traffic they cannot avoid, in the same run:
//   BM_optim_adam_traffic/n/threads          the dense Adam access pattern (read p, g, m, v;
//                                             write p, m, v: 28 B/param of data; with ordinary
//                                             stores each written line is read first, so 40
//                                             B/param cross the memory bus) with trivial math,
//                                             on the optimizer's own arrays: the bound
//   BM_optim_adam_dense/n/threads            dense Adam step (L2 decay), 25M and 100M params
//   BM_optim_adamw_dense/n/threads           dense AdamW step (decoupled decay)
//   BM_optim_adam_dense_bf16_copy/n/threads  Adam + fused bf16 copy of the parameters (+2 B)
//   BM_optim_adam_dense_skip_tensor/n/threads  Adam under nonfinite_policy::skip_tensor (one
//                                             extra read of g before the update)
//   BM_optim_adam_array_offsets/n/stagger    the dense Adam kernel on p, g, m, v allocated one
//                                             after another, array a starting a * stagger bytes
//                                             past its 2 MiB boundary: stagger 0 is how the
//                                             optimizer placed its arrays before it staggered
//                                             them (tensor_registry::array_stagger)
//   BM_optim_sparse_adam_gather_scatter/n/k/threads  gather p, m, v at k sorted indices into
//                                             compact arrays, then scatter them back with
//                                             trivial math: the sparse baseline
//   BM_optim_sparse_adam/n/k/threads         lazy Adam step, k sorted random updates into n
//   BM_optim_sparse_adam_per_element/n/k/threads  the same with per-element steps
//   BM_optim_sparse_sgd_gather_scatter/...   and BM_optim_sparse_sgd/...: SGD with momentum
// and against the peers' techniques, written here from their descriptions (AVX-512 builds):
//   BM_optim_adam_unrolled_avx512/n/threads  Adam (L2 decay) as DeepSpeed's CPU Adam writes it:
//                                             intrinsics, 8 vectors of every array per
//                                             iteration, ordinary stores
//   BM_optim_sparse_sgd_gather_avx512/n/k/threads  SGD with momentum as the StellaTrain
//                                             reference writes it: 16-lane gathers and
//                                             scatters, 32 updates per iteration, one prefetch
//                                             per group
// n = 25M (the reference's tensor) and 100M; k = 0.1%, 1% and 10% of n. Arrays are allocated
// and pre-faulted once per size and reused by every benchmark of that size (the baselines
// run on the optimizers' own arrays with math that keeps the state valid).
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "bench_support.hpp"

#include <xsimd/xsimd.hpp>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
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

void BM_optim_adam_array_offsets(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto stagger = static_cast<std::size_t>(state.range(1));
  auto array = [&](std::size_t a) {
    return st::aligned_buffer<float>(n, {.prefault = true, .offset = a * stagger}, sb::pool(2));
  };
  st::aligned_buffer<float> p = array(0), g = array(1), m = array(2), v = array(3);
  std::fill(g.begin(), g.end(), 1e-3f);
  const st::detail::tensor_arrays arrays{.params = p.data(), .s0 = m.data(), .s1 = v.data()};
  const st::adam_optimizer& opt = adam_state(n);  // its options: lr 1e-4, L2 decay 1e-4
  std::uint64_t step = 1000;
  for (auto _ : state) {
    opt.with_rule(++step, [&](const auto& rule) {
      st::detail::dense_chunk<xsimd::default_arch>(rule, arrays, g.data(),
                                                   static_cast<st::bf16*>(nullptr), 0, n);
    });
    benchmark::ClobberMemory();
  }
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
BENCHMARK(BM_optim_adam_array_offsets)
    ->ArgNames({"n", "stagger"})
    ->Args({n100m, 0})
    ->Args({n100m, st::detail::tensor_registry::array_stagger})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Adam with L2 decay in the peer's form: per iteration 8 vectors (128 elements) of each array.
// The bias corrections of step k are folded into `step_size` (-lr / bc1) and `rsqrt_bc2`.
struct adam_scalars {
  float beta1, beta2, eps, weight_decay, step_size, rsqrt_bc2;
};

#if defined(__AVX512F__)
void adam_unrolled_avx512(float* p, const float* g, float* m, float* v, std::size_t b,
                          std::size_t e, const adam_scalars& s) {
  constexpr std::size_t span = 8;
  constexpr std::size_t step = 16 * span;
  // The masked forms with every lane on: the unmasked ones start from an undefined register,
  // which GCC 12 reports as maybe-uninitialized.
  constexpr auto all = static_cast<__mmask16>(0xffff);
  const __m512 b1 = _mm512_set1_ps(s.beta1);
  const __m512 b2 = _mm512_set1_ps(s.beta2);
  const __m512 one_b1 = _mm512_set1_ps(1.0f - s.beta1);
  const __m512 one_b2 = _mm512_set1_ps(1.0f - s.beta2);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 wd = _mm512_set1_ps(s.weight_decay);
  const __m512 lr = _mm512_set1_ps(s.step_size);
  const __m512 bc2 = _mm512_set1_ps(s.rsqrt_bc2);
  std::size_t i = b;
  for (; i + step <= e; i += step) {
    __m512 vg[span], vm[span], vv[span], vp[span];
    for (std::size_t u = 0; u < span; ++u) vg[u] = _mm512_loadu_ps(g + i + 16 * u);
    for (std::size_t u = 0; u < span; ++u) vm[u] = _mm512_loadu_ps(m + i + 16 * u);
    for (std::size_t u = 0; u < span; ++u) vv[u] = _mm512_loadu_ps(v + i + 16 * u);
    for (std::size_t u = 0; u < span; ++u) vp[u] = _mm512_loadu_ps(p + i + 16 * u);
    for (std::size_t u = 0; u < span; ++u) {
      const __m512 gd = _mm512_fmadd_ps(vp[u], wd, vg[u]);
      vm[u] = _mm512_fmadd_ps(gd, one_b1, _mm512_mul_ps(vm[u], b1));
      vv[u] = _mm512_fmadd_ps(_mm512_mul_ps(gd, gd), one_b2, _mm512_mul_ps(vv[u], b2));
      const __m512 denom = _mm512_fmadd_ps(_mm512_maskz_sqrt_ps(all, vv[u]), bc2, eps);
      vp[u] = _mm512_fmadd_ps(_mm512_div_ps(vm[u], denom), lr, vp[u]);
    }
    for (std::size_t u = 0; u < span; ++u) _mm512_storeu_ps(p + i + 16 * u, vp[u]);
    for (std::size_t u = 0; u < span; ++u) _mm512_storeu_ps(m + i + 16 * u, vm[u]);
    for (std::size_t u = 0; u < span; ++u) _mm512_storeu_ps(v + i + 16 * u, vv[u]);
  }
  for (; i < e; ++i) {
    const float gd = g[i] + s.weight_decay * p[i];
    m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * gd;
    v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * gd * gd;
    p[i] += s.step_size * m[i] / (std::sqrt(v[i]) * s.rsqrt_bc2 + s.eps);
  }
}
#endif

void BM_optim_adam_unrolled_avx512(benchmark::State& state) {
#if defined(__AVX512F__)
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto& opt = adam_state(n);  // its arrays, and its options (lr 1e-4, weight decay 1e-4)
  auto& in = dense_inputs_for(n);
  float* p = opt.params(0).data();
  float* m = mutable_data(opt.exp_avg(0));
  float* v = mutable_data(opt.exp_avg_sq(0));
  std::uint64_t k = 1000;  // any late step: the corrections are scalars of the call
  for (auto _ : state) {
    ++k;
    const double bc1 = 1.0 - std::pow(0.9, static_cast<double>(k));
    const double bc2 = 1.0 - std::pow(0.999, static_cast<double>(k));
    const adam_scalars s{0.9f,
                         0.999f,
                         1e-8f,
                         1e-4f,
                         static_cast<float>(-1e-4 / bc1),
                         static_cast<float>(1.0 / std::sqrt(bc2))};
    sb::split_per_thread(threads, n, 128, [&](std::size_t b, std::size_t e) {
      adam_unrolled_avx512(p, in.grad.data(), m, v, b, e, s);
    });
    benchmark::ClobberMemory();
  }
  set_dense_counters(state, n, 28);
#else
  state.SkipWithError("needs a build for AVX-512 (bench-native on an AVX-512 CPU)");
#endif
}

BENCHMARK(BM_optim_adam_unrolled_avx512)->Apply(dense_args);

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

// SGD with momentum in the peer's form: b = momentum * b + (1 - dampening) * g; p -= lr * b,
// 32 updates per iteration as two 16-lane gathers and scatters of each array, the lines of
// each group's first index prefetched. Distinct indices only (a scatter of equal indices keeps
// one of the updates), as in the benchmark's inputs.
#if defined(__AVX512F__)
void sgd_gather_avx512(float* p, float* mom, const std::uint32_t* idx, const float* val,
                       std::size_t b, std::size_t e, float lr, float momentum) {
  const __m512 vlr = _mm512_set1_ps(-lr);
  const __m512 vmom = _mm512_set1_ps(momentum);
  // The masked gather with every lane on (see adam_unrolled_avx512).
  auto gather = [](__m512i i, const float* base) {
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), static_cast<__mmask16>(0xffff), i, base,
                                    4);
  };
  std::size_t j = b;
  for (; j + 32 <= e; j += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(p + idx[j]), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(p + idx[j + 16]), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(mom + idx[j]), _MM_HINT_NTA);
    _mm_prefetch(reinterpret_cast<const char*>(mom + idx[j + 16]), _MM_HINT_NTA);
    const __m512i i0 = _mm512_loadu_si512(idx + j);
    const __m512i i1 = _mm512_loadu_si512(idx + j + 16);
    const __m512 b0 = gather(i0, mom);
    const __m512 b1 = gather(i1, mom);
    const __m512 x0 = gather(i0, p);
    const __m512 x1 = gather(i1, p);
    const __m512 n0 = _mm512_fmadd_ps(vmom, b0, _mm512_loadu_ps(val + j));
    const __m512 n1 = _mm512_fmadd_ps(vmom, b1, _mm512_loadu_ps(val + j + 16));
    _mm512_i32scatter_ps(mom, i0, n0, 4);
    _mm512_i32scatter_ps(mom, i1, n1, 4);
    _mm512_i32scatter_ps(p, i0, _mm512_fmadd_ps(vlr, n0, x0), 4);
    _mm512_i32scatter_ps(p, i1, _mm512_fmadd_ps(vlr, n1, x1), 4);
  }
  for (; j < e; ++j) {
    const std::uint32_t i = idx[j];
    mom[i] = momentum * mom[i] + val[j];
    p[i] -= lr * mom[i];
  }
}
#endif

void BM_optim_sparse_sgd_gather_avx512(benchmark::State& state) {
#if defined(__AVX512F__)
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  auto& opt = sgd_state(n);
  float* p = opt.params(0).data();
  float* mom = mutable_data(opt.momentum_buffer(0));
  const auto& in = sparse_inputs_for(n, k);
  for (auto _ : state) {
    sb::split_per_thread(threads, k, 32, [&](std::size_t b, std::size_t e) {
      sgd_gather_avx512(p, mom, in.indices.data(), in.values.data(), b, e, 1e-4f, 0.9f);
    });
    benchmark::ClobberMemory();
  }
  set_sparse_counters(state, k, 2);
#else
  state.SkipWithError("needs a build for AVX-512 (bench-native on an AVX-512 CPU)");
#endif
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
BENCHMARK(BM_optim_sparse_sgd_gather_avx512)->Apply(sparse_args);

}  // namespace
