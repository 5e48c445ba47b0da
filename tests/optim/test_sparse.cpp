// SPDX-License-Identifier: Apache-2.0
// Sparse ("lazy") steps: per-tensor and per-element step counting against the references,
// equivalence with dense steps, duplicates, index errors that write nothing, non-finite
// policies, parameter copies, and independence from the thread count.
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "catch.hpp"
#include "optim_reference.hpp"
#include "optim_test_support.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using namespace stellatrain;
using namespace optim_test;

namespace {

#if defined(__FMA__)
constexpr double sgd_rel = 1e-6;
constexpr double sgd_abs = 1e-7;
#else
constexpr double sgd_rel = 0.0;  // same operations in the same order: identical bits
constexpr double sgd_abs = 0.0;
#endif
constexpr double adam_rel = 1e-6;  // see test_dense.cpp
constexpr double adam_abs = 1e-6;

template <class Index>
using view = sparse_view<const float, const Index>;

template <class Index, class Optimizer, class Reference>
void compare_lazy(Optimizer& opt, Reference& ref, std::size_t n, double density, int steps,
                  double rel, double abs, std::uint64_t seed) {
  const auto t = opt.add_tensor(ref.p);
  for (int s = 0; s < steps; ++s) {
    const auto count = static_cast<std::size_t>(std::ceil(density * static_cast<double>(n)));
    const auto idx = sorted_indices<Index>(n, count, seed * 100 + static_cast<std::uint64_t>(s));
    auto val = normal(idx.size(), seed * 100 + 50 + static_cast<std::uint64_t>(s),
                      s % 4 == 0 ? 2.0f : 0.3f);
    ref.sparse(idx, val);
    const auto r = opt.step(t, view<Index>{idx, val, n});
    REQUIRE(r.applied);
    REQUIRE(r.updated == idx.size());
    INFO("n = " << n << ", step " << s + 1);
    REQUIRE(first_mismatch(ref.p, opt.params(t), rel, abs) == -1);
  }
}

}  // namespace

TEST_CASE("lazy SGD counts first steps per tensor or per element", "[optim][sgd][sparse]") {
  const std::vector<sgd_options> cases{
      {.lr = 0.05f, .momentum = 0.9f},
      {.lr = 0.05f, .momentum = 0.8f, .dampening = 0.3f, .weight_decay = 0.01f},
      {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.05f, .nesterov = true, .maximize = true},
      {.lr = 0.1f, .weight_decay = 0.2f},
  };
  std::uint64_t seed = 1;
  for (auto o : cases) {
    for (auto mode : {step_count::per_tensor, step_count::per_element}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{1000}}) {
        o.step_mode = mode;
        sgd_optimizer opt(o);
        reference_sgd ref(
            o, normal(n, seed),
            mode == step_count::per_tensor ? counting::per_tensor : counting::per_element);
        compare_lazy<std::uint32_t>(opt, ref, n, 0.3, 25, sgd_rel, sgd_abs, ++seed);
        if (mode == step_count::per_element) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(opt.element_steps(0)[i] == ref.touches[i]);
        } else {
          CHECK(opt.element_steps(0).empty());
        }
      }
    }
  }
}

TEST_CASE("the two counting modes differ where they should", "[optim][sgd][adam][sparse]") {
  // Element 1 is first touched at the tensor's second step.
  const std::vector<std::uint32_t> i0{0};
  const std::vector<std::uint32_t> i1{1};
  const std::vector<float> g{1.0f};
  for (auto mode : {step_count::per_tensor, step_count::per_element}) {
    sgd_optimizer s({.lr = 1.0f, .momentum = 0.5f, .dampening = 0.5f, .step_mode = mode});
    s.add_tensor(std::vector<float>{0.0f, 0.0f});
    s.step(0, view<std::uint32_t>{i0, g, 2});
    s.step(0, view<std::uint32_t>{i1, g, 2});
    // per tensor: not the first step, buf = 0.5 * 0 + (1 - 0.5) * 1; per element: buf = g.
    CHECK(s.momentum_buffer(0)[1] == (mode == step_count::per_tensor ? 0.5f : 1.0f));
    CHECK(s.momentum_buffer(0)[0] == 1.0f);

    adam_optimizer a({.lr = 1.0f, .beta1 = 0.5f, .beta2 = 0.5f, .eps = 0.0f, .step_mode = mode});
    a.add_tensor(std::vector<float>{0.0f, 0.0f});
    a.step(0, view<std::uint32_t>{i0, g, 2});
    a.step(0, view<std::uint32_t>{i1, g, 2});
    // per element: a first step moves by exactly lr; per tensor: bias correction of step 2,
    // -lr * (0.5 / 0.75) / (sqrt(0.5) / sqrt(0.75)).
    const float expected =
        mode == step_count::per_element
            ? -1.0f
            : static_cast<float>(-(0.5 / 0.75) / (std::sqrt(0.5) / std::sqrt(0.75)));
    CHECK(a.params(0)[1] == Approx(expected).epsilon(1e-6));
    CHECK(a.params(0)[0] == Approx(-1.0f).epsilon(1e-6));
    CHECK(a.step_count_of(0) == 2);
  }
}

