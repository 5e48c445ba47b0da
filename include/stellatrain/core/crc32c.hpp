// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli), the checksum of the library's file and wire formats: a portable
// table-driven implementation and an SSE4.2 one chosen at run time where the CPU has it.
#pragma once

#include <stellatrain/config.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define STELLATRAIN_CRC32C_HAS_SSE42_PATH 1
#else
#define STELLATRAIN_CRC32C_HAS_SSE42_PATH 0
#endif

namespace stellatrain {

namespace detail {

// Reflected CRC-32C polynomial (0x1EDC6F41 bit-reversed).
inline constexpr std::uint32_t crc32c_polynomial = 0x82F63B78u;

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zero bytes, so eight
// input bytes fold into the running CRC with eight independent lookups.
using crc32c_tables = std::array<std::array<std::uint32_t, 256>, 8>;

inline constexpr crc32c_tables make_crc32c_tables() noexcept {
  crc32c_tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ ((c & 1u) != 0 ? crc32c_polynomial : 0u);
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xffu];
  }
  return t;
}

inline constexpr crc32c_tables crc32c_table = make_crc32c_tables();

// Works on the raw (pre-inverted) register: callers invert on entry and exit.
inline std::uint32_t crc32c_update_portable(std::uint32_t crc, const unsigned char* p,
                                            std::size_t n) noexcept {
  while (n >= 8) {
    std::uint32_t lo;
    std::uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    if constexpr (std::endian::native == std::endian::big) {
      lo = __builtin_bswap32(lo);
      hi = __builtin_bswap32(hi);
    }
    lo ^= crc;
    crc = crc32c_table[7][lo & 0xffu] ^ crc32c_table[6][(lo >> 8) & 0xffu] ^
          crc32c_table[5][(lo >> 16) & 0xffu] ^ crc32c_table[4][lo >> 24] ^
          crc32c_table[3][hi & 0xffu] ^ crc32c_table[2][(hi >> 8) & 0xffu] ^
          crc32c_table[1][(hi >> 16) & 0xffu] ^ crc32c_table[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ crc32c_table[0][(crc ^ *p++) & 0xffu];
  return crc;
}

#if STELLATRAIN_CRC32C_HAS_SSE42_PATH
// The crc32 instruction computes exactly this CRC (it was added to SSE4.2 for it). Compiled
// for SSE4.2 through the target attribute, so the rest of the program needs no -msse4.2.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_update_sse42(
    std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

inline bool cpu_has_sse42() noexcept {
  // One check per process; __builtin_cpu_supports reads a table filled at start-up.
  static const bool has = __builtin_cpu_supports("sse4.2") != 0;
  return has;
}
#endif

}  // namespace detail

/// CRC-32C (Castagnoli polynomial 0x1EDC6F41, reflected, initial value and final xor
/// 0xFFFFFFFF), as used by iSCSI, ext4 and many storage formats.
///
/// `seed` is the CRC of the bytes before `data` (0 to start), so a checksum can be computed
/// piece by piece: `crc32c(b, crc32c(a)) == crc32c(a + b)`. Uses the SSE4.2 `crc32`
/// instruction when the running CPU has it (chosen at run time), else a slicing-by-8 table;
/// both give the same result. Linear time, no allocation, thread-safe.
///
/// \code
///   const char text[] = "123456789";
///   auto crc = stellatrain::crc32c(std::as_bytes(std::span(text, 9)));  // 0xE3069283
/// \endcode
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> data,
                                          std::uint32_t seed = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::uint32_t crc = ~seed;
#if STELLATRAIN_CRC32C_HAS_SSE42_PATH
  if (detail::cpu_has_sse42()) return ~detail::crc32c_update_sse42(crc, p, data.size());
#endif
  return ~detail::crc32c_update_portable(crc, p, data.size());
}

/// The same checksum computed by the portable table-driven code only (for tests and for
/// comparing the two implementations).
[[nodiscard]] inline std::uint32_t crc32c_portable(std::span<const std::byte> data,
                                                   std::uint32_t seed = 0) noexcept {
  return ~detail::crc32c_update_portable(~seed, reinterpret_cast<const unsigned char*>(data.data()),
                                         data.size());
}

}  // namespace stellatrain
