// SPDX-License-Identifier: Apache-2.0
// The body of every kernels_<isa>.cpp: the step entry points for one xsimd architecture.
// Included by exactly one translation unit per architecture, each compiled with its own flags.
#pragma once

#include "optim_kernels.hpp"

#include <stellatrain/core/detail/value_convert.hpp>

#include <bit>
#include <cstring>
#include <type_traits>

namespace dispatch_example::impl {

template <class Arch>
stellatrain::step_report adam_dense(stellatrain::adam_optimizer& opt, std::size_t tensor,
                                    std::span<const float> grad, stellatrain::thread_pool& pool,
                                    std::span<stellatrain::bf16> copy) {
  return opt.step<Arch>(tensor, grad, pool, stellatrain::param_copy<stellatrain::bf16>{copy});
}

template <class Arch>
stellatrain::step_report adam_sparse(
    stellatrain::adam_optimizer& opt, std::size_t tensor,
    stellatrain::sparse_view<const float, const std::uint32_t> grad,
    stellatrain::thread_pool& pool) {
  return opt.step<Arch>(tensor, grad, pool);
}

template <class Arch, class Half>
std::size_t conversion_mismatches_of() {
  using batch = xsimd::batch<float, Arch>;
  constexpr std::size_t w = batch::size;
  std::size_t bad = 0;
  alignas(64) float lanes[w];
  Half in[w];
  Half out[w];
  for (std::uint32_t base = 0; base < 65536; base += w) {
    for (std::size_t k = 0; k < w; ++k)
      in[k] = Half::from_bits(static_cast<std::uint16_t>(base + k));
    const batch x = stellatrain::detail::load_as_float<Arch>(in);
    x.store_aligned(lanes);
    for (std::size_t k = 0; k < w; ++k) {
      const float want = stellatrain::to_float(in[k]);
      bad += std::memcmp(&lanes[k], &want, sizeof want) == 0 ? 0 : 1;
    }
    // Round trip through float and halfway points between neighbours (ties to even).
    for (std::size_t k = 0; k < w; ++k) {
      const auto b = std::bit_cast<std::uint32_t>(lanes[k]);
      lanes[k] = std::bit_cast<float>(
          k % 2 == 0 ? b : b + (std::is_same_v<Half, stellatrain::bf16> ? 0x8000u : 0x1000u));
    }
    stellatrain::detail::store_from_float<Arch>(out, batch::load_aligned(lanes));
    for (std::size_t k = 0; k < w; ++k) bad += out[k].bits() == Half(lanes[k]).bits() ? 0 : 1;
  }
  return bad;
}

template <class Arch>
std::size_t conversion_mismatches() {
  return conversion_mismatches_of<Arch, stellatrain::fp16>() +
         conversion_mismatches_of<Arch, stellatrain::bf16>();
}

template <class Arch>
const optim_kernels* table(const char* isa) {
  static const optim_kernels k{isa, &adam_dense<Arch>, &adam_sparse<Arch>,
                               &conversion_mismatches<Arch>};
  return &k;
}

}  // namespace dispatch_example::impl
