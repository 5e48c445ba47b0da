// SPDX-License-Identifier: Apache-2.0
// CPU selection and compression on 25M fp32 gradients, k = 1%, with their baselines in the
// same binary (ratios are read from one run):
//   BM_select_stream_read/threads:T     sum of the gradient (one read pass)
//   BM_select_read2_write1/threads:T    c = a + b (the traffic of error feedback)
//   BM_select_nth_element               |g| copied, then std::nth_element at k
//   BM_select_exact/threads:T           exact_topk_selector
//   BM_select_threshold/threads:T       threshold_selector in steady state
//   BM_select_sampled/threads:T         sampled_threshold_selector
//   BM_select_block/score:S/threads:T   block_topk_selector (S = 1: L1, 2: L2)
//   BM_select_random_k/threads:T        random_k_selector
//   BM_select_partitioned/threads:T     rank 0 of 4 (exact top k/4 of a quarter)
//   BM_select_threshold_ef/threads:T    error_feedback_compressor<threshold_selector<>, float>,
//   threshold, fused pass,
//                                       a new (AR(1), correlation 0.76) gradient every step
//   BM_select_threshold_ef_bf16/threads:T  the same sending bf16
//   BM_select_threshold_ef_rotating/threads:T  the same as _ef on a gradient that repeats
//                                       every 9 steps (stress case of the persistent bound)
//   BM_select_chunked/bits:B            chunked_codec, the top 64 of every 4096 with B-bit
//                                       values and error feedback (decay 0.95), 1 thread;
//                                       counter bits_per_kept: payload bits per sent element
//   BM_select_threshold_drift           100 steps of a slowly drifting gradient, 1 thread;
//                                       counters: slowest / median call (thread CPU time,
//                                       least of 3 runs of each call from the same state)
//   BM_select_energy                    energy kept vs exact top-k (counters), Gaussian and
//                                       row-correlated gradients
// Inputs are pre-faulted outside the timed loops; bytes processed count the bytes the
// kernel must stream (the gradient; for error feedback also the residual read and written).
#include <stellatrain/compress/chunked_codec.hpp>
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>
#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/threshold.hpp>

#include "bench_support.hpp"

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <random>
#include <span>
#include <vector>

namespace sb = stellatrain::bench;
using namespace stellatrain;

namespace {

using batch = xsimd::batch<float>;
// Sizes read at run time: with compile-time constants GCC warns (wrongly) about the scalar
// tails of the baseline loops.
std::uint64_t tensor_elements() {
  static volatile std::uint64_t v = sb::n25m;
  return v;
}
const std::uint64_t n = tensor_elements();
const std::uint64_t k = n / 100;

const aligned_buffer<float>& gradient() {
  static const auto g = sb::gaussian(n, 1);
  return g;
}

// Rows of 256 whose scale is log-normal (a few rows carry most of the magnitude).
const aligned_buffer<float>& row_gradient() {
  static const auto g = [] {
    auto b = sb::gaussian(n, 2);
    std::mt19937_64 rng(3);
    std::lognormal_distribution<float> scale(0.0f, 1.5f);
    for (std::uint64_t r = 0; r < n; r += 256) {
      const float s = scale(rng);
      for (std::uint64_t i = r; i < std::min(n, r + 256); ++i) b[i] *= s;
    }
    return b;
  }();
  return g;
}

// Runs `fn(executor)` on the calling thread for 1 thread, on the shared pool otherwise.
template <class Fn>
void on_threads(std::size_t threads, Fn&& fn) {
  if (threads <= 1) {
    inline_executor ex;
    fn(ex);
  } else {
    fn(sb::pool(threads));
  }
}

void set_bytes(benchmark::State& state, std::uint64_t bytes_per_iteration) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes_per_iteration));
}

