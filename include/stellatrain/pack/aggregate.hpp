// SPDX-License-Identifier: Apache-2.0
// Sums the sparse selections of W ranks for one tensor: a k-way merge into a sorted sparse
// result, or a scatter-add into a dense buffer when the union is dense, chosen by a rule.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#if defined(__SSE2__) || defined(__AVX2__) || defined(__BMI2__)
#include <immintrin.h>
#endif

namespace stellatrain {

/// How the inputs are combined.
enum class reduction : std::uint8_t {
  sum,   ///< the sum over inputs
  mean,  ///< the sum divided by the number of inputs (every input counts, also where it is 0)
};

/// Which result `aggregate` produced.
enum class aggregate_kind : std::uint8_t {
  sparse,  ///< sorted (index, value) pairs in the sparse output
  dense,   ///< every element in the dense output
};

/// Options of `sparse_merger::aggregate`.
struct aggregate_options {
  reduction op = reduction::sum;
  /// Scatter into the dense output when the inputs hold at least this many pairs per tensor
  /// element (sum of input sizes / tensor size), else merge. See `choose_aggregate`.
  double dense_threshold = 0.25;
};

/// The rule of `aggregate`: dense when `pairs >= dense_threshold * dense_size` (pairs = sum of
/// the input sizes, an upper bound of the union), sparse otherwise.
///
/// Why 0.25: the merge costs about as much per input pair as the scatter-add, which also writes
/// and later hands over all n elements (4n bytes against 8 bytes per merged pair); measured on
/// 25M-element tensors the two meet at roughly 20-30% (bench_pack: BM_pack_merge vs
/// BM_pack_scatter_add). Past that, the optimizer's dense step is also as fast as its sparse one.
[[nodiscard]] constexpr aggregate_kind choose_aggregate(std::uint64_t pairs, std::uint64_t dense_size,
                                                        double dense_threshold) noexcept {
  return static_cast<double>(pairs) >= dense_threshold * static_cast<double>(dense_size) ? aggregate_kind::dense
                                                                                        : aggregate_kind::sparse;
}

namespace detail {

// Indices per merge window: its masks (2 KiB) and counts (1 KiB) stay in L1.
inline constexpr std::uint64_t merge_window = 16384;
// Elements per dense scatter piece (256 KiB of floats: L2-resident while the inputs stream).
inline constexpr std::uint64_t scatter_piece = std::uint64_t{1} << 16;

template <class V>
STELLATRAIN_FORCE_INLINE float value_as_float(V v) noexcept {
  return to_float(v);
}

// The bits of m below bit i (i < 64): one BMI2 instruction where available.
STELLATRAIN_FORCE_INLINE std::uint64_t below_bit(std::uint64_t m, std::uint32_t i) noexcept {
#if defined(__BMI2__)
  return _bzhi_u64(m, i);
#else
  return m & ((std::uint64_t{1} << i) - 1);
#endif
}

// Merges the parts [heads[w], end[w]) of every input into out (sorted, duplicates summed,
// times `scale`); returns how many pairs it wrote. The index range is walked in windows of
// merge_window indices. Per window, pass 1 sets one bit per offset the inputs touch; a running
// count of the bits per 64 offsets (over the touched words only, when the window holds few
// pairs) makes every offset's rank in the window's union a popcount; pass 2 writes each pair
// to its rank and adds its value there. No comparisons between inputs, no data-dependent
// branches per pair, and the window's state (2 KiB of bits, 1 KiB of counts) stays in L1.
// (Measured on 4 x 250K pairs in 25M indices: 15-20% faster than byte marks turned into words
// through a summary walk over windows of 4096 indices.) Throws if an input steps below the
// current window (not sorted) or the result reaches the tensor size.
template <class V, class I>
std::uint64_t merge_part(std::span<const sparse_view<const V, const I>> inputs, std::uint64_t* heads,
                         const std::uint64_t* end, std::uint64_t* stops, std::uint64_t dense_size, float scale,
                         I* out_idx, float* out_val) {
  constexpr std::uint64_t words = merge_window / 64;
  alignas(64) std::uint64_t masks[words];
  std::uint32_t before[words];
  std::memset(masks, 0, sizeof masks);
  const std::size_t w_count = inputs.size();
  std::uint64_t written = 0;
  for (;;) {
    std::uint64_t lowest = std::numeric_limits<std::uint64_t>::max();
    bool any = false;
    for (std::size_t w = 0; w < w_count; ++w) {
      if (heads[w] < end[w]) {
        any = true;
        lowest = std::min<std::uint64_t>(lowest, inputs[w].indices()[heads[w]]);
      }
    }
    if (!any) break;
    const std::uint64_t base = lowest & ~(merge_window - 1);
    const std::uint64_t limit = base + merge_window;
    std::uint64_t spread = 0;  // OR of the offsets: >= merge_window iff one lies outside
    for (std::size_t w = 0; w < w_count; ++w) {
      const I* idx = inputs[w].indices().data();
      std::uint64_t h = heads[w];
      const std::uint64_t e = end[w];
      for (; h < e; ++h) {
        const std::uint64_t x = idx[h];
        if (x >= limit) break;
        const std::uint64_t off = x - base;
        spread |= off;
        const std::uint64_t o = off & (merge_window - 1);
        masks[o >> 6] |= std::uint64_t{1} << (o & 63);
      }
      stops[w] = h;
    }
    if (spread >= merge_window) [[unlikely]] {
      throw_error(errc::invalid_argument, "merge: an input is not sorted: an index lies below one before it");
    }
    // The running counts: over every word when the window holds many pairs; over the words
    // its pairs touch (found by walking them again) when it holds few, so that a sparse
    // merge does not pay for the whole window.
    std::uint64_t pairs = 0;
    for (std::size_t w = 0; w < w_count; ++w) pairs += stops[w] - heads[w];
    const bool sparse = pairs < words / 8;
    std::uint64_t touched[words / 64] = {};  // bit q: word q holds a pair (sparse windows)
    auto for_each_touched = [&](auto&& fn) {
      for (std::uint64_t t = 0; t < words / 64; ++t) {
        for (std::uint64_t bits = touched[t]; bits != 0; bits &= bits - 1) {
          fn(64 * t + static_cast<std::uint64_t>(std::countr_zero(bits)));
        }
      }
    };
    std::uint32_t count = 0;
    if (sparse) {
      for (std::size_t w = 0; w < w_count; ++w) {
        const I* idx = inputs[w].indices().data();
        for (std::uint64_t h = heads[w]; h < stops[w]; ++h) {
          const std::uint64_t q = ((static_cast<std::uint64_t>(idx[h]) - base) & (merge_window - 1)) >> 6;
          touched[q >> 6] |= std::uint64_t{1} << (q & 63);
        }
      }
      for_each_touched([&](std::uint64_t q) {
        before[q] = count;
        count += static_cast<std::uint32_t>(std::popcount(masks[q]));
      });
    } else {
      for (std::uint64_t q = 0; q < words; ++q) {
        before[q] = count;
        count += static_cast<std::uint32_t>(std::popcount(masks[q]));
      }
    }
    I* oi = out_idx + written;
    float* ov = out_val + written;
    std::fill(ov, ov + count, -0.0f);  // -0 + x == x for every x, so one input is copied exactly
    for (std::size_t w = 0; w < w_count; ++w) {
      const I* idx = inputs[w].indices().data();
      const V* val = inputs[w].values().data();
      const std::uint64_t stop = stops[w];  // a local: the stores below may alias stops[]
      for (std::uint64_t h = heads[w]; h < stop; ++h) {
        const I x = idx[h];
        const std::uint32_t o = static_cast<std::uint32_t>(static_cast<std::uint64_t>(x) - base) &
                                static_cast<std::uint32_t>(merge_window - 1);
        const std::uint32_t q = o >> 6;
        const std::uint32_t rank = before[q] + static_cast<std::uint32_t>(std::popcount(below_bit(masks[q], o & 63)));
        oi[rank] = x;
        ov[rank] += value_as_float(val[h]);
      }
      heads[w] = stops[w];
    }
    if (sparse) {
      for_each_touched([&](std::uint64_t q) { masks[q] = 0; });
    } else {
      std::memset(masks, 0, sizeof masks);
    }
    if (scale != 1.0f) {
      for (std::uint32_t j = 0; j < count; ++j) ov[j] *= scale;
    }
    written += count;
    if (limit > dense_size && static_cast<std::uint64_t>(oi[count - 1]) >= dense_size) [[unlikely]] {
      throw_error(errc::out_of_range, "merge: index " + std::to_string(oi[count - 1]) +
                                          " is not below the tensor size " + std::to_string(dense_size));
    }
  }
  return written;
}

}  // namespace detail

/// Sums W sparse selections of one tensor (W ranks' gradients) into what the optimizer
/// consumes; keeps its tables between calls so that, once warm, it allocates nothing.
///
/// Inputs: views of the same dense size, each with ascending indices (an index that repeats
/// within one input is summed like one from another input). Values are float, fp16 or bf16 and
/// are summed in float, in input order (so the result does not depend on the thread count).
///
/// - `merge`: a k-way merge into `out` (sorted, strictly ascending, duplicates summed). The
///   index range is cut into windows of 16384 indices; in each, the union of the inputs is marked
///   in L1 and every pair written straight to its rank, so the cost is linear in the input pairs
///   (not in the tensor size, and not times log W). Threaded: the range is split at quantiles
///   of the largest input.
/// - `scatter_add`: writes every element of `dense` (zero where no input has a pair).
/// - `aggregate`: `choose_aggregate` picks one of the two.
///
/// \code
///   stellatrain::sparse_merger merger;
///   std::vector<stellatrain::sparse_view<const float, const std::uint32_t>> ranks = {...};
///   stellatrain::sparse_buffer<float> sum(n, stellatrain::merge_capacity<float, std::uint32_t>(ranks));
///   merger.merge<float, std::uint32_t>(ranks, sum, stellatrain::reduction::mean, pool);
/// \endcode
class sparse_merger {
 public:
  /// Merges `inputs` into `out` (capacity at least the sum of the input sizes; see
  /// `merge_capacity`). Throws `invalid_argument` for dense sizes that differ, an unsorted
  /// input or a small `out`, and `out_of_range` for an index not below the dense size.
  template <class V, class I, executor Executor>
  void merge(std::span<const sparse_view<const V, const I>> inputs, sparse_buffer<float, I>& out, reduction op,
             Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    std::uint64_t total = 0;
    std::size_t largest = 0;
    for (std::size_t w = 0; w < inputs.size(); ++w) {
      total += inputs[w].size();
      if (inputs[w].size() > inputs[largest].size()) largest = w;
    }
    if (out.capacity() < total) {
      throw_error(errc::invalid_argument, "merge: output capacity " + std::to_string(out.capacity()) +
                                              " is below the " + std::to_string(total) + " input pairs");
    }
    out.set_dense_size(n);
    out.resize(0);
    if (total == 0) return;
    const float scale = scale_of(op, inputs.size());
    const std::size_t w_count = inputs.size();
    // Parts: about 4 per thread, at least 32768 pairs each.
    const std::uint64_t parts = std::clamp<std::uint64_t>(
        std::min<std::uint64_t>(ex.concurrency() * 4, total / 32768), 1, 256);
    starts_.assign((parts + 1) * w_count, 0);
    for (std::size_t w = 0; w < w_count; ++w) starts_[parts * w_count + w] = inputs[w].size();
    const auto big = inputs[largest].indices();
    for (std::uint64_t p = 1; p < parts; ++p) {
      // A split point on a window boundary, so that no window is shared by two parts.
      const std::uint64_t at = static_cast<std::uint64_t>(big[p * big.size() / parts]) & ~(detail::merge_window - 1);
      for (std::size_t w = 0; w < w_count; ++w) {
        const auto idx = inputs[w].indices();
        const auto pos = std::lower_bound(idx.begin(), idx.end(), at) - idx.begin();
        starts_[p * w_count + w] = std::max<std::uint64_t>(starts_[(p - 1) * w_count + w], static_cast<std::uint64_t>(pos));
      }
    }
    heads_ = starts_;
    stops_.assign(parts * w_count, 0);
    counts_.assign(parts, 0);
    offsets_.assign(parts, 0);
    for (std::uint64_t p = 0; p < parts; ++p) {
      for (std::size_t w = 0; w < w_count; ++w) offsets_[p] += starts_[p * w_count + w];
    }
    out.resize(total);
    I* oi = out.indices().data();
    float* ov = out.values().data();
    ex.bulk(static_cast<std::size_t>(parts), [&](std::size_t p) {
      counts_[p] = detail::merge_part<V, I>(inputs, heads_.data() + p * w_count, starts_.data() + (p + 1) * w_count,
                                            stops_.data() + p * w_count, n, scale, oi + offsets_[p], ov + offsets_[p]);
    });
    // Close the gaps between the parts (each part wrote at an upper bound of its start).
    std::uint64_t size = counts_[0];
    for (std::uint64_t p = 1; p < parts; ++p) {
      if (offsets_[p] != size) {
        std::memmove(oi + size, oi + offsets_[p], static_cast<std::size_t>(counts_[p]) * sizeof(I));
        std::memmove(ov + size, ov + offsets_[p], static_cast<std::size_t>(counts_[p]) * sizeof(float));
      }
      size += counts_[p];
    }
    out.resize(size);
  }

