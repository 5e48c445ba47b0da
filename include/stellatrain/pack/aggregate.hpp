// SPDX-License-Identifier: Apache-2.0
// Sums the sparse selections of W ranks for one tensor: a k-way merge into a sorted sparse
// result, or a scatter-add into a dense buffer when the union is dense, chosen by a rule.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/cpu_relax.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/detail/merge_windows.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

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
[[nodiscard]] constexpr aggregate_kind choose_aggregate(std::uint64_t pairs,
                                                        std::uint64_t dense_size,
                                                        double dense_threshold) noexcept {
  return static_cast<double>(pairs) >= dense_threshold * static_cast<double>(dense_size)
             ? aggregate_kind::dense
             : aggregate_kind::sparse;
}

namespace detail {

// Pairs per merge chunk, the unit the threads claim in order.
inline constexpr std::uint64_t merge_chunk_pairs = 16384;
inline constexpr std::uint64_t merge_max_chunks = 4096;
// Windows a task marks ahead (about 100 KiB of marks, in L2): a chunk spanning more writes the
// rest in place and publishes its end only after that.
inline constexpr std::size_t merge_marked_windows = 32;
// Elements per dense scatter piece (256 KiB of floats: L2-resident while the inputs stream).
inline constexpr std::uint64_t scatter_piece = std::uint64_t{1} << 16;

// d[lo, hi) *= s. In blocks of 16 independent products: at -O2 GCC's loop vectorizer leaves
// the plain loop scalar (one store a cycle: 7 ms for 25M floats), while its SLP vectorizer
// turns a block into SIMD instructions.
inline void scale_range(float* d, std::uint64_t lo, std::uint64_t hi, float s) noexcept {
  std::uint64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    float* p = d + i;
    for (int u = 0; u < 16; ++u) p[u] *= s;
  }
  for (; i < hi; ++i) d[i] *= s;
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
///   (not in the tensor size, and not times log W). Threaded: the range is cut into chunks of
///   about 16384 pairs at quantiles of the largest input, which the threads claim in order. A
///   thread first marks a chunk's windows (which counts its pairs) and then writes them at
///   their final place, so nothing is moved afterwards and a chunk waits only until the chunks
///   before it are counted, not written.
/// - `scatter_add`: writes every element of `dense` (zero where no input has a pair).
/// - `aggregate`: `choose_aggregate` picks one of the two.
///
/// \code
///   stellatrain::sparse_merger merger;
///   std::vector<stellatrain::sparse_view<const float, const std::uint32_t>> ranks = {...};
///   stellatrain::sparse_buffer<float> sum(n, stellatrain::merge_capacity<float,
///   std::uint32_t>(ranks)); merger.merge<float, std::uint32_t>(ranks, sum,
///   stellatrain::reduction::mean, pool);
/// \endcode
class sparse_merger {
 public:
  /// Merges `inputs` into `out` (capacity at least the sum of the input sizes; see
  /// `merge_capacity`). Throws `invalid_argument` for dense sizes that differ, an unsorted
  /// input or a small `out`, and `out_of_range` for an index not below the dense size.
  template <class V, class I, executor Executor>
  void merge(std::span<const sparse_view<const V, const I>> inputs, sparse_buffer<float, I>& out,
             reduction op, Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    std::uint64_t total = 0;
    std::size_t largest = 0;
    std::uint64_t first = std::numeric_limits<std::uint64_t>::max();
    std::uint64_t last = 0;
    for (std::size_t w = 0; w < inputs.size(); ++w) {
      const auto idx = inputs[w].indices();
      total += idx.size();
      if (idx.size() > inputs[largest].size()) largest = w;
      if (!idx.empty()) {
        first = std::min<std::uint64_t>(first, idx.front());
        last = std::max<std::uint64_t>(last, idx.back());
      }
    }
    if (out.capacity() < total) {
      throw_error(errc::invalid_argument, "merge: output capacity " +
                                              std::to_string(out.capacity()) + " is below the " +
                                              std::to_string(total) + " input pairs");
    }
    out.set_dense_size(n);
    out.resize(0);
    if (total == 0) return;
    const float scale = scale_of(op, inputs.size());
    const std::size_t w_count = inputs.size();
    constexpr std::size_t marked = detail::merge_marked_windows;
    // Chunks of about merge_chunk_pairs pairs that span about half as many windows as a task
    // marks ahead; one chunk (no threads) for a small merge or a single-threaded executor.
    std::uint64_t chunks = 1;
    if (ex.concurrency() >= 2 && total >= 2 * detail::merge_chunk_pairs) {
      const std::uint64_t windows = last >= first ? (last - first) / detail::merge_window + 1 : 1;
      chunks = std::clamp<std::uint64_t>(
          std::max(total / detail::merge_chunk_pairs, windows / (marked / 2)), 2,
          detail::merge_max_chunks);
    }
    split_chunks(inputs, largest, chunks);
    const std::size_t tasks =
        static_cast<std::size_t>(std::min<std::uint64_t>(ex.concurrency(), chunks));
    const std::size_t mark_slots = chunks == 1 ? 1 : tasks * marked;
    if (marks_.size() < mark_slots) marks_.resize(mark_slots);
    const std::size_t cut_rows = marked + 2;
    cuts_.resize(tasks * cut_rows * w_count);
    out.resize(total);
    I* const oi = out.indices().data();
    float* const ov = out.values().data();
    if (chunks == 1) {
      // starts_'s first row serves as the heads (it ends equal to the second).
      out.resize(detail::merge_windows<V, I>(inputs, starts_.data(), starts_.data() + w_count,
                                             cuts_.data(), n, scale, marks_[0], oi, ov));
      return;
    }
    // Every chunk is written at its final place, which is known once the chunks before it have
    // counted their pairs: ready_[c] is where chunk c starts (or not_ready, or failed). A task
    // marks the windows of its chunk (counting them), waits for the chunk's start, publishes the
    // next chunk's start and then writes. Tasks claim chunks in order, so a chunk waits only
    // for chunks that are being marked. A chunk spanning more windows than a task marks ahead
    // writes what it marked and the rest in place, and publishes at its end.
    if (ready_size_ < chunks + 1) {
      ready_ = std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(chunks + 1));
      ready_size_ = chunks + 1;
    }
    ready_[0].store(0, std::memory_order_relaxed);
    for (std::uint64_t c = 1; c <= chunks; ++c)
      ready_[c].store(not_ready, std::memory_order_relaxed);
    std::atomic<std::uint64_t> next{0};
    ex.bulk(tasks, [&](std::size_t t) {
      detail::merge_marks* const marks = marks_.data() + t * marked;
      std::uint64_t* const cut = cuts_.data() + t * cut_rows * w_count;
      // On an error here or in a chunk before: zero the marks (clearing a clear window does no
      // harm) and release the chunks after this one.
      auto give_up = [&](std::uint64_t c) {
        for (std::size_t k = 0; k < marked; ++k) marks[k].clear();
        ready_[c + 1].store(failed, std::memory_order_release);
      };
      for (std::uint64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        try {
          if (!merge_chunk<V, I>(inputs, c, marks, cut, n, scale, oi, ov)) give_up(c);
        } catch (...) {
          give_up(c);
          throw;
        }
      }
    });
    out.resize(ready_[chunks].load(std::memory_order_acquire));
  }

