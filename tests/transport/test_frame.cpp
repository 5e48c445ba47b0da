// SPDX-License-Identifier: Apache-2.0
// The frame header of the socket and MPI backends: CRC32C reference values, round trips, and
// every corruption rejected before a length is trusted.
#include "catch.hpp"

#include <stellatrain/transport/detail/frame.hpp>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

using namespace stellatrain;
using namespace stellatrain::detail;

namespace {
std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
  return b;
}
errc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const error& e) {
    return static_cast<errc>(e.code().value());
  }
  return errc{};
}
}  // namespace

TEST_CASE("frame CRC32C matches the reference values", "[transport][frame]") {
  CHECK(frame_crc32c(bytes_of("")) == 0u);
  CHECK(frame_crc32c(bytes_of("123456789")) == 0xE3069283u);  // RFC 3720 check value
  std::vector<std::byte> zeros(32, std::byte{0});
  CHECK(frame_crc32c(zeros) == 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  std::vector<std::byte> ones(32, std::byte{0xFF});
  CHECK(frame_crc32c(ones) == 0x62A8AB43u);
  // Incremental use equals one pass, at every split (tails of the 8-byte loop).
  const auto text = bytes_of("The quick brown fox jumps over the lazy dog, twice over.");
  const auto whole = frame_crc32c(text);
  for (std::size_t cut = 0; cut <= text.size(); ++cut) {
    const std::span<const std::byte> all(text);
    CHECK(frame_crc32c(all.subspan(cut), frame_crc32c(all.first(cut))) == whole);
  }
}

TEST_CASE("frame headers round-trip and reject corruption", "[transport][frame]") {
  const auto payload = bytes_of("payload bytes");
  frame_header h = data_frame(3, 77, payload, true);
  frame_bytes b{};
  encode_frame(h, b);
  const frame_header d = decode_frame(b, 3, 1000, "test");
  CHECK(d.kind == frame_kind::data);
  CHECK(d.source == 3);
  CHECK(d.tag == 77);
  CHECK(d.length == payload.size());
  CHECK(d.flags == frame_flag_payload_crc);
  verify_payload(d, payload, "test");

  // Every single-bit flip in the header is caught (magic, version, CRC or field check).
  for (std::size_t bit = 0; bit < 8 * frame_header_bytes; ++bit) {
    frame_bytes c = b;
    c[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    CHECK(code_of([&] { (void)decode_frame(c, 3, 1000, "test"); }) != errc{});
  }
  // Wrong source, oversize length, wrong size, payload corruption, short payload.
  CHECK(code_of([&] { (void)decode_frame(b, 2, 1000, "test"); }) == errc::malformed_message);
  CHECK(code_of([&] { (void)decode_frame(b, 3, 5, "test"); }) == errc::resource_exhausted);
  CHECK(code_of([&] {
          (void)decode_frame(std::span<const std::byte>(b).first(31), 3, 1000, "test");
        }) == errc::malformed_message);
  auto bad = payload;
  bad[4] ^= std::byte{1};
  CHECK(code_of([&] { verify_payload(d, bad, "test"); }) == errc::checksum_mismatch);
  CHECK(code_of([&] { verify_payload(d, std::span<const std::byte>(payload).first(3), "test"); }) ==
        errc::malformed_message);
  frame_bytes v = b;
  v[4] = std::byte{9};
  encode_frame(h, b);  // unchanged original
  CHECK(code_of([&] { (void)decode_frame(v, 3, 1000, "test"); }) == errc::version_mismatch);
  // Without the flag the payload CRC is not checked.
  frame_header plain = data_frame(1, 2, payload, false);
  CHECK(plain.flags == 0);
  verify_payload(plain, payload, "test");
}
