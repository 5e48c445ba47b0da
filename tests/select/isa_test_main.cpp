// SPDX-License-Identifier: Apache-2.0
// The guard of the tests built for one instruction set (STELLATRAIN_TEST_ISA: "avx2" or
// "avx512"): on a CPU without it the program exits 77 (skipped) during static initialisation,
// before Catch2's main runs a test. Catch2's own main comes precompiled with Catch2WithMain, so
// each instruction set's build does not compile Catch2 again.
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace {

bool cpu_has_isa() {
  const std::string_view isa = STELLATRAIN_TEST_ISA;
  __builtin_cpu_init();
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2");
}

const bool isa_checked = [] {
  if (!cpu_has_isa()) {
    std::printf("skipped: this CPU lacks %s\n", STELLATRAIN_TEST_ISA);
    std::fflush(stdout);
    std::_Exit(77);
  }
  return true;
}();

}  // namespace
