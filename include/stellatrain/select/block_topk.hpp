// SPDX-License-Identifier: Apache-2.0
// Cache-line block selection: 64-byte blocks scored by their L1 or L2 sum, whole blocks sent,
// exactly k elements, with the energy it keeps reported.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/detail/isa_compat.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/detail/candidate_workspace.hpp>
#include <stellatrain/select/detail/exact_select.hpp>
#include <stellatrain/select/detail/keys.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <xsimd/xsimd.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <type_traits>

namespace stellatrain {

/// How a block is scored.
enum class block_score : std::uint8_t {
  l1,  ///< sum of |x| (the reference's choice)
  l2,  ///< sum of x^2 (the energy the block carries)
};

/// Options of `block_topk_selector`.
struct block_topk_options {
  block_score score = block_score::l1;
  /// Tuning of the exact selection of the best blocks among the block scores.
  exact_topk_options blocks{};
};

/// What a block selection did, with the energy (sum of squares) it kept.
struct block_selection_stats : selection_stats {
  std::uint64_t blocks = 0;  ///< blocks sent, whole or truncated
  double kept_energy = 0;    ///< sum of squares of the selected values
  double total_energy = 0;   ///< sum of squares of all values
  /// kept_energy / total_energy (1 for an all-zero input).
  [[nodiscard]] double energy_fraction() const noexcept {
    return total_energy > 0 ? kept_energy / total_energy : 1.0;
  }
};

namespace detail {

/// Elements of `T` in one 64-byte cache line.
template <class T>
inline constexpr std::uint64_t block_elements = cache_line_bytes / sizeof(T);

template <bool L2>
STELLATRAIN_FORCE_INLINE float block_term(float x) noexcept {
  if constexpr (L2) {
    return x * x;
  } else {
    // |x|, as the SIMD paths
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(x) & 0x7fffffffu);
  }
}

// The score of one block in the canonical order every architecture follows (so that L1
// scores agree bit for bit): fold the block in halves, adding element l and element
// l + half, until 4 sums t0..t3 remain; the score is (t0 + t2) + (t1 + t3). Missing elements
// of a short last block count as 0.
template <bool L2, class T>
float block_score_scalar(const T* x, std::uint64_t count) noexcept {
  constexpr std::uint64_t b = block_elements<T>;
  float s[b];
  for (std::uint64_t l = 0; l < b; ++l) s[l] = l < count ? block_term<L2>(to_float(x[l])) : 0.0f;
  for (std::uint64_t half = b / 2; half >= 4; half /= 2) {
    for (std::uint64_t l = 0; l < half; ++l) s[l] = s[l] + s[l + half];
  }
  return (s[0] + s[2]) + (s[1] + s[3]);
}

template <bool L2, class Source>
float block_score_source(const Source& src, std::uint64_t begin, std::uint64_t count) noexcept {
  using T = typename Source::value_type;
  T x[block_elements<T>];
  for (std::uint64_t l = 0; l < count; ++l) x[l] = value_from_bits<T>(src.load_scalar(begin + l));
  return block_score_scalar<L2>(x, count);
}

#if STELLATRAIN_X86_INTRINSICS
// Scores of 8 float blocks given s_j = f(x[0..8)) + f(x[8..16)) of each block j: the rest of
// the canonical fold, with the 8 blocks transposed so that the adds are vertical.
STELLATRAIN_TARGET("avx2")
STELLATRAIN_FORCE_INLINE __m256 block8_fold_avx2(const __m256 (&s)[8]) noexcept {
  __m256 tt[4];
  for (int i = 0; i < 4; ++i) {
    // [t of block 2i | t of block 2i+1], t_l = s_l + s_{l+4}.
    tt[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
  }
  // 4x4 transpose inside each 128-bit lane: lane 0 holds blocks 0,2,4,6, lane 1 blocks 1,3,5,7.
  const __m256 a = _mm256_unpacklo_ps(tt[0], tt[1]);
  const __m256 b = _mm256_unpackhi_ps(tt[0], tt[1]);
  const __m256 c = _mm256_unpacklo_ps(tt[2], tt[3]);
  const __m256 d = _mm256_unpackhi_ps(tt[2], tt[3]);
  const __m256 t0 = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 t1 = _mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 t2 = _mm256_shuffle_ps(b, d, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 t3 = _mm256_shuffle_ps(b, d, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 sc = _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
  return _mm256_permutevar8x32_ps(sc, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

/// Scores the blocks of `src` into `scores` (block j covers elements [j B, j B + B), B =
/// block_elements) and returns the total energy (sum of squares). Parallel over chunks;
/// per-chunk energies go to `partial` (one per chunk) and are summed in chunk order.
template <class Arch, bool L2, class Source, executor Ex>
double score_blocks(Ex& ex, const Source& src, std::uint64_t n, float* scores, double* partial) {
  using T = typename Source::value_type;
  constexpr std::uint64_t b = block_elements<T>;
  static_assert(select_grain % (8 * b) == 0);
  for_each_chunk(ex, n, select_grain, [&](std::uint64_t begin, std::uint64_t end) {
    double energy = 0;
    std::uint64_t i = begin;
    if constexpr (std::is_same_v<T, float> && lane_ops<Arch>::isa == lane_isa::sse2) {
#if STELLATRAIN_X86_INTRINSICS
      __m128 e4 = _mm_setzero_ps();
      const __m128 sign = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
      auto term = [&](__m128 v) {
        e4 = _mm_add_ps(e4, _mm_mul_ps(v, v));
        return L2 ? _mm_mul_ps(v, v) : _mm_and_ps(v, sign);
      };
      for (; i + 4 * b <= end; i += 4 * b) {
        __m128 t[4];
        for (int j = 0; j < 4; ++j) {
          const std::uint64_t p = i + static_cast<std::uint64_t>(j) * b;
          const __m128 v0 = _mm_castsi128_ps(static_cast<__m128i>(src.template load<Arch>(p)));
          const __m128 v1 = _mm_castsi128_ps(static_cast<__m128i>(src.template load<Arch>(p + 4)));
          const __m128 v2 = _mm_castsi128_ps(static_cast<__m128i>(src.template load<Arch>(p + 8)));
          const __m128 v3 = _mm_castsi128_ps(static_cast<__m128i>(src.template load<Arch>(p + 12)));
          t[j] = _mm_add_ps(_mm_add_ps(term(v0), term(v2)), _mm_add_ps(term(v1), term(v3)));
        }
        _MM_TRANSPOSE4_PS(t[0], t[1], t[2], t[3]);
        _mm_storeu_ps(scores + i / b, _mm_add_ps(_mm_add_ps(t[0], t[2]), _mm_add_ps(t[1], t[3])));
      }
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, e4);
      energy +=
          (static_cast<double>(lanes[0]) + lanes[1]) + (static_cast<double>(lanes[2]) + lanes[3]);
#endif
    } else if constexpr (std::is_same_v<T, float> && lane_ops<Arch>::isa == lane_isa::avx512) {
#if STELLATRAIN_X86_INTRINSICS
      // Each 512-bit load is one block; its halves feed the 256-bit fold (shuffle bound).
      __m256 e8 = _mm256_setzero_ps();
      const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      auto term = [&](__m256 v) {
        e8 = _mm256_add_ps(e8, _mm256_mul_ps(v, v));
        return L2 ? _mm256_mul_ps(v, v) : _mm256_and_ps(v, sign);
      };
      for (; i + 8 * b <= end; i += 8 * b) {
        __m256 s[8];
        for (int j = 0; j < 8; ++j) {
          // Halves through memory: GCC 12 warns (falsely) inside the extract intrinsics.
          alignas(64) float lanes16[16];
          src.template load<Arch>(i + static_cast<std::uint64_t>(j) * b)
              .store_aligned(reinterpret_cast<std::int32_t*>(lanes16));
          s[j] = _mm256_add_ps(term(_mm256_load_ps(lanes16)), term(_mm256_load_ps(lanes16 + 8)));
        }
        _mm256_storeu_ps(scores + i / b, block8_fold_avx2(s));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, e8);
      for (float v : lanes) energy += v;
#endif
    } else if constexpr (std::is_same_v<T, float> && lane_ops<Arch>::isa == lane_isa::avx2) {
#if STELLATRAIN_X86_INTRINSICS
      __m256 e8 = _mm256_setzero_ps();
      const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      auto term = [&](__m256 v) {
        e8 = _mm256_add_ps(e8, _mm256_mul_ps(v, v));
        return L2 ? _mm256_mul_ps(v, v) : _mm256_and_ps(v, sign);
      };
      auto load8 = [&](std::uint64_t p) {
        return _mm256_castsi256_ps(static_cast<__m256i>(src.template load<Arch>(p)));
      };
      for (; i + 8 * b <= end; i += 8 * b) {
        __m256 s[8];
        for (int j = 0; j < 8; ++j) {
          const std::uint64_t p = i + static_cast<std::uint64_t>(j) * b;
          s[j] = _mm256_add_ps(term(load8(p)), term(load8(p + 8)));
        }
        _mm256_storeu_ps(scores + i / b, block8_fold_avx2(s));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, e8);
      for (float v : lanes) energy += v;
#endif
    }
    for (; i < end; i += b) {
      const std::uint64_t count = std::min(b, end - i);
      T x[b];
      for (std::uint64_t l = 0; l < count; ++l) {
        x[l] = value_from_bits<T>(src.load_scalar(i + l));
        const double v = to_float(x[l]);
        energy += v * v;
      }
      scores[i / b] = block_score_scalar<L2>(x, count);
    }
    partial[begin / select_grain] = energy;
  });
  double total = 0;
  for (std::uint64_t c = 0; c < chunk_count(n, select_grain); ++c) total += partial[c];
  return total;
}

/// Blocks per emission task of a block selection, at least.
inline constexpr std::uint64_t emit_group_min = 256;

/// Storage of a block selection.
struct block_workspace {
  aligned_buffer<float> scores;
  aligned_buffer<std::uint64_t> blocks;  // selected blocks, ascending
  aligned_buffer<std::uint64_t> out;     // output offset of each selected block
  aligned_buffer<double> partial;        // per chunk energy
  candidate_workspace ws;
  radix_workspace rw;

  template <executor Ex>
  void reserve(Ex& ex, std::uint64_t n, std::uint64_t k, std::uint64_t block,
               const exact_topk_options& o) {
    const buffer_options opts{.prefault = true};
    const std::uint64_t nb = (n + block - 1) / block;
    const std::uint64_t q = std::min(nb, (k + block - 1) / block + 1);
    if (nb > scores.size()) scores = aligned_buffer<float>(nb, opts, ex);
    if (q > blocks.size()) {
      blocks = aligned_buffer<std::uint64_t>(q, opts, ex);
      out = aligned_buffer<std::uint64_t>(q + 1, opts, ex);
    }
    // One partial energy per scoring chunk, and later per emission group (>= 256 blocks).
    const std::uint64_t chunks =
        std::max(chunk_count(n, select_grain), chunk_count(q, emit_group_min));
    if (chunks > partial.size()) partial = aligned_buffer<double>(chunks, opts, ex);
    ws.reserve(ex, exact_capacity(nb, q, o.min_capacity), nb, o.samples);
  }
};

/// One block selection of `src` (0 < k < n): scores, the best blocks by exact selection on
/// the scores, the partial block that makes the count exactly k, emission in index order.
template <class Arch, class Source, executor Ex, class Emit>
block_selection_stats block_select(Ex& ex, const Source& src, std::uint64_t n, std::uint64_t k,
                                   const block_topk_options& options, block_workspace& bw,
                                   Emit&& emit) {
  using T = typename Source::value_type;
  constexpr std::uint64_t b = block_elements<T>;
  bw.reserve(ex, n, k, b, options.blocks);
  const std::uint64_t nb = (n + b - 1) / b;
  const std::uint64_t last_size = n - (nb - 1) * b;
  auto size_of_block = [&](std::uint64_t j) { return j == nb - 1 ? last_size : b; };
  float* const scores = bw.scores.data();
  block_selection_stats stats;
  stats.exact = false;
  stats.passes = 1;
  stats.total_energy = options.score == block_score::l2
                           ? score_blocks<Arch, true>(ex, src, n, scores, bw.partial.data())
                           : score_blocks<Arch, false>(ex, src, n, scores, bw.partial.data());
  const auto rd = src.reread();
  std::uint64_t* const blocks = bw.blocks.data();
  auto key_of = [&](std::uint64_t j) { return raw_bits(scores[j]) & key_mask_of<float>; };

  // The q best blocks (ties to the lowest block) and the key of the q-th.
  std::uint64_t q = std::min(nb, (k + b - 1) / b);
  std::uint32_t kth = 0;
  if (q < nb) {
    const exact_tuning tuning{.samples = options.blocks.samples, .z = options.blocks.margin_sigmas};
    const select_outcome o = select_exact<Arch>(
        ex, plain_source<float>{scores}, nb, q, q, tuning, bw.ws, bw.rw,
        [&](std::uint64_t pos, std::uint64_t j, std::uint32_t) { blocks[pos] = j; });
    kth = o.kth_key;
  } else {
    kth = key_of(0);
    for (std::uint64_t j = 0; j < nb; ++j) {
      blocks[j] = j;
      kth = std::min(kth, key_of(j));
    }
  }
  std::uint64_t total = q * b - (blocks[q - 1] == nb - 1 ? b - last_size : 0);
  std::uint64_t partial_block = nb;  // the block sent truncated (nb: none)
  std::uint64_t partial_count = 0;
  if (total >= k) {
    if (total > k) {
      // Truncate the lowest-ranked selected block: key == kth, highest index among those.
      std::uint64_t j = q;
      while (key_of(blocks[j - 1]) != kth) --j;
      partial_block = blocks[j - 1];
      partial_count = size_of_block(partial_block) - (total - k);
    }
  } else {
    // The short last block is among the q: add the best block left out (lowest index on ties).
    std::uint64_t best = nb;
    std::uint64_t s = 0;
    for (std::uint64_t j = 0; j < nb; ++j) {
      if (s < q && blocks[s] == j) {
        ++s;
        continue;
      }
      if (best == nb || key_of(j) > key_of(best)) best = j;
    }
    partial_block = best;
    partial_count = k - total;
    const auto at = std::lower_bound(blocks, blocks + q, best) - blocks;
    std::copy_backward(blocks + at, blocks + q, blocks + q + 1);
    blocks[at] = best;
    ++q;
  }
  // Output offsets, then parallel emission (one cache line per block).
  std::uint64_t* const out = bw.out.data();
  out[0] = 0;
  for (std::uint64_t s = 0; s < q; ++s) {
    out[s + 1] = out[s] + (blocks[s] == partial_block ? partial_count : size_of_block(blocks[s]));
  }
  STELLATRAIN_ASSERT(out[q] == k, "block_select: selection does not hold exactly k");
  const std::uint64_t group =
      std::max<std::uint64_t>(emit_group_min, q / (4 * std::max<std::size_t>(ex.concurrency(), 1)));
  const std::uint64_t groups = chunk_count(q, group);
  double* const partial = bw.partial.data();
  for_each_chunk(ex, q, group, [&](std::uint64_t s0, std::uint64_t s1) {
    double kept = 0;
    for (std::uint64_t s = s0; s < s1; ++s) {
      const std::uint64_t first = blocks[s] * b;
      const std::uint64_t size = size_of_block(blocks[s]);
      std::uint64_t pos = out[s];
      if (blocks[s] != partial_block) {
        for (std::uint64_t l = 0; l < size; ++l) {
          const std::uint32_t v = rd.load_scalar(first + l);
          const double f = to_float(value_from_bits<T>(v));
          kept += f * f;
          emit(pos++, first + l, v);
        }
      } else {
        // The partial_count largest of the block (ties to the lowest index), in index order.
        std::array<std::uint32_t, b> bits{};
        std::array<std::uint64_t, b> order{};
        for (std::uint64_t l = 0; l < size; ++l) {
          bits[l] = rd.load_scalar(first + l);
          order[l] = l;
        }
        std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(size),
                  [&](std::uint64_t x, std::uint64_t y) {
                    const std::uint32_t kx = bits[x] & key_mask_of<T>;
                    const std::uint32_t ky = bits[y] & key_mask_of<T>;
                    return kx != ky ? kx > ky : x < y;
                  });
        std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(partial_count));
        for (std::uint64_t r = 0; r < partial_count; ++r) {
          const double f = to_float(value_from_bits<T>(bits[order[r]]));
          kept += f * f;
          emit(pos++, first + order[r], bits[order[r]]);
        }
      }
    }
    partial[s0 / group] = kept;
  });
  for (std::uint64_t g = 0; g < groups; ++g) stats.kept_energy += partial[g];
  stats.count = k;
  stats.blocks = q;
  return stats;
}

}  // namespace detail

/// Cache-line block selection: the tensor is cut into 64-byte blocks (16 fp32 or 32
/// fp16/bf16 elements, block j = elements [j B, (j + 1) B) of the span; they are cache lines
/// when the span starts on a 64-byte boundary), each scored by the L1 or L2 sum of its
/// elements; the best-scoring blocks are sent whole, which keeps the selection in whole
/// cache lines for packing and for the sparse optimizer.
///
/// Exactly min(k, n) elements: the ceil(k / B) best blocks (ties to the lowest block), with
/// the lowest-ranked of them truncated to its largest elements (ties to the lowest index) so
/// that the count is exactly k; a short last block (n not a multiple of B) scores only its
/// elements, and when it is among the best and the count falls short, the next best block
/// contributes its largest elements. Indices ascending, values copied.
///
/// It is a trade-off to choose knowingly: on i.i.d. gradients whole blocks keep far less of
/// the energy than element-wise top-k (the reference measured 25% at 1% density), on
/// row-correlated gradients much more (76%). Every call reports `kept_energy` and
/// `total_energy` (sums of squares) so a caller can watch it.
///
/// L1 scores are summed in one canonical order on every architecture (identical results);
/// L2 scores multiply, and a compiler that contracts multiply-adds (FMA) may round them
/// differently on different builds. Cost: one streaming read to score (SIMD), exact top-k on
/// n / B scores (small), one cache line read per selected block.
template <class Arch = xsimd::default_arch>
class block_topk_selector {
 public:
  using arch_type = Arch;
  /// Nothing is kept from call to call.
  struct tensor_state {};
  /// Block scores, the chosen blocks and the exact selection's scratch.
  using workspace = detail::block_workspace;

  block_topk_selector() = default;
  explicit block_topk_selector(block_topk_options options) : options_(options) {}

  [[nodiscard]] const block_topk_options& options() const noexcept { return options_; }

  /// Allocates (pre-faulting across `ex`) what calls with up to `n` elements of `T` and `k` need.
  template <value_type T = float, executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    ws.reserve(ex, n, k, detail::block_elements<T>, options_.blocks);
  }
  template <value_type T = float, executor Ex>
  void reserve(Ex& ex, std::uint64_t n, std::uint64_t k) {
    reserve<T>(ex, bw_.get(), n, k);
  }

  /// One selection from `src` (see the `selector` concept).
  template <executor Ex, class Source, class Emit>
  block_selection_stats select_from(Ex& ex, tensor_state&, workspace& ws, const Source& src,
                                    std::uint64_t n, std::uint64_t k, const selection_context&,
                                    Emit&& emit) const {
    [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
    if (k > 0 && k < n) return detail::block_select<Arch>(ex, src, n, k, options_, ws, emit);
    block_selection_stats all;
    const auto trivial = detail::select_trivial<Arch>(ex, src, n, k, emit);
    static_cast<selection_stats&>(all) = *trivial;
    if (k == 0) return all;
    const auto rd = src.reread();
    using T = typename Source::value_type;
    for (std::uint64_t i = 0; i < n; ++i) {
      const float v = to_float(detail::value_from_bits<T>(rd.load_scalar(i)));
      all.total_energy += static_cast<double>(v) * v;
    }
    all.kept_energy = all.total_energy;
    all.blocks = (n + detail::block_elements<T> - 1) / detail::block_elements<T>;
    return all;
  }

  /// Writes min(k, n) elements of `x` to the front of `indices` and `values` (indices
  /// ascending, offset by `index_base`). Errors as `exact_topk_selector::select`.
  template <executor Ex, value_type T, index_type Index>
  block_selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                               std::span<Index> indices, std::span<T> values,
                               std::uint64_t index_base = 0) {
    const std::uint64_t n = x.size();
    detail::check_selection_args<Index>("block_topk_selector::select", n, k, indices.size(),
                                        values.size(), index_base);
    if (k == 0 || n == 0) return {};
    [[maybe_unused]] const auto awake = stay_awake(ex);  // several bulk calls follow
    if (k >= n) {
      detail::select_all(ex, x, indices, values, index_base);
      block_selection_stats all;
      all.count = n;
      all.passes = 1;
      all.blocks = (n + detail::block_elements<T> - 1) / detail::block_elements<T>;
      for (const T& v : x) all.total_energy += static_cast<double>(to_float(v)) * to_float(v);
      all.kept_energy = all.total_energy;
      return all;
    }
    auto emit = [&](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
      indices[pos] = static_cast<Index>(index_base + i);
      values[pos] = detail::value_from_bits<T>(bits);
    };
    tensor_state none;
    return select_from(ex, none, bw_.get(), plain_source<T>{x.data()}, n, k, {}, emit);
  }

  /// As above, into `out` (resized to min(k, n); its capacity grows if too small).
  template <executor Ex, value_type T, index_type Index>
  block_selection_stats select(Ex& ex, std::type_identity_t<std::span<const T>> x, std::uint64_t k,
                               sparse_buffer<T, Index>& out, std::uint64_t index_base = 0) {
    detail::resize_for_selection(out, x.size(), k);
    return select(ex, x, k, out.indices(), out.values(), index_base);
  }

 private:
  block_topk_options options_{};
  detail::copy_fresh<workspace> bw_;
};

static_assert(selector<block_topk_selector<>>);

}  // namespace stellatrain
