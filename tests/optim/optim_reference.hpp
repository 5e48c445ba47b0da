// SPDX-License-Identifier: Apache-2.0
// Scalar references of the optimizers for the tests: PyTorch's published update equations
// written out per element, with PyTorch's scalar arithmetic (bias-correction terms in double,
// then rounded to float when applied to the float tensors; one rounding where its CPU kernels
// fuse, `fused` below), independent of the library code.
#pragma once

#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace optim_test {

// a * b + c as torch's CPU kernels compute `add` with alpha and `addcmul`: rounded once. On a
// target without FMA the library rounds twice (optim_math.hpp's madd), and so does this.
inline float fused(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// Which step number each touched element uses (mirrors stellatrain::step_count).
enum class counting { per_tensor, per_element };

struct reference_sgd {
  stellatrain::sgd_options o;
  counting mode = counting::per_tensor;
  std::vector<float> p, buf;
  std::vector<std::uint32_t> touches;
  std::uint64_t step = 0;

  reference_sgd(const stellatrain::sgd_options& options, std::vector<float> init, counting m)
      : o(options), mode(m), p(std::move(init)), buf(p.size(), 0.0f), touches(p.size(), 0) {}

  void element(std::size_t i, float g) {
    float d = o.maximize ? -g : g;
    if (o.weight_decay != 0.0f) d = fused(p[i], o.weight_decay, d);
    if (o.momentum != 0.0f) {
      const bool first = mode == counting::per_tensor ? step == 1 : touches[i] == 0;
      if (first) {
        buf[i] = d;
      } else {
        buf[i] = fused(d, static_cast<float>(1.0 - double{o.dampening}), buf[i] * o.momentum);
      }
      d = o.nesterov ? fused(buf[i], o.momentum, d) : buf[i];
    }
    p[i] = fused(d, -o.lr, p[i]);
    ++touches[i];
  }
  void dense(const std::vector<float>& g) {
    ++step;
    for (std::size_t i = 0; i < p.size(); ++i) element(i, g[i]);
  }
  // Sorted, duplicate-free updates (the tests sum duplicates themselves when they need to).
  template <class Index>
  void sparse(const std::vector<Index>& idx, const std::vector<float>& val) {
    ++step;
    for (std::size_t j = 0; j < idx.size(); ++j) element(idx[j], val[j]);
  }
};

struct reference_adam {
  stellatrain::adam_options o;
  counting mode = counting::per_tensor;
  std::vector<float> p, m, v, vmax;
  std::vector<std::uint32_t> touches;
  std::uint64_t step = 0;

  reference_adam(const stellatrain::adam_options& options, std::vector<float> init, counting c)
      : o(options),
        mode(c),
        p(std::move(init)),
        m(p.size(), 0.0f),
        v(p.size(), 0.0f),
        vmax(p.size(), 0.0f),
        touches(p.size(), 0) {}

  void element(std::size_t i, float g) {
    const double k = mode == counting::per_tensor ? static_cast<double>(step) : touches[i] + 1.0;
    if (o.maximize) g = -g;
    const bool decoupled = o.decay == stellatrain::weight_decay_mode::decoupled;
    if (o.weight_decay != 0.0f && !decoupled) g = fused(p[i], o.weight_decay, g);
    if (o.weight_decay != 0.0f && decoupled) {
      p[i] = p[i] * static_cast<float>(1.0 - double{o.lr} * double{o.weight_decay});
    }
    m[i] = fused(g, static_cast<float>(1.0 - double{o.beta1}), m[i] * o.beta1);
    v[i] = fused(static_cast<float>(1.0 - double{o.beta2}) * g, g, v[i] * o.beta2);
    const double bc1 = 1.0 - std::pow(double{o.beta1}, k);
    const double bc2 = 1.0 - std::pow(double{o.beta2}, k);
    const auto step_size = static_cast<float>(double{o.lr} / bc1);
    const auto bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    float second = v[i];
    if (o.amsgrad) {
      vmax[i] = std::max(vmax[i], v[i]);
      second = vmax[i];
    }
    const float denom = std::sqrt(second) / bc2_sqrt + o.eps;
    p[i] = p[i] + (-step_size * m[i]) / denom;
    ++touches[i];
  }
  void dense(const std::vector<float>& g) {
    ++step;
    for (std::size_t i = 0; i < p.size(); ++i) element(i, g[i]);
  }
  template <class Index>
  void sparse(const std::vector<Index>& idx, const std::vector<float>& val) {
    ++step;
    for (std::size_t j = 0; j < idx.size(); ++j) element(idx[j], val[j]);
  }
};

// |a - b| <= abs + rel * max(|a|, |b|), elementwise; returns the first failing index or -1.
inline long first_mismatch(const std::vector<float>& expected, std::span<const float> actual,
                           double rel, double abs) {
  if (expected.size() != actual.size()) return 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double a = expected[i];
    const double b = actual[i];
    if (!(std::fabs(a - b) <= abs + rel * std::max(std::fabs(a), std::fabs(b))))
      return static_cast<long>(i);
  }
  return -1;
}

}  // namespace optim_test