TEST_CASE("lazy Adam counts bias-correction steps per tensor or per element",
          "[optim][adam][sparse]") {
  const std::vector<adam_options> cases{
      {.lr = 1e-2f},
      {.lr = 2e-2f, .beta2 = 0.99f, .eps = 0.01f, .weight_decay = 0.1f},
      {.lr = 1e-2f, .weight_decay = 0.2f, .decay = weight_decay_mode::decoupled, .maximize = true},
      {.lr = 2e-2f, .beta2 = 0.9f, .amsgrad = true},
  };
  std::uint64_t seed = 100;
  for (auto o : cases) {
    for (auto mode : {step_count::per_tensor, step_count::per_element}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{17}, std::size_t{1000}}) {
        o.step_mode = mode;
        adam_optimizer opt(o);
        reference_adam ref(
            o, normal(n, seed),
            mode == step_count::per_tensor ? counting::per_tensor : counting::per_element);
        compare_lazy<std::uint64_t>(opt, ref, n, 0.3, 25, adam_rel, adam_abs, ++seed);
        REQUIRE(first_mismatch(ref.v, opt.exp_avg_sq(0), 1e-6, 1e-7) == -1);
      }
    }
  }
}

TEST_CASE("per-element bias correction stays exact past the end of its table",
          "[optim][adam][sparse]") {
  // beta 0.5 / 0.6: the table ends after a few dozen steps; element 0 is touched every step,
  // element 1 every tenth: 300 steps run far past the table for one and inside it for the other.
  adam_options o{.lr = 1e-2f, .beta1 = 0.5f, .beta2 = 0.6f, .step_mode = step_count::per_element};
  adam_optimizer opt(o);
  reference_adam ref(o, {0.5f, -0.5f}, counting::per_element);
  opt.add_tensor(ref.p);
  for (int s = 0; s < 300; ++s) {
    std::vector<std::uint32_t> idx{0};
    if (s % 10 == 0) idx.push_back(1);
    const auto val = normal(idx.size(), static_cast<std::uint64_t>(s));
    ref.sparse(idx, val);
    opt.step(0, view<std::uint32_t>{idx, val, 2});
  }
  CHECK(opt.element_steps(0)[0] == 300);
  CHECK(opt.element_steps(0)[1] == 30);
  CHECK(first_mismatch(ref.p, opt.params(0), adam_rel, adam_abs) == -1);
}

TEST_CASE("a sparse step over every index equals a dense step", "[optim][sparse][dense]") {
  for (std::size_t n : dense_sizes()) {
    const auto init = normal(n, 31);
    std::vector<std::uint32_t> all(n);
    for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<std::uint32_t>(i);
    for (auto mode : {step_count::per_tensor, step_count::per_element}) {
      adam_options o{.lr = 1e-2f, .weight_decay = 0.05f, .amsgrad = true, .step_mode = mode};
      adam_optimizer dense(o), sparse(o);
      dense.add_tensor(init);
      sparse.add_tensor(init);
      sgd_options so{.lr = 0.1f, .momentum = 0.9f, .nesterov = true, .step_mode = mode};
      sgd_optimizer sdense(so), ssparse(so);
      sdense.add_tensor(init);
      ssparse.add_tensor(init);
      for (int s = 0; s < 5; ++s) {
        const auto g = normal(n, 40 + static_cast<std::uint64_t>(s));
        dense.step(0, std::span<const float>(g));
        sparse.step(0, view<std::uint32_t>{all, g, n});
        sdense.step(0, std::span<const float>(g));
        ssparse.step(0, view<std::uint32_t>{all, g, n});
      }
      INFO("n = " << n);
#if defined(__FMA__)
      // The scalar and the SIMD code may contract different multiply-adds into FMAs.
      CHECK(first_mismatch(std::vector<float>(dense.params(0).begin(), dense.params(0).end()),
                           sparse.params(0), 1e-6, 1e-7) == -1);
#else
      CHECK(same_bits(dense.params(0), sparse.params(0)));
      CHECK(same_bits(dense.exp_avg_sq(0), sparse.exp_avg_sq(0)));
      CHECK(same_bits(dense.max_exp_avg_sq(0), sparse.max_exp_avg_sq(0)));
      CHECK(same_bits(sdense.params(0), ssparse.params(0)));
      CHECK(same_bits(sdense.momentum_buffer(0), ssparse.momentum_buffer(0)));
#endif
    }
  }
}

