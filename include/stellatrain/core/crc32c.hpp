// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli), the checksum of the wire format: a portable table-driven version and the
// SSE4.2 `crc32` instruction, chosen at run time.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/cpu_dispatch.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>

#include <xsimd/xsimd.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

namespace stellatrain {

namespace detail {

// The Castagnoli polynomial 0x1EDC6F41, bit-reflected (bit 31 is the coefficient of x^0): CRC
// registers, data and the constants below all use the reflected representation.
inline constexpr std::uint32_t crc32c_polynomial = 0x82F63B78u;

// a(x) * b(x) mod P(x) over GF(2), reflected representation.
constexpr std::uint32_t crc32c_multiply(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ crc32c_polynomial : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * 2^i) mod P(x) for i = 0..63: the operators "feed 2^i zero bytes".
struct crc32c_zero_powers {
  std::uint32_t power[64];
};

constexpr crc32c_zero_powers make_crc32c_zero_powers() noexcept {
  crc32c_zero_powers t{};
  t.power[0] = 0x00800000u;  // x^8: one zero byte
  for (int i = 1; i < 64; ++i) t.power[i] = crc32c_multiply(t.power[i - 1], t.power[i - 1]);
  return t;
}

inline constexpr crc32c_zero_powers crc32c_zero_power_table = make_crc32c_zero_powers();

// x^(8 * bytes) mod P(x): multiplying a CRC register by it is the same as feeding it `bytes`
// zero bytes. One multiplication per set bit of `bytes`, from the table of powers (64 bits is
// plenty: a shift by 2^61 bytes is the most any span can ask for).
constexpr std::uint32_t crc32c_zeros_operator(std::uint64_t bytes) noexcept {
  std::uint32_t result = 0x80000000u;  // x^0
  for (int i = 0; bytes != 0; ++i, bytes >>= 1) {
    if (bytes & 1u) result = crc32c_multiply(result, crc32c_zero_power_table.power[i]);
  }
  return result;
}

// Slicing-by-8 tables: table[0] advances the register by one byte, table[k] by a byte followed
// by k zero bytes.
struct crc32c_slicing_tables {
  std::uint32_t table[8][256];
};

constexpr crc32c_slicing_tables make_crc32c_slicing_tables() noexcept {
  crc32c_slicing_tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t r = i;
    for (int bit = 0; bit < 8; ++bit) r = (r & 1u) ? (r >> 1) ^ crc32c_polynomial : r >> 1;
    t.table[0][i] = r;
  }
  for (int k = 1; k < 8; ++k) {
    for (std::uint32_t i = 0; i < 256; ++i) {
      const std::uint32_t prev = t.table[k - 1][i];
      t.table[k][i] = (prev >> 8) ^ t.table[0][prev & 0xffu];
    }
  }
  return t;
}

inline constexpr crc32c_slicing_tables crc32c_tables = make_crc32c_slicing_tables();

// A linear map "feed `Bytes` zero bytes" on CRC registers as four byte-indexed tables, so that
// shifting a register costs four loads instead of a 32-step multiplication.
struct crc32c_shift_table {
  std::uint32_t table[4][256];
};

constexpr crc32c_shift_table make_crc32c_shift_table(std::uint64_t bytes) noexcept {
  crc32c_shift_table t{};
  const std::uint32_t op = crc32c_zeros_operator(bytes);
  for (int k = 0; k < 4; ++k) {
    for (std::uint32_t i = 0; i < 256; ++i) t.table[k][i] = crc32c_multiply(op, i << (8 * k));
  }
  return t;
}

STELLATRAIN_FORCE_INLINE std::uint32_t crc32c_shift(const crc32c_shift_table& t,
                                                    std::uint32_t r) noexcept {
  return t.table[0][r & 0xffu] ^ t.table[1][(r >> 8) & 0xffu] ^ t.table[2][(r >> 16) & 0xffu] ^
         t.table[3][r >> 24];
}

// Lane lengths of the three-way interleaved hardware loop. The crc32 instruction has a latency
// of 3 cycles and a throughput of 1 per cycle, so three independent lanes keep it busy; the
// lanes are joined by shifting the first two past the bytes that follow them.
inline constexpr std::size_t crc32c_long_lane = 4096;
inline constexpr std::size_t crc32c_short_lane = 256;
inline constexpr crc32c_shift_table crc32c_long_shift = make_crc32c_shift_table(crc32c_long_lane);
inline constexpr crc32c_shift_table crc32c_short_shift = make_crc32c_shift_table(crc32c_short_lane);

inline std::uint64_t crc32c_load64(const unsigned char* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Portable update of a raw (not inverted) register, slicing by 8. Reads the bytes as little-endian
// 32-bit words, so it also runs on big-endian hosts (where it byte-swaps).
inline std::uint32_t crc32c_update_software(std::uint32_t crc, const unsigned char* p,
                                            std::size_t n) noexcept {
  const auto& t = crc32c_tables.table;
  auto le32 = [](const unsigned char* q) {
    return static_cast<std::uint32_t>(q[0]) | (static_cast<std::uint32_t>(q[1]) << 8) |
           (static_cast<std::uint32_t>(q[2]) << 16) | (static_cast<std::uint32_t>(q[3]) << 24);
  };
  while (n >= 8) {
    const std::uint32_t lo = crc ^ le32(p);
    const std::uint32_t hi = le32(p + 4);
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
          t[3][hi & 0xffu] ^ t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- != 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xffu];
  return crc;
}

#if STELLATRAIN_X86_INTRINSICS

// The crc32 instruction's kernels are templates on the architecture that calls them only so
// that units built for different instruction sets never share one copy (the linker keeps one
// of each inline function, and a unit's copy may use all its instruction sets).

// One lane of the crc32 instruction over n bytes (any n).
template <class Arch>
STELLATRAIN_TARGET("sse4.2")
inline std::uint32_t
    crc32c_lane_hardware(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
#if defined(__x86_64__)
  std::uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, crc32c_load64(p));
  crc = static_cast<std::uint32_t>(c);
#endif
  for (; n >= 4; n -= 4, p += 4) {
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    crc = _mm_crc32_u32(crc, v);
  }
  for (; n != 0; --n) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

// Three lanes of `lane` bytes each, interleaved, joined into one register.
template <class Arch, std::size_t Lane>
STELLATRAIN_TARGET("sse4.2")
STELLATRAIN_FORCE_INLINE std::uint32_t
    crc32c_stripe_hardware(std::uint32_t crc, const unsigned char* p,
                           const crc32c_shift_table& shift) noexcept {
#if defined(__x86_64__)
  std::uint64_t a = crc, b = 0, c = 0;
  for (std::size_t i = 0; i < Lane; i += 8) {
    a = _mm_crc32_u64(a, crc32c_load64(p + i));
    b = _mm_crc32_u64(b, crc32c_load64(p + Lane + i));
    c = _mm_crc32_u64(c, crc32c_load64(p + 2 * Lane + i));
  }
  const std::uint32_t ab =
      crc32c_shift(shift, static_cast<std::uint32_t>(a)) ^ static_cast<std::uint32_t>(b);
  return crc32c_shift(shift, ab) ^ static_cast<std::uint32_t>(c);
#else
  (void)shift;
  return crc32c_lane_hardware<Arch>(crc, p, 3 * Lane);
#endif
}

template <class Arch>
STELLATRAIN_TARGET("sse4.2")
inline std::uint32_t
    crc32c_update_hardware(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  for (; n >= 3 * crc32c_long_lane; n -= 3 * crc32c_long_lane, p += 3 * crc32c_long_lane) {
    crc = crc32c_stripe_hardware<Arch, crc32c_long_lane>(crc, p, crc32c_long_shift);
  }
  for (; n >= 3 * crc32c_short_lane; n -= 3 * crc32c_short_lane, p += 3 * crc32c_short_lane) {
    crc = crc32c_stripe_hardware<Arch, crc32c_short_lane>(crc, p, crc32c_short_shift);
  }
  return crc32c_lane_hardware<Arch>(crc, p, n);
}

#endif

// Whether the kernel of `Arch` has the crc32 instruction: SSE4.2 and every AVX family.
template <class Arch>
inline constexpr bool arch_has_crc32 = STELLATRAIN_X86_INTRINSICS &&
                                       (lane_isa_of<Arch>() >= lane_isa::avx ||
                                        std::is_base_of_v<xsimd::sse4_2, Arch>);

// Advances a raw (not inverted) register over n bytes, with the crc32 instruction where `Arch`
// has it.
template <class Arch>
std::uint32_t crc32c_update(std::uint32_t crc, const unsigned char* p, std::size_t n) noexcept {
  if constexpr (arch_has_crc32<Arch>) {
#if STELLATRAIN_X86_INTRINSICS
    return crc32c_update_hardware<Arch>(crc, p, n);
#endif
  } else {
    return crc32c_update_software(crc, p, n);
  }
}

/// `crc32c` on the portable path only (the oracle of the tests).
[[nodiscard]] inline std::uint32_t crc32c_software(std::span<const std::byte> data,
                                                   std::uint32_t seed = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  return ~crc32c_update_software(~seed, p, data.size());
}

}  // namespace detail

/// CRC-32C (Castagnoli; the checksum of iSCSI, ext4 and SCTP) of `data`.
///
/// `seed` continues a running checksum: `crc32c(b, crc32c(a))` equals the CRC of `a` followed
/// by `b`; 0 starts a new one. The standard check value holds:
/// `crc32c("123456789") == 0xE3069283`. Uses the SSE4.2 `crc32` instruction in three
/// interleaved lanes where the CPU has it (about 8 bytes per cycle), else a slicing-by-8 table
/// (about 1 byte per cycle); both give the same result on every host.
///
/// \code
///   std::array<std::byte, 9> digits;  // "123456789"
///   auto crc = stellatrain::crc32c(digits);               // 0xE3069283
///   auto part = stellatrain::crc32c(std::span(digits).first(4));
///   auto same = stellatrain::crc32c(std::span(digits).subspan(4), part);  // == crc
/// \endcode
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> data,
                                          std::uint32_t seed = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  // Units built for less than SSE4.2 (plain x86-64) still use it where the CPU has it.
  return ~detail::dispatch_arch<xsimd::default_arch, xsimd::sse4_2>(
      [&](auto arch) { return detail::crc32c_update<decltype(arch)>(~seed, p, data.size()); });
}

}  // namespace stellatrain
