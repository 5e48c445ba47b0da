// SPDX-License-Identifier: Apache-2.0
// Dense steps of SGD and Adam/AdamW/AMSGrad against the scalar references (PyTorch's
// equations), over many steps and at sizes around the SIMD width; thread-count independence;
// 16-bit gradients and parameter copies; non-finite policies; argument errors.
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "catch.hpp"
#include "optim_reference.hpp"
#include "optim_test_support.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

using namespace stellatrain;
using namespace optim_test;

namespace {

// SGD does the reference's operations in the reference's order: identical bits, unless the
// compiler may contract a * b + c into one FMA (then it may do so differently in the SIMD
// kernel and in the scalar reference: a rounding per operation, 1e-6 relative is generous).
#if defined(__FMA__)
constexpr double sgd_rel = 1e-6;
constexpr double sgd_abs = 1e-7;
#else
constexpr double sgd_rel = 0.0;
constexpr double sgd_abs = 0.0;
#endif
// Adam: the reference forms PyTorch's double-precision step size and divides by sqrt(bc2);
// the library multiplies by float factors. An ulp or two per step on parameters of magnitude
// ~1 that move by ~lr per step: 1e-6 leaves a 5x margin over 30 steps (measured <= 2e-7).
constexpr double adam_rel = 1e-6;
constexpr double adam_abs = 1e-6;

std::vector<sgd_options> sgd_cases() {
  return {
      {.lr = 0.1f},
      {.lr = 0.05f, .momentum = 0.9f},
      {.lr = 0.05f, .momentum = 0.8f, .dampening = 0.3f, .weight_decay = 0.01f},
      {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.05f, .nesterov = true},
      {.lr = 0.03f, .momentum = 0.7f, .nesterov = true, .maximize = true},
  };
}

std::vector<adam_options> adam_cases() {
  return {
      {.lr = 1e-2f},
      {.lr = 2e-2f, .beta1 = 0.8f, .beta2 = 0.99f, .weight_decay = 0.1f},
      {.lr = 1e-2f, .maximize = true},
      {.lr = 5e-2f, .beta2 = 0.95f, .eps = 0.01f},
      {.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::decoupled},
      {.lr = 2e-2f, .beta2 = 0.9f, .amsgrad = true},
      {.lr = 2e-2f,
       .beta2 = 0.9f,
       .weight_decay = 0.3f,
       .decay = weight_decay_mode::decoupled,
       .amsgrad = true,
       .maximize = true},
  };
}

template <class Optimizer, class Reference>
void compare_dense(Optimizer& opt, Reference& ref, std::size_t n, int steps, double rel, double abs,
                   std::uint64_t seed) {
  const auto t = opt.add_tensor(ref.p);
  for (int s = 0; s < steps; ++s) {
    // Varying scale, occasional exact zeros: the state sees small and large gradients.
    auto g = normal(n, seed * 1000 + static_cast<std::uint64_t>(s), s % 3 == 0 ? 3.0f : 0.5f);
    for (std::size_t i = 0; i < n; i += 7) g[i] = 0.0f;
    ref.dense(g);
    const auto r = opt.step(t, std::span<const float>(g));
    REQUIRE(r.applied);
    REQUIRE(r.updated == n);
    INFO("n = " << n << ", step " << s + 1);
    REQUIRE(first_mismatch(ref.p, opt.params(t), rel, abs) == -1);
  }
  CHECK(opt.step_count_of(t) == static_cast<std::uint64_t>(steps));
}

}  // namespace

TEST_CASE("dense SGD follows PyTorch's update equations", "[optim][sgd][dense]") {
  int k = 0;
  for (const auto& o : sgd_cases()) {
    for (std::size_t n : dense_sizes()) {
      sgd_optimizer opt(o);
      reference_sgd ref(o, normal(n, 11 + n), counting::per_tensor);
      compare_dense(opt, ref, n, 30, sgd_rel, sgd_abs, static_cast<std::uint64_t>(++k));
      if (o.momentum != 0.0f) {
        REQUIRE(first_mismatch(ref.buf, opt.momentum_buffer(0), sgd_rel, sgd_abs) == -1);
      } else {
        CHECK(opt.momentum_buffer(0).empty());
      }
    }
  }
}

