// SPDX-License-Identifier: Apache-2.0
// main() of the CUDA test executables. Without a usable CUDA device every test run exits with
// status 77, which ctest reports as "skipped"; listing the tests (what ctest's discovery does
// at build time) works everywhere.
#define CATCH_CONFIG_RUNNER
#include "catch.hpp"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <string_view>

namespace {

bool listing_only(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (arg.starts_with("--list") || arg == "-l" || arg == "-h" || arg == "--help") return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (!listing_only(argc, argv)) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::puts("skipped: no CUDA device");
      return 77;
    }
  }
  return Catch::Session().run(argc, argv);
}