float sum_range(const float* p, std::size_t count) {
  constexpr std::size_t w = batch::size;
  batch a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  std::size_t i = 0;
  for (; i + 4 * w <= count; i += 4 * w) {
    a0 += batch::load_unaligned(p + i);
    a1 += batch::load_unaligned(p + i + w);
    a2 += batch::load_unaligned(p + i + 2 * w);
    a3 += batch::load_unaligned(p + i + 3 * w);
  }
  float s = detail::reduce_add((a0 + a1) + (a2 + a3));
  for (; i < count; ++i) s += p[i];
  return s;
}

void BM_select_stream_read(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  std::vector<float> partial(threads);
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t b, std::size_t e) {
      partial[b * threads / n] = sum_range(x.data() + b, e - b);
    });
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n * sizeof(float));
}

void BM_select_chunked(benchmark::State& state) {
  const auto bits = static_cast<chunk_value_bits>(state.range(0));
  const auto& g = gradient();
  static auto feedback = sb::prefaulted<float>(n);
  std::fill(feedback.data(), feedback.data() + n, 0.0f);
  chunked_codec codec({.chunk_bits = 12, .k = 64, .bits = bits, .decay = 0.95f});
  chunked_selection out;
  const std::span<const float> in(g.data(), n);
  const std::span<float> f(feedback.data(), n);
  codec.encode(in, f, out);  // sizes the output outside the timed loop
  for (auto _ : state) {
    codec.encode(in, f, out);
    benchmark::DoNotOptimize(out.codes.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n * sizeof(float));
  state.counters["bits_per_kept"] =
      static_cast<double>(out.payload_bits()) / static_cast<double>(out.indices.size());
}

void BM_select_read2_write1(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& a = gradient();
  static auto b = sb::gaussian(n, 4);
  static auto c = sb::prefaulted<float>(n);
  for (auto _ : state) {
    sb::split_per_thread(threads, n, 64, [&](std::size_t begin, std::size_t end) {
      std::size_t i = begin;
      for (; i + batch::size <= end; i += batch::size) {
        (batch::load_unaligned(a.data() + i) + batch::load_unaligned(b.data() + i))
            .store_unaligned(c.data() + i);
      }
      for (; i < end; ++i) c[i] = a[i] + b[i];
    });
    benchmark::ClobberMemory();
  }
  set_bytes(state, 3 * n * sizeof(float));
}

void BM_select_nth_element(benchmark::State& state) {
  const auto& x = gradient();
  static auto copy = sb::prefaulted<float>(n);
  for (auto _ : state) {
    std::transform(x.begin(), x.end(), copy.begin(), [](float v) { return std::abs(v); });
    std::nth_element(copy.begin(), copy.begin() + (k - 1), copy.end(), std::greater<float>());
    benchmark::DoNotOptimize(copy[k - 1]);
  }
  set_bytes(state, n * sizeof(float));
}

struct outputs {
  aligned_buffer<std::uint32_t> idx = sb::prefaulted<std::uint32_t>(k);
  aligned_buffer<float> val = sb::prefaulted<float>(k);
};

outputs& out() {
  static outputs o;
  return o;
}

void BM_select_exact(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  exact_topk_selector<> sel;
  sel.reserve(sb::pool(2), n, k);
  on_threads(threads, [&](auto& ex) {
    for (auto _ : state) sel.select(ex, x.span(), k, out().idx.span(), out().val.span());
  });
  set_bytes(state, n * sizeof(float));
}

void BM_select_threshold(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  threshold_selector<> sel;
  threshold_state st;
  sel.reserve(sb::pool(2), n, k);
  on_threads(threads, [&](auto& ex) {
    sel.select(ex, st, x.span(), k, out().idx.span(), out().val.span());  // bootstrap
    for (auto _ : state) sel.select(ex, st, x.span(), k, out().idx.span(), out().val.span());
  });
  state.counters["deficits"] = static_cast<double>(st.deficits);
  state.counters["fallbacks"] = static_cast<double>(st.fallbacks);
  set_bytes(state, n * sizeof(float));
}

void BM_select_sampled(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  sampled_threshold_selector<> sel;
  sel.reserve(sb::pool(2), n, k);
  on_threads(threads, [&](auto& ex) {
    for (auto _ : state) sel.select(ex, x.span(), k, out().idx.span(), out().val.span());
  });
  set_bytes(state, n * sizeof(float));
}

void BM_select_block(benchmark::State& state) {
  const auto score = state.range(0) == 1 ? block_score::l1 : block_score::l2;
  const auto threads = static_cast<std::size_t>(state.range(1));
  const auto& x = gradient();
  block_topk_selector<> sel({.score = score});
  sel.reserve(sb::pool(2), n, k);
  block_selection_stats st;
  on_threads(threads, [&](auto& ex) {
    for (auto _ : state) st = sel.select(ex, x.span(), k, out().idx.span(), out().val.span());
  });
  state.counters["energy"] = st.energy_fraction();
  set_bytes(state, n * sizeof(float));
}

void BM_select_random_k(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  random_k_selector<> sel;
  sel.reserve(sb::pool(2), n);
  std::uint32_t step = 0;
  on_threads(threads, [&](auto& ex) {
    for (auto _ : state) {
      sel.select(ex, random_key{.seed = 1, .step = step++}, x.span(), k, out().idx.span(),
                 out().val.span());
    }
  });
  set_bytes(state, k * sizeof(float));
}

void BM_select_partitioned(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const auto& x = gradient();
  partitioned_selector<> sel({.rank = 0, .parts = 4});
  sel.reserve(sb::pool(2), n, k);
  std::uint64_t step = 0;
  on_threads(threads, [&](auto& ex) {
    for (auto _ : state) sel.select(ex, step++, x.span(), k, out().idx.span(), out().val.span());
  });
  set_bytes(state, n / 4 * sizeof(float));
}

const aligned_buffer<float>& second_gradient() {
  static const auto g = sb::gaussian(n, 5);
  return g;
}

// x = s (cos(a) G1 + sin(a) G2): an N(0, s^2) gradient; moving `a` a little makes the next
// step's gradient correlated with this one.
void rotate_gradient(aligned_buffer<float>& x, float angle, float scale) {
  const auto& g1 = gradient();
  const auto& g2 = second_gradient();
  const float a = scale * std::cos(angle);
  const float b = scale * std::sin(angle);
  sb::split_per_thread(2, n, 64, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) x[i] = a * g1[i] + b * g2[i];
  });
}