TEST_CASE("dense Adam, AdamW and AMSGrad follow PyTorch's update equations",
          "[optim][adam][dense]") {
  int k = 0;
  for (const auto& o : adam_cases()) {
    for (std::size_t n : dense_sizes()) {
      adam_optimizer opt(o);
      reference_adam ref(o, normal(n, 21 + n), counting::per_tensor);
      compare_dense(opt, ref, n, 30, adam_rel, adam_abs, static_cast<std::uint64_t>(++k));
      // The moments follow the same equations; they differ only through the ulp-level
      // parameter differences that L2 weight decay feeds back into the gradient.
      REQUIRE(first_mismatch(ref.m, opt.exp_avg(0), 1e-6, 1e-7) == -1);
      REQUIRE(first_mismatch(ref.v, opt.exp_avg_sq(0), 1e-6, 1e-7) == -1);
      if (o.amsgrad) {
        REQUIRE(first_mismatch(ref.vmax, opt.max_exp_avg_sq(0), 1e-6, 1e-7) == -1);
        for (std::size_t i = 0; i < n; ++i)
          REQUIRE(opt.max_exp_avg_sq(0)[i] >= opt.exp_avg_sq(0)[i]);
      } else {
        CHECK(opt.max_exp_avg_sq(0).empty());
      }
    }
  }
}

TEST_CASE("L2 decay nearly cancelling the gradient is rounded once, as torch rounds it",
          "[optim][dense]") {
  // g + wd * p is tiny: wd * p rounded before the add would leave an error as large as the
  // result. Both the dense (SIMD) and the sparse (scalar) path, against the reference.
  const std::size_t n = 1003;
  const float wd = 0.1f;
  const auto p = normal(n, 31);
  const auto noise = normal(n, 32);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = -(p[i] * wd) * (1.0f + 1e-5f * noise[i]);
  std::vector<std::uint32_t> all(n);
  for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<std::uint32_t>(i);
  // One dense and one sparse step of an optimizer made with `o`, and the reference's step.
  auto step_all = [&]<class Optimizer, class Reference>(const auto& o) {
    std::tuple<Optimizer, Optimizer, Reference> r{Optimizer(o), Optimizer(o),
                                                  Reference(o, p, counting::per_tensor)};
    auto& [dense, sparse, ref] = r;
    dense.add_tensor(p);
    sparse.add_tensor(p);
    dense.step(0, std::span<const float>(g));
    sparse.step(0, sparse_view<const float, const std::uint32_t>{all, g, n});
    ref.dense(g);
    return r;
  };

  auto [dense_a, sparse_a, ref_a] = step_all.operator()<adam_optimizer, reference_adam>(
      adam_options{.lr = 1e-3f, .weight_decay = wd});
  CHECK(same_bits(ref_a.m, dense_a.exp_avg(0)));
  CHECK(same_bits(ref_a.m, sparse_a.exp_avg(0)));
  CHECK(same_bits(ref_a.v, dense_a.exp_avg_sq(0)));
  auto [dense_s, sparse_s, ref_s] = step_all.operator()<sgd_optimizer, reference_sgd>(
      sgd_options{.lr = 1e-3f, .momentum = 0.9f, .weight_decay = wd});
  CHECK(same_bits(ref_s.buf, dense_s.momentum_buffer(0)));
  CHECK(same_bits(ref_s.buf, sparse_s.momentum_buffer(0)));
}

TEST_CASE("AMSGrad keeps one maximum per element, not one per tensor", "[optim][adam][dense]") {
  adam_optimizer opt({.lr = 1e-2f, .beta2 = 0.5f, .amsgrad = true});
  const auto t = opt.add_tensor(std::vector<float>{0.0f, 0.0f});
  opt.step(t, std::span<const float>(std::vector<float>{10.0f, 0.0f}));
  opt.step(t, std::span<const float>(std::vector<float>{0.0f, 1.0f}));
  // Element 0 keeps its own large maximum; element 1 has only ever seen its own v.
  CHECK(opt.max_exp_avg_sq(t)[0] > 10.0f);
  CHECK(opt.max_exp_avg_sq(t)[1] == opt.exp_avg_sq(t)[1]);
  CHECK(opt.max_exp_avg_sq(t)[1] < 1.0f);
}