TEST_CASE("equal indices are summed into one update", "[optim][sparse]") {
  const std::size_t n = 50;
  const auto init = normal(n, 61);
  const std::vector<std::uint32_t> dup{2, 2, 2, 7, 9, 9, 49, 49};
  const std::vector<float> dval{1.0f, 0.5f, -0.25f, 3.0f, 1.0f, 1.0f, -2.0f, 0.125f};
  const std::vector<std::uint32_t> uniq{2, 7, 9, 49};
  const std::vector<float> uval{(1.0f + 0.5f) + -0.25f, 3.0f, 2.0f, -2.0f + 0.125f};
  for (auto mode : {step_count::per_tensor, step_count::per_element}) {
    adam_optimizer a({.lr = 1e-2f, .step_mode = mode}), b({.lr = 1e-2f, .step_mode = mode});
    a.add_tensor(init);
    b.add_tensor(init);
    std::vector<fp16> copy(dup.size());
    inline_executor ex;
    const auto r = a.step(0, view<std::uint32_t>{dup, dval, n}, ex, param_copy<fp16>{copy});
    b.step(0, view<std::uint32_t>{uniq, uval, n});
    CHECK(r.updated == 4);
    CHECK(same_bits(a.params(0), b.params(0)));
    CHECK(same_bits(a.exp_avg(0), b.exp_avg(0)));
    if (mode == step_count::per_element) CHECK(a.element_steps(0)[2] == 1);
    // Every position of a run receives the element's new value in a compact copy.
    for (std::size_t j = 0; j < dup.size(); ++j)
      CHECK(copy[j].bits() == fp16(a.params(0)[dup[j]]).bits());
  }
}

TEST_CASE("bad indices are an error and write nothing", "[optim][sparse][errors]") {
  const std::size_t n = 100;
  const auto init = normal(n, 71);
  thread_pool pool{2};
  adam_optimizer opt({.lr = 1e-2f, .amsgrad = true, .step_mode = step_count::per_element});
  opt.add_tensor(init);
  const std::vector<float> val(6000, 1.0f);
  std::vector<std::uint32_t> idx(6000);
  for (std::size_t j = 0; j < idx.size(); ++j)
    idx[j] = static_cast<std::uint32_t>(j * n / idx.size());

  SECTION("out of range, late in the input, after many valid indices") {
    idx.back() = 100;
    const auto m = error_message(
        [&] {
          opt.step(0, view<std::uint32_t>{idx, val, n}, pool);
        },
        errc::out_of_range);
    CHECK(contains(m, "index 100 at position 5999"));
    CHECK(contains(m, "tensor 0"));
  }
  SECTION("out of order") {
    idx[4000] = 3;
    const auto m = error_message(
        [&] {
          opt.step(0, view<std::uint32_t>{idx, val, n}, pool);
        },
        errc::invalid_argument);
    CHECK(contains(m, "position 4000"));
    CHECK(contains(m, "sorted"));
  }
  SECTION("64-bit index beyond 2^32") {
    std::vector<std::uint64_t> idx64{1, std::uint64_t{1} << 33};
    const std::vector<float> v2{1.0f, 1.0f};
    error_message(
        [&] {
          opt.step(0, sparse_view<const float, const std::uint64_t>{idx64, v2, n});
        },
        errc::out_of_range);
  }
  SECTION("dense size differs from the tensor") {
    error_message([&] { opt.step(0, view<std::uint32_t>{idx, val, n + 1}); }, errc::size_mismatch);
  }
  SECTION("copy of the wrong size") {
    std::vector<bf16> copy(10);
    inline_executor ex;
    error_message(
        [&] {
          opt.step(0, view<std::uint32_t>{idx, val, n}, ex, param_copy<bf16>{copy});
        },
        errc::size_mismatch);
    error_message(
        [&] {
          opt.step(0, view<std::uint32_t>{idx, val, n}, ex,
                   param_copy<bf16>{copy, copy_layout::dense});
        },
        errc::size_mismatch);
  }
  CHECK(same_bits(init, opt.params(0)));
  for (float m : opt.exp_avg(0)) REQUIRE(m == 0.0f);
  for (auto k : opt.element_steps(0)) REQUIRE(k == 0u);
  CHECK(opt.step_count_of(0) == 0);
}