// The next gradient of an AR(1) sequence: x = rho x + sqrt(1 - rho^2) z, with z a fresh
// N(0, 1) vector (G2 read from a pseudo-random offset that changes every step, so that z is
// independent of earlier steps'), x staying N(0, 1) with correlation rho to the step before.
void ar1_gradient(aligned_buffer<float>& x, int step, float rho) {
  const auto& g1 = gradient();
  const auto& g2 = second_gradient();
  if (step == 0) {
    std::copy(g1.begin(), g1.end(), x.begin());
    return;
  }
  const std::uint64_t offset = (static_cast<std::uint64_t>(step) * 0x9E3779B97F4A7C15ull >> 11) % n;
  const float c = std::sqrt(1.0f - rho * rho);
  sb::split_per_thread(2, n, 64, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      const std::size_t j = i + offset < n ? i + offset : i + offset - n;
      x[i] = rho * x[i] + c * g2[j];
    }
  });
}

enum class gradient_model { ar1, rotating };

// Error feedback on a new gradient every step (correlation 0.76 with the step before), after
// 30 steps of warm-up so that the residual has reached its usual size. Only compress() is
// timed: the new gradient is written with the timer paused, so it arrives from DRAM as it
// would from the device. Two gradient sequences:
// - ar1: fresh noise every step (the target's case): the accumulated residual's magnitudes
//   drift slowly, as in training, and every timed call is a normal one-pass call;
// - rotating: x_t = cos(0.7 t) G1 + sin(0.7 t) G2, which repeats every 9 steps, so that the
//   residual's magnitudes swing by a large factor from one step to the next: a stress case
//   for the persistent bound (see the deficits and fallbacks counters).
template <class Value, gradient_model Model>
void threshold_ef(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  static auto g = sb::prefaulted<float>(n);
  error_feedback_compressor<threshold_selector<>, Value> ef;
  ef.add_tensor(sb::pool(2), 0, n, k);
  sparse_buffer<Value> sel(n, k, {.prefault = true});
  int step = 0;
  auto next_gradient = [&] {
    if constexpr (Model == gradient_model::ar1) {
      ar1_gradient(g, step, 0.76f);
    } else {
      rotate_gradient(g, 0.7f * static_cast<float>(step), 1.0f);
    }
    ++step;
  };
  std::uint64_t warm_deficits = 0;
  std::uint64_t warm_fallbacks = 0;
  on_threads(threads, [&](auto& ex) {
    while (step < 30) {
      next_gradient();
      ef.compress(ex, 0, g.span(), k, sel);
    }
    warm_deficits = ef.selection_state(0).deficits;
    warm_fallbacks = ef.selection_state(0).fallbacks;
    for (auto _ : state) {
      state.PauseTiming();
      next_gradient();
      state.ResumeTiming();
      ef.compress(ex, 0, g.span(), k, sel);
    }
  });
  // Of the timed calls only.
  state.counters["deficits"] = static_cast<double>(ef.selection_state(0).deficits - warm_deficits);
  state.counters["fallbacks"] =
      static_cast<double>(ef.selection_state(0).fallbacks - warm_fallbacks);
  set_bytes(state, 3 * n * sizeof(float));
}

