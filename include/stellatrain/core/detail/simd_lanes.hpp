// SPDX-License-Identifier: Apache-2.0
// Lane primitives of the selection kernels that xsimd 8 lacks: comparison masks as bit sets,
// compress-store of the selected lanes, widening 16-bit loads.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>
#include <stellatrain/core/detail/xsimd_compat.hpp>

#include <xsimd/xsimd.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace stellatrain::detail {

// For a mask of 8 lanes: the indices of the set lanes in order, 3 bits each (the permutation
// that moves the selected lanes to the front).
inline constexpr std::array<std::uint32_t, 256> compress_permutation_8 = [] {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t mask = 0; mask < 256; ++mask) {
    std::uint32_t packed = 0;
    std::uint32_t slot = 0;
    for (std::uint32_t lane = 0; lane < 8; ++lane) {
      if ((mask >> lane) & 1u) packed |= lane << (3 * slot++);
    }
    table[mask] = packed;
  }
  return table;
}();

/// 32-bit lane operations of one xsimd architecture. Raw element bits travel as int32 lanes
/// (16-bit inputs zero-extended); magnitude keys are below 2^31, so signed compares order them.
template <class Arch>
struct lane_ops {
  using ibatch = xsimd::batch<std::int32_t, Arch>;
  using fbatch = xsimd::batch<float, Arch>;
  using ibool = xsimd::batch_bool<std::int32_t, Arch>;
  static constexpr std::size_t width = ibatch::size;
  static constexpr lane_isa isa = lane_isa_of<Arch>();
  /// Whether `compress` and `compress2` are a permutation or a compress instruction rather
  /// than scalar stores (`compress` is branch-free either way where `width` is a multiple of
  /// 4; `compress2` loops over the set bits).
  static constexpr bool branchless_compress = isa == lane_isa::avx2 || isa == lane_isa::avx512;

  static ibatch iota() noexcept {
    alignas(64) std::int32_t lanes[width];
    for (std::size_t l = 0; l < width; ++l) lanes[l] = static_cast<std::int32_t>(l);
    return ibatch::load_aligned(lanes);
  }

  /// `width` 32-bit words (stored keys or raw bits).
  static ibatch load_words(const std::uint32_t* p) noexcept {
    return ibatch::load_unaligned(reinterpret_cast<const std::int32_t*>(p));
  }

  static ibatch load_bits(const float* p) noexcept {
    return bitcast_lanes<std::int32_t>(fbatch::load_unaligned(p));
  }

  /// `width` 16-bit values zero-extended to 32-bit lanes.
  static ibatch load_bits(const std::uint16_t* p) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      // The zero-masked form: GCC 12 warns (wrongly) inside the unmasked intrinsic.
      return ibatch(_mm512_maskz_cvtepu16_epi32(
          static_cast<__mmask16>(0xffff), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#endif
    } else if constexpr (isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      return ibatch(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
    } else if constexpr (isa == lane_isa::sse2) {
#if STELLATRAIN_X86_INTRINSICS
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      return ibatch(_mm_unpacklo_epi16(v, _mm_setzero_si128()));
#endif
    } else {
      alignas(64) std::int32_t lanes[width];
      for (std::size_t l = 0; l < width; ++l) lanes[l] = p[l];
      return ibatch::load_aligned(lanes);
    }
  }

  /// Bit l of the result is lane l of `m`.
  static std::uint32_t mask_bits(const ibool& m) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      return static_cast<std::uint32_t>(static_cast<__mmask16>(m));
#endif
    } else if constexpr (isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      return static_cast<std::uint32_t>(
          _mm256_movemask_ps(_mm256_castsi256_ps(static_cast<__m256i>(m))));
#endif
    } else if constexpr (isa == lane_isa::sse2) {
#if STELLATRAIN_X86_INTRINSICS
      return static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(static_cast<__m128i>(m))));
