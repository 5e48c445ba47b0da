// SPDX-License-Identifier: Apache-2.0
// Builds without x86 per-ISA units: no AVX2 or AVX-512 tables.
#include "optim_kernels.hpp"

namespace dispatch_example {
const optim_kernels* kernels_avx2() { return nullptr; }
const optim_kernels* kernels_avx512() { return nullptr; }
}  // namespace dispatch_example