void BM_select_threshold_ef(benchmark::State& state) {
  threshold_ef<float, gradient_model::ar1>(state);
}
void BM_select_threshold_ef_bf16(benchmark::State& state) {
  threshold_ef<bf16, gradient_model::ar1>(state);
}
void BM_select_threshold_ef_rotating(benchmark::State& state) {
  threshold_ef<float, gradient_model::rotating>(state);
}

double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

// 100 steps of x_t = (1 + 0.05 sin(t / 7)) (cos(a t) G1 + sin(a t) G2), a = 0.02: every step
// an N(0, s_t^2) gradient, each element moving a little from the step before. Each call is
// timed as the least thread CPU time of 3 runs from the same state (a copy): the cost of the
// call itself, without the preemption and memory contention of a shared machine; wall time
// (one run) is reported too.
void BM_select_threshold_drift(benchmark::State& state) {
  static auto x = sb::prefaulted<float>(n);
  constexpr int steps = 100;
  threshold_selector<> sel;
  sel.reserve(sb::pool(2), n, k);
  inline_executor ex;
  std::vector<double> cpu;
  std::vector<double> wall;
  for (auto _ : state) {
    threshold_state st;
    cpu.clear();
    wall.clear();
    double total = 0;
    for (int t = 0; t < steps; ++t) {
      rotate_gradient(x, 0.02f * static_cast<float>(t),
                      1.0f + 0.05f * std::sin(static_cast<float>(t) / 7.0f));
      const threshold_state before = st;
      double best = 1e30;
      for (int run = 0; run < 3; ++run) {
        st = before;
        const double c0 = thread_cpu_ms();
        const auto w0 = std::chrono::steady_clock::now();
        sel.select(ex, st, x.span(), k, out().idx.span(), out().val.span());
        const double w =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0)
                .count();
        best = std::min(best, thread_cpu_ms() - c0);
        if (run == 0) {
          wall.push_back(w);
          total += w;
        }
      }
      cpu.push_back(best);
    }
    state.SetIterationTime(total / 1e3);
    state.counters["deficits"] = static_cast<double>(st.deficits);
    state.counters["fallbacks"] = static_cast<double>(st.fallbacks);
    state.counters["bootstraps"] = static_cast<double>(st.bootstraps);
  }
  auto ratio = [](std::vector<double> v) {
    v.erase(v.begin());  // the bootstrap call is an exact selection: not part of the steady state
    std::sort(v.begin(), v.end());
    return v.back() / v[v.size() / 2];
  };
  state.counters["slowest_over_median"] = ratio(cpu);
  state.counters["slowest_over_median_wall"] = ratio(wall);
  std::sort(cpu.begin() + 1, cpu.end());
  state.counters["median_ms"] = cpu[cpu.size() / 2];
  state.counters["slowest_ms"] = cpu.back();
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n * steps));
}

