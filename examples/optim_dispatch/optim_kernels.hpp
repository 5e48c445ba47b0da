// SPDX-License-Identifier: Apache-2.0
// Runtime dispatch of the optimizer kernels per instruction set, xsimd style: each
// kernels_<isa>.cpp instantiates the steps for one architecture and is compiled with that
// architecture's flags; main.cpp asks the CPU what it supports and picks a table.
#pragma once

#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace dispatch_example {

// The entry points one instruction set provides: plain function pointers, so nothing of the
// per-ISA code leaks into the caller's translation unit.
struct optim_kernels {
  const char* isa;
  stellatrain::step_report (*adam_dense)(stellatrain::adam_optimizer&, std::size_t tensor,
                                         std::span<const float> grad, stellatrain::thread_pool&,
                                         std::span<stellatrain::bf16> copy);
  stellatrain::step_report (*adam_sparse)(
      stellatrain::adam_optimizer&, std::size_t tensor,
      stellatrain::sparse_view<const float, const std::uint32_t> grad, stellatrain::thread_pool&);
  // Self-check of this unit's fp16/bf16 conversions (loads of gradients, stores of parameter
  // copies) against the scalar ones over every 16-bit pattern and tricky floats: mismatches.
  std::size_t (*conversion_mismatches)();
};

// One table per translation unit; nullptr where the build has no such unit.
const optim_kernels* kernels_portable();  // the baseline ISA of the build
const optim_kernels* kernels_avx2();      // AVX2 + FMA + F16C
const optim_kernels* kernels_avx512();    // AVX-512 F/CD/DQ/BW/VL

}  // namespace dispatch_example