TEST_CASE("dense results do not depend on the thread count or chunking",
          "[optim][dense][threads]") {
  const std::size_t n = (std::size_t{1} << 20) + 5;  // many chunks and an odd tail
  thread_pool pool2{2};
  thread_pool pool3{3};
  const auto init = normal(n, 5);
  auto run = [&](auto& ex, bool adam) {
    std::vector<float> out;
    if (adam) {
      adam_optimizer opt({.lr = 1e-2f, .weight_decay = 0.01f, .amsgrad = true});
      const auto t = opt.add_tensor(init, ex);
      for (int s = 0; s < 3; ++s) {
        const auto g = normal(n, 100 + static_cast<std::uint64_t>(s));
        opt.step(t, std::span<const float>(g), ex);
      }
      out.assign(opt.params(t).begin(), opt.params(t).end());
      out.insert(out.end(), opt.exp_avg_sq(t).begin(), opt.exp_avg_sq(t).end());
    } else {
      sgd_optimizer opt({.lr = 0.1f, .momentum = 0.9f, .nesterov = true});
      const auto t = opt.add_tensor(init, ex);
      for (int s = 0; s < 3; ++s) {
        const auto g = normal(n, 200 + static_cast<std::uint64_t>(s));
        opt.step(t, std::span<const float>(g), ex);
      }
      out.assign(opt.params(t).begin(), opt.params(t).end());
    }
    return out;
  };
  for (bool adam : {false, true}) {
    inline_executor inline_ex;
    const auto a = run(inline_ex, adam);
    CHECK(same_bits(a, run(pool2, adam)));
    CHECK(same_bits(a, run(pool3, adam)));
  }
  // And against the reference at 2^20 elements.
  adam_options o{.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::decoupled};
  adam_optimizer opt(o);
  reference_adam ref(o, init, counting::per_tensor);
  compare_dense(opt, ref, n, 2, adam_rel, adam_abs, 77);
}

TEMPLATE_TEST_CASE("16-bit gradients give the same step as their float values", "[optim][dense]",
                   fp16, bf16) {
  for (std::size_t n : dense_sizes()) {
    const auto init = normal(n, 3);
    const auto gf = normal(n, 4);
    std::vector<TestType> gh(n);
    std::vector<float> rounded(n);
    for (std::size_t i = 0; i < n; ++i) {
      gh[i] = TestType(gf[i]);
      rounded[i] = to_float(gh[i]);
    }
    adam_optimizer a({.lr = 1e-2f, .amsgrad = true});
    adam_optimizer b({.lr = 1e-2f, .amsgrad = true});
    a.add_tensor(init);
    b.add_tensor(init);
    for (int s = 0; s < 3; ++s) {
      a.step(0, std::span<const TestType>(gh));
      b.step(0, std::span<const float>(rounded));
    }
    INFO("n = " << n);
    CHECK(same_bits(a.params(0), b.params(0)));
    CHECK(same_bits(a.exp_avg_sq(0), b.exp_avg_sq(0)));
    sgd_optimizer c({.lr = 0.1f, .momentum = 0.5f});
    sgd_optimizer d({.lr = 0.1f, .momentum = 0.5f});
    c.add_tensor(init);
    d.add_tensor(init);
    c.step(0, std::span<const TestType>(gh));
    d.step(0, std::span<const float>(rounded));
    CHECK(same_bits(c.params(0), d.params(0)));
  }
}