#endif
    } else {
      alignas(64) bool lanes[width];
      m.store_aligned(lanes);
      std::uint32_t bits = 0;
      for (std::size_t l = 0; l < width; ++l) bits |= static_cast<std::uint32_t>(lanes[l]) << l;
      return bits;
    }
  }

  /// Whether `mask_bytes8` is available: AVX2, whose 8 lanes make a byte per comparison.
  static constexpr bool packs_masks8 = isa == lane_isa::avx2;

  /// The lane bits of eight comparisons in one word, byte q holding those of m[q] (bit l:
  /// lane l), as eight `mask_bits` would give them; bit q of `nonempty` is set where m[q] has
  /// a set lane. Two packs per pair, one permutation and a movemask per four comparisons.
  STELLATRAIN_FORCE_INLINE static std::uint64_t mask_bytes8(
      const std::array<ibool, 8>& m, std::uint32_t& nonempty) noexcept requires packs_masks8 {
#if STELLATRAIN_X86_INTRINSICS
    auto v = [&](std::size_t q) { return static_cast<__m256i>(m[q]); };
    // Within each 128-bit half the packs leave 4-lane groups in the order (m0 lo, m1 lo, m2
    // lo, m3 lo | m0 hi, m1 hi, m2 hi, m3 hi); the permutation puts each comparison's 8 lanes
    // together.
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i first = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(v(0), v(1)), _mm256_packs_epi32(v(2), v(3))), order);
    const __m256i second = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(v(4), v(5)), _mm256_packs_epi32(v(6), v(7))), order);
    const __m256i zero = _mm256_setzero_si256();
    const auto empty = static_cast<std::uint32_t>(
        _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(first, zero))) |
        (_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(second, zero))) << 4));
    nonempty = ~empty & 0xffu;
    return std::uint64_t{static_cast<std::uint32_t>(_mm256_movemask_epi8(first))} |
           (std::uint64_t{static_cast<std::uint32_t>(_mm256_movemask_epi8(second))} << 32);
#else
    nonempty = 0;
    return 0;
#endif
  }

  /// Sum of the lanes (through memory: xsimd 8's AVX-512 reduction trips GCC 12 warnings).
  static std::int64_t sum_lanes(const ibatch& v) noexcept {
    alignas(64) std::int32_t lanes[width];
    v.store_aligned(lanes);
    std::int64_t s = 0;
    for (std::size_t l = 0; l < width; ++l) s += lanes[l];
    return s;
  }

  /// Lane-wise maximum and minimum. (On AVX-512 masked forms with a defined pass-through
  /// operand: GCC 12 warns, wrongly, inside the unmasked intrinsics.)
  static ibatch max(const ibatch& a, const ibatch& b) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      return ibatch(_mm512_mask_max_epi32(static_cast<__m512i>(a), static_cast<__mmask16>(0xffff),
                                          static_cast<__m512i>(a), static_cast<__m512i>(b)));
#endif
    } else {
      return xsimd::max(a, b);
    }
  }

  static ibatch min(const ibatch& a, const ibatch& b) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      return ibatch(_mm512_mask_min_epi32(static_cast<__m512i>(a), static_cast<__mmask16>(0xffff),
                                          static_cast<__m512i>(a), static_cast<__m512i>(b)));
#endif
    } else {
      return xsimd::min(a, b);
    }
  }

  /// Largest lane.
  static std::int32_t max_lane(const ibatch& v) noexcept {
    alignas(64) std::int32_t lanes[width];
    v.store_aligned(lanes);
    std::int32_t m = lanes[0];
    for (std::size_t l = 1; l < width; ++l) m = lanes[l] > m ? lanes[l] : m;
    return m;
  }

  /// Adds 1 to the lanes of `acc` where `m` is set.
  static void count_into(ibatch& acc, const ibool& m) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      acc = ibatch(_mm512_mask_add_epi32(static_cast<__m512i>(acc), static_cast<__mmask16>(m),
                                         static_cast<__m512i>(acc), _mm512_set1_epi32(1)));