TEST_CASE("non-finite sparse gradients never reach the state", "[optim][sparse][nonfinite]") {
  const std::size_t n = 64;
  const auto init = normal(n, 81);
  const float big = 3.0e38f;
  // Index 5: NaN; index 9: two finite values whose sum overflows; index 20: fine.
  const std::vector<std::uint32_t> idx{5, 9, 9, 20};
  const std::vector<float> val{std::numeric_limits<float>::quiet_NaN(), big, big, 0.5f};

  SECTION("skip_elements") {
    sgd_optimizer opt({.lr = 0.1f, .momentum = 0.9f, .step_mode = step_count::per_element});
    opt.add_tensor(init);
    std::vector<bf16> copy(n, bf16(-7.0f));
    inline_executor ex;
    const auto r = opt.step(0, view<std::uint32_t>{idx, val, n}, ex,
                            param_copy<bf16>{copy, copy_layout::dense});
    CHECK(r.applied);
    CHECK(r.nonfinite == 2);
    CHECK(r.updated == 1);
    CHECK(opt.params(0)[5] == init[5]);
    CHECK(opt.params(0)[9] == init[9]);
    CHECK(opt.momentum_buffer(0)[9] == 0.0f);
    CHECK(opt.element_steps(0)[9] == 0);
    CHECK(opt.element_steps(0)[20] == 1);
    CHECK(opt.params(0)[20] == init[20] - 0.1f * 0.5f);
    CHECK(copy[9].bits() == bf16(init[9]).bits());  // unchanged value still copied
    CHECK(copy[20].bits() == bf16(opt.params(0)[20]).bits());
    CHECK(copy[0].bits() == bf16(-7.0f).bits());  // untouched positions not written
  }
  SECTION("skip_tensor") {
    adam_optimizer opt({.nonfinite = nonfinite_policy::skip_tensor});
    opt.add_tensor(init);
    const auto r = opt.step(0, view<std::uint32_t>{idx, val, n});
    CHECK_FALSE(r.applied);
    CHECK(r.nonfinite == 2);
    CHECK(same_bits(init, opt.params(0)));
    CHECK(opt.step_count_of(0) == 0);
  }
  SECTION("raise") {
    adam_optimizer opt({.nonfinite = nonfinite_policy::raise});
    opt.add_tensor(init);
    const std::vector<std::uint32_t> idx2{9, 9, 20};
    const std::vector<float> val2{big, big, 0.5f};
    const auto m = error_message(
        [&] {
          opt.step(0, view<std::uint32_t>{idx2, val2, n});
        },
        errc::not_finite);
    CHECK(contains(m, "index 9"));
    CHECK(contains(m, "+inf"));
    CHECK(same_bits(init, opt.params(0)));
  }
}

