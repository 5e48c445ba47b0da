// SPDX-License-Identifier: Apache-2.0
// The body of every kernels_<isa>.cpp: the step entry points for one xsimd architecture.
// Included by exactly one translation unit per architecture, each compiled with its own flags.
#pragma once

#include "optim_kernels.hpp"

namespace dispatch_example::impl {

template <class Arch>
stellatrain::step_report adam_dense(stellatrain::adam_optimizer& opt, std::size_t tensor,
                                    std::span<const float> grad, stellatrain::thread_pool& pool,
                                    std::span<stellatrain::bf16> copy) {
  return opt.step<Arch>(tensor, grad, pool, stellatrain::param_copy<stellatrain::bf16>{copy});
}

template <class Arch>
stellatrain::step_report adam_sparse(stellatrain::adam_optimizer& opt, std::size_t tensor,
                                     stellatrain::sparse_view<const float, const std::uint32_t> grad,
                                     stellatrain::thread_pool& pool) {
  return opt.step<Arch>(tensor, grad, pool);
}

template <class Arch>
const optim_kernels* table(const char* isa) {
  static const optim_kernels k{isa, &adam_dense<Arch>, &adam_sparse<Arch>};
  return &k;
}

}  // namespace dispatch_example::impl
