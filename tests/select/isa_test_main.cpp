// SPDX-License-Identifier: Apache-2.0
// main() of the tests built for one instruction set (STELLATRAIN_TEST_ISA: "avx2" or
// "avx512"): exits 77 (skipped) before any test runs on a CPU without it.
#define CATCH_CONFIG_RUNNER
#include "catch.hpp"

#include <cstdio>
#include <string_view>

namespace {

bool cpu_has_isa() {
  const std::string_view isa = STELLATRAIN_TEST_ISA;
  __builtin_cpu_init();
  if (isa == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2");
}

}  // namespace

int main(int argc, char** argv) {
  if (!cpu_has_isa()) {
    std::printf("skipped: this CPU lacks %s\n", STELLATRAIN_TEST_ISA);
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
