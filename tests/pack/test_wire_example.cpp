// SPDX-License-Identifier: Apache-2.0
// The worked example of docs/wire-format.md: the bytes are read from the document itself, decoded,
// and compared with what message_packer writes for the same input.
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include "catch.hpp"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

using namespace stellatrain;

namespace {

// The repository root, from this file's path (tests/pack/test_wire_example.cpp).
std::string source_root() {
  std::string here = __FILE__;
  for (int up = 0; up < 3; ++up) here = here.substr(0, here.find_last_of("/\\"));
  return here;
}

// The bytes of the first ```hex block of the document (comments after '#' ignored).
std::vector<std::byte> example_bytes() {
  std::ifstream doc(source_root() + "/docs/wire-format.md");
  REQUIRE(doc.good());
  std::vector<std::byte> bytes;
  std::string line;
  bool inside = false;
  while (std::getline(doc, line)) {
    if (!inside) {
      inside = line.rfind("```hex", 0) == 0;
      continue;
    }
    if (line.rfind("```", 0) == 0) break;
    std::istringstream words(line.substr(0, line.find('#')));
    std::string w;
    while (words >> w) {
      REQUIRE(w.size() == 2);
      bytes.push_back(static_cast<std::byte>(std::stoul(w, nullptr, 16)));
    }
  }
  return bytes;
}

}  // namespace

TEST_CASE("wire format: the worked example of docs/wire-format.md decodes as documented",
          "[pack][wire]") {
  const auto bytes = example_bytes();
  REQUIRE(bytes.size() == 253);
  inline_executor ex;
  const std::vector<tensor_info> tensors = {{7, 1000}, {9, 16}, {11, 50}};
  message_unpacker u(tensors);
  const auto& info = u.parse(bytes, ex);
  CHECK(info.tag == 42);
  REQUIRE(info.sections.size() == 3);
  CHECK(info.sections[0].indices == index_encoding::delta_bitpacked);
  CHECK(info.sections[1].indices == index_encoding::bitmap);
  CHECK(info.sections[2].indices == index_encoding::random_k);
  CHECK(info.sections[2].random.seed == 5);
  CHECK(info.sections[2].random.step == 2);
  CHECK(info.sections[2].random.tensor == 11);
  REQUIRE(info.controls.size() == 1);
  CHECK(info.controls[0].type == 65536);
  CHECK(info.controls[0].offset == 205);
  CHECK(std::vector<std::byte>(info.controls[0].payload.begin(), info.controls[0].payload.end()) ==
        std::vector<std::byte>{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}});

  sparse_buffer<float> out(0, 4);
  u.decode(0, out, ex);
  CHECK(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) ==
        std::vector<std::uint32_t>{3, 17, 18, 700});
  CHECK(std::vector<float>(out.values().begin(), out.values().end()) ==
        std::vector<float>{0.5f, -1.25f, 2.0f, 3.0f});
  CHECK(out.dense_size() == 1000);
  u.decode(1, out, ex);
  CHECK(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) ==
        std::vector<std::uint32_t>{1, 4, 5, 15});
  CHECK(std::vector<float>(out.values().begin(), out.values().end()) ==
        std::vector<float>{1.0f, -2.0f, 0.5f, 3.0f});
  u.decode(2, out, ex);
  CHECK(std::vector<std::uint32_t>(out.indices().begin(), out.indices().end()) ==
        std::vector<std::uint32_t>{10, 33});
  CHECK(std::vector<float>(out.values().begin(), out.values().end()) ==
        std::vector<float>{1.5f, -0.25f});
}

TEST_CASE("wire format: the packer writes the documented example byte for byte", "[pack][wire]") {
  inline_executor ex;
  const std::vector<std::uint32_t> i0 = {3, 17, 18, 700};
  const std::vector<bf16> v0 = {bf16(0.5f), bf16(-1.25f), bf16(2.0f), bf16(3.0f)};
  const std::vector<std::uint32_t> i1 = {1, 4, 5, 15};
  const std::vector<float> v1 = {1.0f, -2.0f, 0.5f, 3.0f};
  const std::vector<fp16> v2 = {fp16(1.5f), fp16(-0.25f)};
  message_packer p;
  p.clear(42);
  p.add(7, sparse_view<const bf16, const std::uint32_t>(i0, v0, 1000),
        {.indices = index_encoding::delta_bitpacked, .values = value_encoding::bf16});
  p.add(9, sparse_view<const float, const std::uint32_t>(i1, v1, 16));
  p.add_random_k<fp16>(11, {.seed = 5, .step = 2, .tensor = 11}, 50, v2, value_encoding::fp16);
  const std::vector<std::byte> control = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  p.add_control(control_type::first_application, control);
  std::vector<std::byte> m(p.prepare(ex));
  p.write(m, ex);
  CHECK(p.chosen_encoding(1) == index_encoding::bitmap);
  CHECK(m == example_bytes());
}