  /// Writes the reduction of `inputs` to every element of `dense` (its size must equal the
  /// inputs' dense size). Threaded over pieces of 65536 elements, each zeroed, summed into and
  /// scaled while it is in cache.
  template <class V, class I, executor Executor>
  void scatter_add(std::span<const sparse_view<const V, const I>> inputs, std::span<float> dense,
                   reduction op, Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    if (dense.size() != n) {
      throw_error(errc::invalid_argument, "scatter_add: dense output of " +
                                              std::to_string(dense.size()) +
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
          d[lo + ((x - lo) & (detail::scatter_piece - 1))] +=
              detail::value_as_float(val[static_cast<std::size_t>(j)]);
        }
        if (outside) [[unlikely]] {
          throw_error(errc::invalid_argument,
                      "scatter_add: input " + std::to_string(w) + " is not sorted");
        }
      }
      if (scale != 1.0f) detail::scale_range(d, lo, hi, scale);
    });
    for (std::size_t w = 0; w < inputs.size(); ++w) {
      const auto idx = inputs[w].indices();
      if (!idx.empty() && static_cast<std::uint64_t>(idx.back()) >= n) {
        throw_error(errc::out_of_range, "scatter_add: input " + std::to_string(w) + ": index " +
                                            std::to_string(idx.back()) +
                                            " is not below the tensor size " + std::to_string(n));
      }
    }
  }

  /// Merges or scatters by `choose_aggregate(sum of input sizes, dense size,
  /// options.dense_threshold)`; a `dense` output of size 0 means "always merge". Returns what it
  /// did.
  template <class V, class I, executor Executor>
  aggregate_kind aggregate(std::span<const sparse_view<const V, const I>> inputs,
                           sparse_buffer<float, I>& sparse_out, std::span<float> dense_out,
                           const aggregate_options& options, Executor& ex) {
    const std::uint64_t n = common_dense_size(inputs);
    std::uint64_t total = 0;
    for (const auto& in : inputs) total += in.size();
    if (!dense_out.empty() &&
        choose_aggregate(total, n, options.dense_threshold) == aggregate_kind::dense) {
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
        throw_error(errc::invalid_argument, "aggregate: input " + std::to_string(w) +
                                                " has dense size " +
                                                std::to_string(inputs[w].dense_size()) +
                                                ", input 0 has " + std::to_string(n));
      }
    }
    return n;
  }

  static float scale_of(reduction op, std::size_t inputs) noexcept {
    return op == reduction::mean ? 1.0f / static_cast<float>(inputs) : 1.0f;
  }

  static constexpr std::uint64_t not_ready = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::uint64_t failed = not_ready - 1;

  // Cuts the inputs into `chunks` chunks at quantiles of the largest input, on window
  // boundaries (no window is shared by two chunks): starts_[c * W + w] is where input w's part
  // of chunk c begins. (Unsorted inputs need no check here: whatever lower_bound returns, the
  // pair before a cut is below it and the pair at the cut is not, so a pair out of order lies
  // inside a chunk, where mark_window finds it.)
  template <class V, class I>
  void split_chunks(std::span<const sparse_view<const V, const I>> inputs, std::size_t largest,
                    std::uint64_t chunks) {
    const std::size_t w_count = inputs.size();
    starts_.assign((chunks + 1) * w_count, 0);
    for (std::size_t w = 0; w < w_count; ++w) starts_[chunks * w_count + w] = inputs[w].size();
    const auto big = inputs[largest].indices();
    for (std::uint64_t c = 1; c < chunks; ++c) {
      const std::uint64_t at =
          static_cast<std::uint64_t>(big[c * big.size() / chunks]) & ~(detail::merge_window - 1);
      for (std::size_t w = 0; w < w_count; ++w) {
        const auto idx = inputs[w].indices();
        const auto from = idx.begin() + static_cast<std::ptrdiff_t>(starts_[(c - 1) * w_count + w]);
        const auto pos =
            static_cast<std::uint64_t>(std::lower_bound(from, idx.end(), at) - idx.begin());
        starts_[c * w_count + w] = pos;
      }
    }
  }

  // Merges chunk c (see `merge`): marks its windows into `marks` (up to merge_marked_windows;
  // row j of `cut` is where window j starts), waits for the chunk's start, publishes its end and
  // writes the marked windows there; a chunk with more windows merges the rest in place and
  // publishes its end after them. Returns false, writing nothing, if a chunk before it failed.
  template <class V, class I>
  bool merge_chunk(std::span<const sparse_view<const V, const I>> inputs, std::uint64_t c,
                   detail::merge_marks* marks, std::uint64_t* cut, std::uint64_t n, float scale,
                   I* oi, float* ov) {
    const std::size_t w_count = inputs.size();
    const std::uint64_t* const end = starts_.data() + (c + 1) * w_count;
    std::copy(end - w_count, end, cut);
    std::size_t j = 0;
    std::uint64_t count = 0;
    while (j < detail::merge_marked_windows &&
           detail::mark_window<V, I>(inputs, cut + j * w_count, end, cut + (j + 1) * w_count, n,
                                     marks[j])) {
      count += marks[j++].count;
    }
    const bool whole =
        std::equal(cut + j * w_count, cut + (j + 1) * w_count, end);  // nothing left to mark
    const std::uint64_t at = wait_ready(c);
    if (at == failed) return false;
    if (whole) ready_[c + 1].store(at + count, std::memory_order_release);
    std::uint64_t written = 0;
    for (std::size_t k = 0; k < j; ++k) {
      detail::write_window<V, I>(inputs, cut + k * w_count, cut + (k + 1) * w_count, scale,
                                 marks[k], oi + at + written, ov + at + written);
      written += marks[k].count;
    }
    if (!whole) {
      written +=
          detail::merge_windows<V, I>(inputs, cut + j * w_count, end, cut + (j + 1) * w_count, n,
                                      scale, marks[0], oi + at + written, ov + at + written);
      ready_[c + 1].store(at + written, std::memory_order_release);
    }
    return true;
  }

  // Where chunk c starts, once the chunks before it have counted (or `failed`): polls, then
  // yields the core, so that a thread merging an earlier chunk gets it on a busy machine.
  [[nodiscard]] std::uint64_t wait_ready(std::uint64_t c) const noexcept {
    for (std::uint32_t polls = 0;; ++polls) {
      const std::uint64_t at = ready_[c].load(std::memory_order_acquire);
      if (at != not_ready) return at;
      if (polls < 4096) {
        detail::cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

  std::vector<std::uint64_t> starts_;
  std::vector<std::uint64_t> cuts_;  // per task: merge_marked_windows + 2 rows of W positions
  std::vector<detail::merge_marks> marks_;  // per task: merge_marked_windows windows
  std::unique_ptr<std::atomic<std::uint64_t>[]> ready_;
  std::uint64_t ready_size_ = 0;
};

/// Capacity a `merge` output needs: the sum of the input sizes.
template <class V, class I>
[[nodiscard]] std::uint64_t merge_capacity(
    std::span<const sparse_view<const V, const I>> inputs) noexcept {
  std::uint64_t total = 0;
  for (const auto& in : inputs) total += in.size();
  return total;
}

}  // namespace stellatrain