  /// Writes the reduction of `inputs` to every element of `dense` (its size must equal the
  /// inputs' dense size). Threaded over pieces of 65536 elements, each zeroed, summed into and
  /// scaled while it is in cache.
  template <class V, class I, executor Executor>
  void scatter_add(std::span<const sparse_view<const V, const I>> inputs, std::span<float> dense, reduction op,
                   Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    if (dense.size() != n) {
      throw_error(errc::invalid_argument, "scatter_add: dense output of " + std::to_string(dense.size()) +
                                              " elements for tensors of " + std::to_string(n));
    }
    const float scale = scale_of(op, inputs.size());
    const std::uint64_t pieces = (n + detail::scatter_piece - 1) / detail::scatter_piece;
    ex.bulk(static_cast<std::size_t>(pieces), [&](std::size_t p) {
      const std::uint64_t lo = p * detail::scatter_piece;
      const std::uint64_t hi = std::min(n, lo + detail::scatter_piece);
      float* d = dense.data();
      std::fill(d + lo, d + hi, 0.0f);
      for (std::size_t w = 0; w < inputs.size(); ++w) {
        const auto idx = inputs[w].indices();
        const auto val = inputs[w].values();
        auto first = std::lower_bound(idx.begin(), idx.end(), lo) - idx.begin();
        const auto last = std::lower_bound(idx.begin() + first, idx.end(), hi) - idx.begin();
        bool outside = false;
        for (auto j = first; j < last; ++j) {
          const std::uint64_t x = idx[static_cast<std::size_t>(j)];
          outside |= (x - lo) >= (hi - lo);  // also catches x < lo (wraps)
          d[lo + ((x - lo) & (detail::scatter_piece - 1))] += detail::value_as_float(val[static_cast<std::size_t>(j)]);
        }
        if (outside) [[unlikely]] {
          throw_error(errc::invalid_argument, "scatter_add: input " + std::to_string(w) + " is not sorted");
        }
      }
      if (scale != 1.0f) {
        for (std::uint64_t i = lo; i < hi; ++i) d[i] *= scale;
      }
    });
    for (std::size_t w = 0; w < inputs.size(); ++w) {
      const auto idx = inputs[w].indices();
      if (!idx.empty() && static_cast<std::uint64_t>(idx.back()) >= n) {
        throw_error(errc::out_of_range, "scatter_add: input " + std::to_string(w) + ": index " +
                                            std::to_string(idx.back()) + " is not below the tensor size " +
                                            std::to_string(n));
      }
    }
  }