TEMPLATE_TEST_CASE("a dense step writes the parameter copy in the same pass",
                   "[optim][dense][copy]", fp16, bf16, float) {
  thread_pool pool{2};
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, simd_width + 3, std::size_t{100'003}}) {
    auto init = normal(n, 8, 100.0f);
    if (n > 10) {
      init[3] = 1e-6f;        // fp16 subnormal range
      init[4] = 70000.0f;     // fp16 overflow: +inf
      init[5] = -3.0e38f;     // bf16 rounds to -inf
      init[6] = 1.00390625f;  // bf16 tie: rounds to even
    }
    adam_optimizer opt({.lr = 0.0f});  // lr 0: parameters stay exactly as given
    const auto t = opt.add_tensor(init);
    std::vector<TestType> copy(n);
    const auto g = normal(n, 9);
    opt.step(t, std::span<const float>(g), pool, param_copy<TestType>{copy});
    for (std::size_t i = 0; i < n; ++i) {
      INFO("i = " << i << ", value " << opt.params(t)[i]);
      const TestType want = from_float<TestType>(opt.params(t)[i]);
      REQUIRE(std::memcmp(&copy[i], &want, sizeof(TestType)) == 0);
    }
    // With a moving parameter the copy is of the new value.
    sgd_optimizer s({.lr = 0.5f});
    s.add_tensor(init);
    s.step(0, std::span<const float>(g), pool, param_copy<TestType>{copy});
    for (std::size_t i = 0; i < n; ++i) {
      const TestType want = from_float<TestType>(s.params(0)[i]);
      REQUIRE(std::memcmp(&copy[i], &want, sizeof(TestType)) == 0);
    }
  }
}

TEST_CASE("non-finite dense gradients never reach the state", "[optim][dense][nonfinite]") {
  const std::size_t n = 3 * simd_width + 2;
  const auto init = normal(n, 12);
  auto g = normal(n, 13);
  g[1] = std::numeric_limits<float>::quiet_NaN();
  g[n - 1] = std::numeric_limits<float>::infinity();
  g[simd_width + 1] = -std::numeric_limits<float>::infinity();
  std::vector<float> clean = g;
  clean[1] = clean[n - 1] = clean[simd_width + 1] = 0.0f;

  SECTION("skip_elements: bad elements untouched, the others updated") {
    for (bool adam : {false, true}) {
      std::vector<float> p, p_ref;
      std::vector<bf16> copy(n);
      if (adam) {
        adam_optimizer opt(
            {.lr = 1e-2f, .amsgrad = true, .nonfinite = nonfinite_policy::skip_elements});
        reference_adam ref({.lr = 1e-2f, .amsgrad = true}, init, counting::per_tensor);
        opt.add_tensor(init);
        inline_executor ex;
        const auto r = opt.step(0, std::span<const float>(g), ex, param_copy<bf16>{copy});
        ref.dense(clean);
        CHECK(r.applied);
        CHECK(r.nonfinite == 3);
        CHECK(r.updated == n - 3);
        for (std::size_t i : {std::size_t{1}, n - 1, simd_width + 1}) {
          CHECK(opt.params(0)[i] == init[i]);
          CHECK(opt.exp_avg(0)[i] == 0.0f);
          CHECK(opt.exp_avg_sq(0)[i] == 0.0f);
          CHECK(opt.max_exp_avg_sq(0)[i] == 0.0f);
          CHECK(copy[i].bits() == bf16(init[i]).bits());
          ref.p[i] = init[i];
        }
        CHECK(first_mismatch(ref.p, opt.params(0), adam_rel, adam_abs) == -1);
      } else {
        sgd_optimizer opt({.lr = 0.1f, .momentum = 0.9f});
        opt.add_tensor(init);
        const auto r = opt.step(0, std::span<const float>(g));
        CHECK(r.nonfinite == 3);
        for (std::size_t i : {std::size_t{1}, n - 1, simd_width + 1}) {
          CHECK(opt.params(0)[i] == init[i]);
          CHECK(opt.momentum_buffer(0)[i] == 0.0f);
        }
        for (std::size_t i = 0; i < n; ++i) CHECK(std::isfinite(opt.params(0)[i]));
      }
    }
  }
  SECTION("skip_tensor: nothing changes, the step does not count") {
    adam_optimizer opt({.lr = 1e-2f, .nonfinite = nonfinite_policy::skip_tensor});
    opt.add_tensor(init);
    const auto r = opt.step(0, std::span<const float>(g));
    CHECK_FALSE(r.applied);
    CHECK(r.nonfinite == 3);
    CHECK(r.updated == 0);
    CHECK(same_bits(init, opt.params(0)));
    CHECK(opt.step_count_of(0) == 0);
    for (float m : opt.exp_avg(0)) CHECK(m == 0.0f);
    // A clean step afterwards is the first step.
    opt.step(0, std::span<const float>(clean));
    CHECK(opt.step_count_of(0) == 1);
    reference_adam ref({.lr = 1e-2f}, init, counting::per_tensor);
    ref.dense(clean);
    CHECK(first_mismatch(ref.p, opt.params(0), adam_rel, adam_abs) == -1);
  }
  SECTION("raise: throws not_finite naming the first position, nothing changes") {
    sgd_optimizer opt({.lr = 0.1f, .momentum = 0.9f, .nonfinite = nonfinite_policy::raise});
    opt.add_tensor(init);
    thread_pool pool{2};
    const auto m =
        error_message([&] { opt.step(0, std::span<const float>(g), pool); }, errc::not_finite);
    CHECK(contains(m, "tensor 0"));
    CHECK(contains(m, "position 1 "));
    CHECK(contains(m, "NaN"));
    CHECK(contains(m, "3 non-finite"));
    CHECK(same_bits(init, opt.params(0)));
    CHECK(opt.step_count_of(0) == 0);
  }
}

