// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/error.hpp>

#include "catch.hpp"

#include <string>
#include <system_error>

using stellatrain::errc;

TEST_CASE("error is a system_error in the stellatrain category", "[error]") {
  const stellatrain::error e(errc::checksum_mismatch, "unpack: message 7: crc 0x1234 != 0x5678");
  const std::system_error& base = e;
  CHECK(base.code() == errc::checksum_mismatch);
  CHECK(base.code() != errc::malformed_message);
  CHECK(std::string(base.code().category().name()) == "stellatrain");
  const std::string what = e.what();
  CHECK(what.find("unpack: message 7: crc 0x1234 != 0x5678") != std::string::npos);
  CHECK(what.find("checksum mismatch") != std::string::npos);
}

TEST_CASE("every error code has its own message", "[error]") {
  const auto& cat = stellatrain::error_category();
  for (int c = 1; c <= static_cast<int>(errc::resource_exhausted); ++c) {
    const std::string m = cat.message(c);
    CHECK_FALSE(m.empty());
    CHECK(m.find("unknown") == std::string::npos);
  }
  CHECK(cat.message(999).find("unknown") != std::string::npos);
}

TEST_CASE("errc converts to std::error_code implicitly", "[error]") {
  const std::error_code ec = errc::timeout;
  CHECK(ec.category() == stellatrain::error_category());
  CHECK(ec.value() == static_cast<int>(errc::timeout));
}

namespace {
void named_function_that_fails() { stellatrain::throw_error_here(errc::invalid_argument, "k > n"); }
}  // namespace

TEST_CASE("throw_error and throw_error_here say what and where", "[error]") {
  try {
    stellatrain::throw_error(errc::out_of_range, "tensor 3: index 9 >= 8");
    FAIL("did not throw");
  } catch (const stellatrain::error& e) {
    CHECK(e.code() == errc::out_of_range);
    CHECK(std::string(e.what()).find("tensor 3: index 9 >= 8") != std::string::npos);
  }
  try {
    named_function_that_fails();
    FAIL("did not throw");
  } catch (const stellatrain::error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()).find("named_function_that_fails") != std::string::npos);
    CHECK(std::string(e.what()).find("k > n") != std::string::npos);
  }
}
