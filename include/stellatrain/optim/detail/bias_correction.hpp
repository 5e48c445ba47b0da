// SPDX-License-Identifier: Apache-2.0
// Adam's bias-correction factors for a step number k, and a table of them for per-element
// steps (a lookup instead of two pow calls per touched element: pow/exp per element costs
// 2-3x at low density).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/error.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace stellatrain::detail {

// 1 / (1 - beta1^k) and 1 / sqrt(1 - beta2^k) for step k >= 1, computed in double as PyTorch
// computes its Python-float scalars, then rounded to float.
struct adam_bias_terms {
  float inv_bias_correction1 = 1.0f;
  float inv_sqrt_bias_correction2 = 1.0f;
};

[[nodiscard]] inline adam_bias_terms adam_bias_terms_at(float beta1, float beta2,
                                                        std::uint64_t k) noexcept {
  const double kk = static_cast<double>(k);
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), kk);
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), kk);
  return {static_cast<float>(1.0 / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
}

// Entries for k = 0 .. size()-1 (entry 0 unused). Built up to the first k from which both
// factors are exactly 1.0f (so every larger k reads the last entry and gets the exact value);
// beta = 0.999 needs about 17K entries (136 KiB), 0.9999 about 170K.
class adam_bias_table {
 public:
  /// Tables above this many entries are refused (beta too close to 1 for per-element steps).
  static constexpr std::uint64_t max_entries = std::uint64_t{1} << 22;

  adam_bias_table() = default;

  adam_bias_table(float beta1, float beta2) {
    // Find where the factors reach 1.0f, by doubling then bisection (monotone in k).
    auto converged = [&](std::uint64_t k) {
      const auto t = adam_bias_terms_at(beta1, beta2, k);
      return t.inv_bias_correction1 == 1.0f && t.inv_sqrt_bias_correction2 == 1.0f;
    };
    std::uint64_t hi = 1;
    while (!converged(hi)) {
      if (hi >= max_entries) {
        throw_error(errc::invalid_argument,
                    "adam: per-element steps need beta1 and beta2 whose bias correction "
                    "reaches 1 within " +
                        std::to_string(max_entries) + " steps; beta2 = " + std::to_string(beta2) +
                        " is too close to 1 (use step_count::per_tensor)");
      }
      hi *= 2;
    }
    std::uint64_t lo = hi / 2;  // not converged (or 0)
    while (hi - lo > 1) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      (converged(mid) ? hi : lo) = mid;
    }
    entries_ = aligned_buffer<adam_bias_terms>(static_cast<std::size_t>(hi + 1));
    entries_[0] = {};
    for (std::uint64_t k = 1; k <= hi; ++k) {
      entries_[static_cast<std::size_t>(k)] = adam_bias_terms_at(beta1, beta2, k);
    }
  }

  [[nodiscard]] bool empty() const noexcept { return entries_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

  /// The factors for step `k` >= 1 (any k: past the table they are exactly 1).
  [[nodiscard]] STELLATRAIN_FORCE_INLINE adam_bias_terms at(std::uint64_t k) const noexcept {
    const std::size_t last = entries_.size() - 1;
    return entries_.data()[k < last ? static_cast<std::size_t>(k) : last];
  }

 private:
  aligned_buffer<adam_bias_terms> entries_;
};

}  // namespace stellatrain::detail
