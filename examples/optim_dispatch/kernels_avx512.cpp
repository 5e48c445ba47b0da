// SPDX-License-Identifier: Apache-2.0
// Compiled with -mavx512f -mavx512cd -mavx512dq -mavx512bw -mavx512vl -mfma -mf16c (see
// CMakeLists.txt): call only on CPUs that have them.
#include "kernels_impl.hpp"

namespace dispatch_example {
const optim_kernels* kernels_avx512() { return impl::table<xsimd::avx512bw>("avx512bw"); }
}  // namespace dispatch_example
