// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/version.hpp>

#include "catch.hpp"

#include <cstdint>
#include <string>

using namespace stellatrain;

TEST_CASE("dtype tags, sizes and names", "[dtype]") {
  STATIC_REQUIRE(dtype_of<float> == dtype::f32);
  STATIC_REQUIRE(dtype_of<const fp16> == dtype::f16);
  STATIC_REQUIRE(dtype_of<bf16> == dtype::bf16);
  STATIC_REQUIRE(dtype_of<std::uint16_t> == dtype::u16);
  STATIC_REQUIRE(dtype_of<std::uint32_t> == dtype::u32);
  STATIC_REQUIRE(dtype_of<std::uint64_t> == dtype::u64);
  STATIC_REQUIRE(size_of(dtype::f32) == 4);
  STATIC_REQUIRE(size_of(dtype::bf16) == 2);
  STATIC_REQUIRE(size_of(dtype::u64) == 8);
  STATIC_REQUIRE(size_of(static_cast<dtype>(200)) == 0);
  CHECK(name_of(dtype::f16) == "f16");
  CHECK(name_of(static_cast<dtype>(0)) == "unknown");
}

TEST_CASE("value and index concepts", "[dtype]") {
  STATIC_REQUIRE(value_type<float>);
  STATIC_REQUIRE(value_type<fp16>);
  STATIC_REQUIRE(value_type<bf16>);
  STATIC_REQUIRE_FALSE(value_type<double>);
  STATIC_REQUIRE_FALSE(value_type<std::uint16_t>);
  STATIC_REQUIRE(index_type<std::uint32_t>);
  STATIC_REQUIRE(index_type<std::uint64_t>);
  STATIC_REQUIRE_FALSE(index_type<int>);
  STATIC_REQUIRE_FALSE(index_type<std::uint16_t>);
}

TEST_CASE("the header version matches the CMake project version", "[version]") {
  CHECK(std::string(version_string) == STELLATRAIN_TEST_PROJECT_VERSION);
  STATIC_REQUIRE(STELLATRAIN_VERSION == STELLATRAIN_VERSION_MAJOR * 10000 +
                                            STELLATRAIN_VERSION_MINOR * 100 +
                                            STELLATRAIN_VERSION_PATCH);
}
