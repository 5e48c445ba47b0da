// SPDX-License-Identifier: Apache-2.0
// Compiled with -mavx2 -mfma -mf16c (see CMakeLists.txt): call only on CPUs that have them.
#include "kernels_impl.hpp"

namespace dispatch_example {
const optim_kernels* kernels_avx2() { return impl::table<xsimd::fma3<xsimd::avx2>>("avx2+fma"); }
}  // namespace dispatch_example
