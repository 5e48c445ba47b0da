// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/core/sparse.hpp>

#include "catch.hpp"

#include <cstdint>
#include <string>
#include <vector>

using namespace stellatrain;

namespace {
template <class F>
std::string error_message(F&& f, errc expected) {
  try {
    f();
  } catch (const error& e) {
    CHECK(e.code() == expected);
    return e.what();
  }
  FAIL("no stellatrain::error thrown");
  return {};
}
}  // namespace

TEST_CASE("sparse_view exposes its pairs and converts to read-only", "[sparse]") {
  std::vector<std::uint32_t> idx{1, 5, 9};
  std::vector<float> val{0.5f, -1.0f, 2.0f};
  sparse_view<float, std::uint32_t> v{idx, val, 10};
  CHECK(v.size() == 3);
  CHECK(v.dense_size() == 10);
  CHECK(v.density() == Approx(0.3));
  v.values()[1] = 4.0f;
  CHECK(val[1] == 4.0f);
  sparse_view<const float, const std::uint32_t> ro = v;
  CHECK(ro.indices()[2] == 9);
  CHECK(ro.values()[1] == 4.0f);
  auto sub = ro.subview(1, 2);
  CHECK(sub.size() == 2);
  CHECK(sub.indices()[0] == 5);
  CHECK(sub.dense_size() == 10);
  STATIC_REQUIRE(std::is_convertible_v<sparse_view<bf16, std::uint64_t>,
                                       sparse_view<const bf16, const std::uint64_t>>);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<sparse_view<const bf16, const std::uint64_t>,
                                             sparse_view<bf16, std::uint64_t>>);
  CHECK(sparse_view<const float>{}.density() == 0.0);
}

TEST_CASE("validate_sparse names the first bad position", "[sparse]") {
  std::vector<std::uint32_t> idx{1, 5, 5, 12};
  std::vector<float> val(4, 1.0f);
  sparse_view<const float, const std::uint32_t> v{idx, val, 10};
  auto m =
      error_message([&] { validate_sparse(v, index_order::any, "tensor 7"); }, errc::out_of_range);
  CHECK(m.find("tensor 7") != std::string::npos);
  CHECK(m.find("index 12 at position 3") != std::string::npos);
  m = error_message([&] { validate_sparse(v.subview(0, 3), index_order::strictly_ascending); },
                    errc::invalid_argument);
  CHECK(m.find("position 2") != std::string::npos);
  CHECK_NOTHROW(validate_sparse(v.subview(0, 2), index_order::strictly_ascending));
  CHECK_NOTHROW(validate_sparse(v.subview(0, 3), index_order::any));
}

TEST_CASE("64-bit indices past 2^32 into a large dense tensor", "[sparse]") {
  const std::uint64_t big = (std::uint64_t{1} << 34) + 3;
  std::vector<std::uint64_t> idx{0, (std::uint64_t{1} << 32) + 1, big - 1};
  std::vector<fp16> val(3, fp16{1.0f});
  sparse_view<const fp16, const std::uint64_t> v{idx, val, big};
  CHECK_NOTHROW(validate_sparse(v, index_order::strictly_ascending));
  idx[2] = big;
  auto m = error_message([&] { validate_sparse(v); }, errc::out_of_range);
  CHECK(m.find(std::to_string(big)) != std::string::npos);
}

TEST_CASE("sparse_buffer resizes within its capacity and grows on reserve", "[sparse]") {
  sparse_buffer<bf16, std::uint32_t> s(1000, 4);
  CHECK(s.size() == 0);
  CHECK(s.capacity() == 4);
  s.resize(3);
  s.indices()[0] = 2;
  s.indices()[1] = 7;
  s.indices()[2] = 999;
  s.values()[2] = bf16{3.0f};
  CHECK_NOTHROW(validate_sparse(s.view(), index_order::strictly_ascending));
  CHECK_THROWS_AS(s.resize(5), error);
  s.reserve(100);
  CHECK(s.capacity() == 100);
  CHECK(s.size() == 3);
  CHECK(s.indices()[1] == 7);
  CHECK(s.values()[2].to_float() == 3.0f);
  const auto& cs = s;
  sparse_view<const bf16, const std::uint32_t> v = cs.view();
  CHECK(v.dense_size() == 1000);
}
