// SPDX-License-Identifier: Apache-2.0
// Compiled with the build's default flags: the architecture xsimd picks for them (SSE2 on a
// plain x86-64 build). Listed first when linking, so that any inline function the per-ISA
// units share with it is taken from here and runs on every CPU.
#include "kernels_impl.hpp"

namespace dispatch_example {
const optim_kernels* kernels_portable() { return impl::table<xsimd::default_arch>("portable"); }
}  // namespace dispatch_example