TEST_CASE("a run of equal indices across the pre-pass chunks counts once",
          "[optim][sparse][nonfinite]") {
  // 100K entries in runs of (mostly) 4 over 25001 elements: with 2 threads the pre-pass splits
  // into chunks of 32768 entries, so the run at 32766..32769 straddles the first boundary.
  const std::size_t n = 25'001;
  std::vector<std::uint32_t> idx(100'000);
  for (std::size_t j = 0; j < idx.size(); ++j) idx[j] = static_cast<std::uint32_t>((j + 2) / 4);
  REQUIRE(idx[32766] == idx[32769]);
  REQUIRE(idx[32765] != idx[32766]);
  std::vector<float> val(idx.size(), 0.25f);
  val[32768] = val[32769] = std::numeric_limits<float>::infinity();
  thread_pool pool{2};
  for (auto policy : {nonfinite_policy::skip_tensor, nonfinite_policy::skip_elements}) {
    sgd_optimizer opt({.lr = 0.1f, .nonfinite = policy});
    opt.add_tensor(std::vector<float>(n, 1.0f));
    const auto r = opt.step(0, view<std::uint32_t>{idx, val, n}, pool);
    CHECK(r.nonfinite == 1);
    CHECK(r.applied == (policy == nonfinite_policy::skip_elements));
    CHECK(opt.params(0)[idx[32766]] == 1.0f);
  }
}

TEMPLATE_TEST_CASE("a sparse step writes compact or dense parameter copies",
                   "[optim][sparse][copy]", fp16, bf16, float) {
  const std::size_t n = 1000;
  const auto init = normal(n, 91);
  const auto idx = sorted_indices<std::uint32_t>(n, 123, 92);
  const auto val = normal(idx.size(), 93);
  thread_pool pool{2};
  adam_optimizer opt({.lr = 1e-2f});
  opt.add_tensor(init);
  std::vector<TestType> compact(idx.size());
  std::vector<TestType> mirror(n, from_float<TestType>(0.0f));
  opt.step(0, view<std::uint32_t>{idx, val, n}, pool, param_copy<TestType>{compact});
  opt.step(0, view<std::uint32_t>{idx, val, n}, pool,
           param_copy<TestType>{mirror, copy_layout::dense});
  std::size_t j = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const TestType now = from_float<TestType>(opt.params(0)[i]);
    if (j < idx.size() && idx[j] == i) {
      REQUIRE(std::memcmp(&mirror[i], &now, sizeof now) == 0);
      ++j;
    } else {
      REQUIRE(to_float(mirror[i]) == 0.0f);
    }
  }
}

TEST_CASE("sparse results do not depend on the thread count", "[optim][sparse][threads]") {
  // Long runs of equal indices, so that piece boundaries fall inside runs.
  const std::size_t n = 1 << 16;
  std::vector<std::uint32_t> idx;
  for (std::uint32_t i = 0; i < n; i += 3) {
    for (std::uint32_t r = 0; r < 1 + i % 5; ++r) idx.push_back(i);
  }
  const auto val = normal(idx.size(), 101);
  const auto init = normal(n, 102);
  auto run = [&](auto& ex, step_count mode) {
    adam_optimizer opt({.lr = 1e-2f, .amsgrad = true, .step_mode = mode});
    opt.add_tensor(init, ex);
    std::vector<bf16> copy(idx.size());
    for (int s = 0; s < 3; ++s) {
      const auto r = opt.step(0, view<std::uint32_t>{idx, val, n}, ex, param_copy<bf16>{copy});
      REQUIRE(r.updated == (n + 2) / 3);
    }
    std::vector<float> out(opt.params(0).begin(), opt.params(0).end());
    out.insert(out.end(), opt.exp_avg(0).begin(), opt.exp_avg(0).end());
    for (auto c : copy) out.push_back(to_float(c));
    return out;
  };
  thread_pool pool2{2};
  thread_pool pool3{3};
  for (auto mode : {step_count::per_tensor, step_count::per_element}) {
    inline_executor ex;
    const auto a = run(ex, mode);
    CHECK(same_bits(a, run(pool2, mode)));
    CHECK(same_bits(a, run(pool3, mode)));
  }
}

TEST_CASE("different tensors step concurrently", "[optim][sparse][threads]") {
  adam_optimizer opt({.lr = 1e-2f});
  adam_optimizer serial({.lr = 1e-2f});
  const std::size_t tensors = 8, n = 5000;
  for (std::size_t t = 0; t < tensors; ++t) {
    opt.add_tensor(normal(n, t));
    serial.add_tensor(normal(n, t));
  }
  const auto idx = sorted_indices<std::uint32_t>(n, 700, 5);
  const auto val = normal(idx.size(), 6);
  thread_pool pool{4};
  // One task per tensor; each step also splits across the same pool (nested bulk).
  pool.bulk(tensors, [&](std::size_t t) {
    for (int s = 0; s < 4; ++s) opt.step(t, view<std::uint32_t>{idx, val, n}, pool);
  });
  for (std::size_t t = 0; t < tensors; ++t) {
    for (int s = 0; s < 4; ++s) serial.step(t, view<std::uint32_t>{idx, val, n});
    CHECK(same_bits(serial.params(t), opt.params(t)));
  }
}
