// SPDX-License-Identifier: Apache-2.0
// libFuzzer target over message_unpacker (see fuzz_unpack_body.hpp). Built by
// tests/fuzz/CMakeLists.txt with clang and -fsanitize=fuzzer,address,undefined; run by
// scripts/fuzz.
#include "fuzz_unpack_body.hpp"

#include <cstddef>
#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return stellatrain::fuzz::unpack_one(data, size);
}