// Energy (sum of squares) each selector keeps, over the energy of the exact top k.
void BM_select_energy(benchmark::State& state) {
  inline_executor ex;
  exact_topk_selector<> exact;
  threshold_selector<> threshold;
  sampled_threshold_selector<> sampled;
  block_topk_selector<> block_l1({.score = block_score::l1});
  block_topk_selector<> block_l2({.score = block_score::l2});
  random_k_selector<> random;
  auto kept = [&](const aligned_buffer<float>& x) {
    double e = 0;
    for (std::uint64_t j = 0; j < k; ++j) e += static_cast<double>(out().val[j]) * out().val[j];
    (void)x;
    return e;
  };
  for (auto _ : state) {
    for (int which = 0; which < 2; ++which) {
      // Gaussian: the threshold's bound comes from one gradient and selects from another,
      // independent one (the i.i.d. case). Rows: both calls see the same gradient.
      const auto& x = which == 0 ? second_gradient() : row_gradient();
      const auto& before = which == 0 ? gradient() : row_gradient();
      const char* tag = which == 0 ? "_gaussian" : "_rows";
      exact.select(ex, x.span(), k, out().idx.span(), out().val.span());
      const double best = kept(x);
      threshold_state st;
      threshold.select(ex, st, before.span(), k, out().idx.span(), out().val.span());
      threshold.select(ex, st, x.span(), k, out().idx.span(), out().val.span());
      state.counters[std::string("threshold") + tag] = kept(x) / best;
      sampled.select(ex, x.span(), k, out().idx.span(), out().val.span());
      state.counters[std::string("sampled") + tag] = kept(x) / best;
      block_l1.select(ex, x.span(), k, out().idx.span(), out().val.span());
      state.counters[std::string("block_l1") + tag] = kept(x) / best;
      block_l2.select(ex, x.span(), k, out().idx.span(), out().val.span());
      state.counters[std::string("block_l2") + tag] = kept(x) / best;
      random.select(ex, {.seed = 1}, x.span(), k, out().idx.span(), out().val.span());
      state.counters[std::string("random") + tag] = kept(x) / best;
    }
  }
}

void threads_arg(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads"})->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK(BM_select_stream_read)->Apply(threads_arg);
BENCHMARK(BM_select_read2_write1)->Apply(threads_arg);
BENCHMARK(BM_select_nth_element)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_exact)->Apply(threads_arg);
BENCHMARK(BM_select_threshold)->Apply(threads_arg);
BENCHMARK(BM_select_sampled)->Apply(threads_arg);
BENCHMARK(BM_select_block)
    ->ArgNames({"score", "threads"})
    ->Args({1, 1})
    ->Args({2, 1})
    ->Args({1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_random_k)->Apply(threads_arg);
BENCHMARK(BM_select_chunked)
    ->ArgName("bits")
    ->Arg(1)
    ->Arg(2)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_partitioned)->Apply(threads_arg);
BENCHMARK(BM_select_threshold_ef)->Apply(threads_arg);
BENCHMARK(BM_select_threshold_ef_bf16)->Apply(threads_arg);
BENCHMARK(BM_select_threshold_ef_rotating)->Apply(threads_arg);
BENCHMARK(BM_select_threshold_drift)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_select_energy)->Iterations(1)->Unit(benchmark::kMillisecond);
