// SPDX-License-Identifier: Apache-2.0
// Partitioned selection: rank r of P selects k / P from a rotating 1 / P slice of the tensor,
// so the selections gathered from all ranks never overlap.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/selection.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

namespace stellatrain {

/// Which share of the work one rank does: rank `rank` of `parts` ranks (parts >= 1).
struct partition {
  std::uint32_t rank = 0;
  std::uint32_t parts = 1;
};

/// The slice of a tensor one rank selects from at one step, and how many it selects there.
struct partition_slice {
  std::uint64_t begin = 0;  ///< first element of the slice
  std::uint64_t end = 0;    ///< one past its last element
  std::uint64_t k = 0;      ///< elements this rank selects from it
  std::uint32_t slice = 0;  ///< which of the P slices: (rank + step) mod P
};

/// The slice that rank `p.rank` of `p.parts` selects from at `step`, for a tensor of `n`
/// elements of which k are selected in all: slice j = (rank + step) mod P covers
/// [bound(j), bound(j + 1)) with bound(j) = floor(j n / P) rounded down to a multiple of
/// `align` (16 fp32 = one cache line; bound(P) = n), and the rank selects k / P there, one more
/// for the slices j < k mod P. At every step the P ranks cover P different slices (disjoint,
/// together the whole tensor, together k elements when every slice holds its share), and
/// every rank cycles through all slices in P steps. Throws `errc::invalid_argument` unless
/// rank < parts and align >= 1.
[[nodiscard]] inline partition_slice slice_of(partition p, std::uint64_t n, std::uint64_t k, std::uint64_t step,
                                              std::uint64_t align = 16) {
  if (p.parts == 0 || p.rank >= p.parts || align == 0) {
    throw_error(errc::invalid_argument, "slice_of: rank " + std::to_string(p.rank) + " of " +
                                            std::to_string(p.parts) + " parts (align " + std::to_string(align) +
                                            ") is not a valid partition");
  }
  __extension__ using u128 = unsigned __int128;
  const std::uint64_t parts = p.parts;
  const auto j = static_cast<std::uint32_t>((p.rank + step % parts) % parts);
  auto bound = [&](std::uint64_t s) -> std::uint64_t {
    if (s >= parts) return n;
    const auto b = static_cast<std::uint64_t>(static_cast<u128>(s) * n / parts);
    return b / align * align;
  };
  return {.begin = bound(j), .end = bound(j + 1), .k = k / parts + (j < k % parts ? 1 : 0), .slice = j};
}

/// Runs a `selector` on this rank's slice of every tensor (see `slice_of`): rank r of P
/// selects k / P elements from the slice (r + step) mod P, with indices into the whole tensor.
/// Each rank's output holds min(slice k, slice size) elements, indices ascending; gathered
/// over the P ranks of one step, the selections are disjoint. The reference used this so that
/// an all-gather of the selections needs no merge of duplicates.
///
/// \code
///   stellatrain::partitioned_selector<stellatrain::exact_topk_selector<>> sel;
///   auto st = sel.select(pool, {.rank = r, .parts = world}, step, std::span<const float>(g), k,
///                        std::span(idx), std::span(val));
/// \endcode
template <selector Inner = exact_topk_selector<>>
class partitioned_selector {
 public:
  partitioned_selector() = default;
  explicit partitioned_selector(Inner inner) : inner_(std::move(inner)) {}

  [[nodiscard]] Inner& inner() noexcept { return inner_; }

  /// Selects this rank's share of `x` at `step` into the front of `indices` and `values`
  /// (indices into `x`, plus `index_base`). Errors as the inner selector's and `slice_of`.
  template <executor Ex, value_type T, index_type Index>
  selection_stats select(Ex& ex, partition p, std::uint64_t step, std::type_identity_t<std::span<const T>> x,
                         std::uint64_t k, std::span<Index> indices, std::span<T> values,
                         std::uint64_t index_base = 0) {
    const partition_slice s = slice_of(p, x.size(), k, step);
    return inner_.select(ex, x.subspan(s.begin, s.end - s.begin), s.k, indices, values, index_base + s.begin);
  }

 private:
  Inner inner_{};
};

}  // namespace stellatrain