TEST_CASE("dense step argument errors", "[optim][dense][errors]") {
  adam_optimizer opt;
  opt.add_tensor(std::vector<float>(10, 1.0f));
  std::vector<float> g(9, 1.0f);
  auto m = error_message([&] { opt.step(0, std::span<const float>(g)); }, errc::size_mismatch);
  CHECK(contains(m, "9 elements"));
  m = error_message([&] { opt.step(3, std::span<const float>(g)); }, errc::out_of_range);
  CHECK(contains(m, "tensor 3"));
  std::vector<float> g10(10, 1.0f);
  std::vector<bf16> copy(5);
  inline_executor ex;
  m = error_message([&] { opt.step(0, std::span<const float>(g10), ex, param_copy<bf16>{copy}); },
                    errc::size_mismatch);
  CHECK(contains(m, "copy"));
  CHECK(opt.step_count_of(0) == 0);
  for (float p : opt.params(0)) CHECK(p == 1.0f);
}

TEST_CASE("options PyTorch refuses are refused", "[optim][options]") {
  auto bad_sgd = [](sgd_options o) {
    error_message([&] { sgd_optimizer x(o); }, errc::invalid_argument);
  };
  bad_sgd({.lr = -1.0f});
  bad_sgd({.momentum = -0.1f});
  bad_sgd({.weight_decay = -0.1f});
  bad_sgd({.nesterov = true});                                       // nesterov needs momentum
  bad_sgd({.momentum = 0.9f, .dampening = 0.1f, .nesterov = true});  // ... and no dampening
  bad_sgd({.lr = std::numeric_limits<float>::quiet_NaN()});
  auto bad_adam = [](adam_options o) {
    error_message([&] { adam_optimizer x(o); }, errc::invalid_argument);
  };
  bad_adam({.lr = -1.0f});
  bad_adam({.beta1 = 1.0f});
  bad_adam({.beta2 = -0.5f});
  bad_adam({.eps = -1e-8f});
  bad_adam({.weight_decay = std::numeric_limits<float>::infinity()});
  // Per-element steps need a bias-correction table that converges.
  bad_adam({.beta2 = 0.9999999f, .step_mode = step_count::per_element});
  CHECK_NOTHROW(adam_optimizer({.beta2 = 0.9999999f}));
  CHECK_NOTHROW(adam_optimizer({.beta2 = 0.99999f, .step_mode = step_count::per_element}));
  adam_optimizer a;
  error_message([&] { a.set_lr(-2.0f); }, errc::invalid_argument);
  a.set_lr(0.5f);
  CHECK(a.options().lr == 0.5f);
}