#endif
    } else if constexpr (isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      // true = -1
      acc = ibatch(_mm256_sub_epi32(static_cast<__m256i>(acc), static_cast<__m256i>(m)));
#endif
    } else if constexpr (isa == lane_isa::sse2) {
#if STELLATRAIN_X86_INTRINSICS
      acc = ibatch(_mm_sub_epi32(static_cast<__m128i>(acc), static_cast<__m128i>(m)));
#endif
    } else {
      acc += xsimd::select(m, ibatch(1), ibatch(0));
    }
  }

  /// Writes the lanes of `a` whose bit is set in `mask`, in lane order, to `pa`; returns how
  /// many. May write up to `width` entries (room must exist).
  static std::uint32_t compress(std::uint32_t mask, const ibatch& a, std::uint32_t* pa) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      // Compress into a register, then a plain store: compress-to-memory is microcoded and
      // slow on several cores.
      _mm512_storeu_si512(
          pa, _mm512_maskz_compress_epi32(static_cast<__mmask16>(mask), static_cast<__m512i>(a)));
      return static_cast<std::uint32_t>(std::popcount(mask));
#endif
    } else if constexpr (isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(pa),
          _mm256_permutevar8x32_epi32(static_cast<__m256i>(a), avx2_compress_permutation(mask)));
      return static_cast<std::uint32_t>(std::popcount(mask));
#endif
    } else {
      alignas(64) std::int32_t la[width];
      a.store_aligned(la);
      std::uint32_t c = 0;
      if constexpr (width % 4 == 0) {
        // Branch-free per four lanes: the set lanes' positions from the permutation table,
        // four stores, the count moved on by the set bits (where lanes pass at random, a
        // branch per set bit mispredicts often).
        for (std::size_t q = 0; q < width; q += 4) {
          const std::uint32_t nibble = (mask >> q) & 15u;
          const std::uint32_t order = compress_permutation_8[nibble];
          for (std::uint32_t s = 0; s < 4; ++s) {
            pa[c + s] = static_cast<std::uint32_t>(la[q + ((order >> (3 * s)) & 7u)]);
          }
          c += static_cast<std::uint32_t>((0x4332322132212110ull >> (4 * nibble)) & 15u);
        }
      } else {
        for (; mask != 0; mask &= mask - 1)
          pa[c++] = static_cast<std::uint32_t>(la[std::countr_zero(mask)]);
      }
      return c;
    }
  }

  /// As `compress`, for two batches under one mask, into `pa` and `pb`.
  static std::uint32_t compress2(std::uint32_t mask, const ibatch& a, const ibatch& b,
                                 std::uint32_t* STELLATRAIN_RESTRICT pa,
                                 std::uint32_t* STELLATRAIN_RESTRICT pb) noexcept {
    if constexpr (isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      const auto k = static_cast<__mmask16>(mask);
      _mm512_storeu_si512(pa, _mm512_maskz_compress_epi32(k, static_cast<__m512i>(a)));
      _mm512_storeu_si512(pb, _mm512_maskz_compress_epi32(k, static_cast<__m512i>(b)));
      return static_cast<std::uint32_t>(std::popcount(mask));
#endif
    } else if constexpr (isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      const __m256i perm = avx2_compress_permutation(mask);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pa),
                          _mm256_permutevar8x32_epi32(static_cast<__m256i>(a), perm));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb),
                          _mm256_permutevar8x32_epi32(static_cast<__m256i>(b), perm));
      return static_cast<std::uint32_t>(std::popcount(mask));
#endif
    } else {
      alignas(64) std::int32_t la[width];
      alignas(64) std::int32_t lb[width];
      a.store_aligned(la);
      b.store_aligned(lb);
      std::uint32_t c = 0;
      for (; mask != 0; mask &= mask - 1) {
        const int l = std::countr_zero(mask);
        pa[c] = static_cast<std::uint32_t>(la[l]);
        pb[c] = static_cast<std::uint32_t>(lb[l]);
        ++c;
      }
      return c;
    }
  }

 private:
#if STELLATRAIN_X86_INTRINSICS
  // The lane permutation that moves the lanes set in an 8-bit mask to the front.
  static __m256i avx2_compress_permutation(std::uint32_t mask) noexcept
      requires(isa == lane_isa::avx2) {
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    return _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(compress_permutation_8[mask])),
                          shifts),
        _mm256_set1_epi32(7));
  }
#endif
};

// Whether `Arch` has SIMD lanes with a branch-free `compress` (scalar_arch has no lane_ops).
template <class Arch>
constexpr bool has_branchless_compress() noexcept {
  if constexpr (is_scalar_arch<Arch>) {
    return false;
  } else {
    return lane_ops<Arch>::branchless_compress;
  }
}

}  // namespace stellatrain::detail