  /// Merges or scatters by `choose_aggregate(sum of input sizes, dense size,
  /// options.dense_threshold)`; a `dense` output of size 0 means "always merge". Returns what it
  /// did.
  template <class V, class I, executor Executor>
  aggregate_kind aggregate(std::span<const sparse_view<const V, const I>> inputs, sparse_buffer<float, I>& sparse_out,
                           std::span<float> dense_out, const aggregate_options& options, Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    std::uint64_t total = 0;
    for (const auto& in : inputs) total += in.size();
    if (!dense_out.empty() && choose_aggregate(total, n, options.dense_threshold) == aggregate_kind::dense) {
      scatter_add(inputs, dense_out, options.op, ex);
      return aggregate_kind::dense;
    }
    merge(inputs, sparse_out, options.op, ex);
    return aggregate_kind::sparse;
  }

 private:
  template <class V, class I>
  static std::uint64_t common_dense_size(std::span<const sparse_view<const V, const I>> inputs) {
    if (inputs.empty()) throw_error(errc::invalid_argument, "aggregate: no inputs");
    const std::uint64_t n = inputs[0].dense_size();
    for (std::size_t w = 1; w < inputs.size(); ++w) {
      if (inputs[w].dense_size() != n) {
        throw_error(errc::invalid_argument, "aggregate: input " + std::to_string(w) + " has dense size " +
                                                std::to_string(inputs[w].dense_size()) + ", input 0 has " +
                                                std::to_string(n));
      }
    }
    return n;
  }

  static float scale_of(reduction op, std::size_t inputs) noexcept {
    return op == reduction::mean ? 1.0f / static_cast<float>(inputs) : 1.0f;
  }

  std::vector<std::uint64_t> starts_;
  std::vector<std::uint64_t> heads_;
  std::vector<std::uint64_t> stops_;
  std::vector<std::uint64_t> counts_;
  std::vector<std::uint64_t> offsets_;
};

/// Capacity a `merge` output needs: the sum of the input sizes.
template <class V, class I>
[[nodiscard]] std::uint64_t merge_capacity(std::span<const sparse_view<const V, const I>> inputs) noexcept {
  std::uint64_t total = 0;
  for (const auto& in : inputs) total += in.size();
  return total;
}

}  // namespace stellatrain
