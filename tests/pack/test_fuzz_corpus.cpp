// SPDX-License-Identifier: Apache-2.0
// The fuzzer's body (tests/fuzz/fuzz_unpack_body.hpp) in the normal build: every seed of
// tests/fuzz/corpus must parse, decode and repack, and a few thousand deterministic mutations
// of them (bit flips, byte overwrites, truncations, insertions, with and without a recomputed
// checksum) must be handled without a crash. Under the asan preset this is a small sanitized
// fuzz run on every CI build, also where clang is missing.
#include "../fuzz/fuzz_unpack_body.hpp"

#include "catch.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace {

std::filesystem::path corpus_folder() {
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "fuzz" / "corpus";
}

std::vector<std::vector<std::uint8_t>> seeds() {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(corpus_folder()))
    files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

}  // namespace

TEST_CASE("fuzz corpus: every seed is a valid message that survives the fuzz body",
          "[pack][fuzz]") {
  const auto all = seeds();
  REQUIRE(all.size() >= 15);
  for (const auto& s : all) {
    REQUIRE(s.size() > stellatrain::wire::message_header_bytes);
    std::vector<std::byte> message(s.size() - 1);
    std::memcpy(message.data(), s.data() + 1, message.size());
    stellatrain::message_unpacker u(stellatrain::fuzz::registered_tensors());
    stellatrain::inline_executor ex;
    CHECK_NOTHROW(u.parse(message, ex));
    stellatrain::fuzz::unpack_one(s.data(), s.size());
  }
}

TEST_CASE("fuzz corpus: mutations of the seeds never crash", "[pack][fuzz]") {
  std::mt19937_64 rng(2024);
  int runs = 0;
  for (const auto& seed : seeds()) {
    const int mutations = seed.size() > 20000 ? 40 : 250;
    for (int m = 0; m < mutations; ++m) {
      auto s = seed;
      s[0] = static_cast<std::uint8_t>(rng() % 4);  // reseal or not, inline or pool
      const std::size_t edits = 1 + rng() % 4;
      for (std::size_t e = 0; e < edits && s.size() > 1; ++e) {
        const std::size_t at = 1 + rng() % (s.size() - 1);
        switch (rng() % 5) {
          case 0:
            s[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            s[at] = static_cast<std::uint8_t>(rng());
            break;
          case 2:
            s.resize(at);
            break;
          case 3:
            s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), static_cast<std::uint8_t>(rng()));
            break;
          default: {  // a plausible small number in a 64-bit field
            const std::uint64_t v = rng() % 3 == 0 ? rng() : rng() % 70000;
            for (std::size_t b = 0; b < 8 && at + b < s.size(); ++b)
              s[at + b] = static_cast<std::uint8_t>(v >> (8 * b));
          }
        }
      }
      stellatrain::fuzz::unpack_one(s.data(), s.size());
      ++runs;
    }
  }
  CHECK(runs > 3000);
}
