// SPDX-License-Identifier: Apache-2.0
// Vocabulary shared by the CPU selectors: the ranking rule, what a call reports, argument
// checks, and the `selector` concept that every CPU selector models.
//
// Semantics shared by every selector (CPU and GPU):
//  - Elements rank by the bit pattern of |x| read as an unsigned integer (the "magnitude
//    key"): +0 == -0, +inf ranks above every finite value, a NaN ranks above +inf (a NaN with a
//    larger payload above a smaller one). NaNs are therefore selected first; stages after the
//    selection (the optimizer) apply their own policy for non-finite values.
//  - Exactly min(k, n) elements are returned, indices strictly ascending, values copied from
//    the input at those indices (bit for bit, sign included).
//  - Exact selectors return the k largest keys; ties at the k-th key go to the lowest indices,
//    so every rank and every run agrees. Approximate selectors (threshold when it must fill,
//    sampled threshold when its estimate is off, block, random) still return exactly min(k, n)
//    distinct elements and say whether the set is exact.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/select/selection_source.hpp>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

namespace stellatrain {

/// What one selection call did.
struct selection_stats {
  std::uint64_t count = 0;  ///< elements written: min(k, n)
  bool exact = true;        ///< the set is exactly the top min(k, n) by magnitude key
  int passes = 0;           ///< full passes over the input (1: it was read once)
  bool fallback = false;    ///< the sampled or persistent bound failed and full radix passes ran
  bool deficit = false;     ///< the band held fewer than k elements: lowest-index ones filled in
};

namespace detail {

// Checks the arguments every selector takes; throws `error` naming `who`.
template <class Index>
void check_selection_args(const char* who, std::uint64_t n, std::uint64_t k, std::size_t indices,
                          std::size_t values, std::uint64_t index_base) {
  const std::uint64_t m = k < n ? k : n;
  if (indices < m || values < m) {
    throw_error(errc::invalid_argument,
                std::string(who) + ": output holds " + std::to_string(indices) + " indices and " +
                    std::to_string(values) + " values, " + std::to_string(m) + " needed");
  }
  if (n == 0) return;
  constexpr std::uint64_t max_index = std::numeric_limits<Index>::max();
  if (n - 1 > max_index || index_base > max_index - (n - 1)) {
    throw_error(errc::out_of_range, std::string(who) + ": indices up to " +
                                        std::to_string(index_base) + " + " + std::to_string(n - 1) +
                                        " do not fit a " + std::to_string(8 * sizeof(Index)) +
                                        "-bit index");
  }
}

// Writes every element (k >= n): indices base..base+n-1, values copied.
template <executor Ex, class T, class Index>
void select_all(Ex& ex, std::span<const T> x, std::span<Index> indices, std::span<T> values,
                std::uint64_t index_base) {
  for_each_chunk(ex, x.size(), std::uint64_t{1} << 16, [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t i = b; i < e; ++i) {
      indices[i] = static_cast<Index>(index_base + i);
      values[i] = x[i];
    }
  });
}

// Sizes the output of a selection from n elements to min(k, n) pairs (capacity grown,
// pre-faulted, if too small): the sparse_buffer interface of every selector.
template <class T, class Index>
void resize_for_selection(sparse_buffer<T, Index>& out, std::uint64_t n, std::uint64_t k) {
  const std::uint64_t m = std::min(k, n);
  out.reserve(m, {.prefault = true});
  out.resize(m);
}

// Scratch a selector keeps for its span interface: a copy of the selector starts with fresh
// scratch (copying a selector copies its options only).
template <class T>
class copy_fresh {
 public:
  copy_fresh() = default;
  copy_fresh(const copy_fresh&) noexcept {}
  copy_fresh(copy_fresh&&) noexcept = default;
  copy_fresh& operator=(const copy_fresh&) noexcept { return *this; }
  copy_fresh& operator=(copy_fresh&&) noexcept = default;
  ~copy_fresh() = default;

  [[nodiscard]] T& get() noexcept { return value_; }

 private:
  T value_{};
};

// The calls of a selector's `select_from` that need no selection: k = 0 (the first pass
// only) and k >= n (the first pass, then every element). Empty when the call is the selector's.
template <class Arch, class Source, executor Ex, class Emit>
std::optional<selection_stats> select_trivial(Ex& ex, const Source& src, std::uint64_t n,
                                              std::uint64_t k, Emit& emit) {
  if (k > 0 && k < n) return std::nullopt;
  consume_source<Arch>(ex, src, n);
  if (k == 0) return selection_stats{.passes = 1};
  const auto rd = src.reread();
  for_each_chunk(ex, n, std::uint64_t{1} << 16, [&](std::uint64_t b, std::uint64_t e) {
    for (std::uint64_t i = b; i < e; ++i) emit(i, i, rd.load_scalar(i));
  });
  return selection_stats{.count = n, .passes = 1};
}

}  // namespace detail

namespace detail {
template <class S>
struct selector_arch_of {
  using type = xsimd::default_arch;
};
template <class S>
requires requires { typename S::arch_type; }
struct selector_arch_of<S> {
  using type = typename S::arch_type;
};
}  // namespace detail

/// The SIMD architecture of a selector: `S::arch_type` where it names one, else
/// `xsimd::default_arch`. A compressor runs its own passes (elements no selection reads) on it.
template <class S>
using selector_arch_t = typename detail::selector_arch_of<S>::type;

/// What a selection call knows about the tensor beyond its values: which tensor, which step
/// of it, which slice (partitioned selection). Random-k keys its indices by them.
struct selection_context {
  std::uint32_t tensor = 0;  ///< the caller's id of the tensor
  std::uint64_t step = 0;    ///< calls on this tensor before this one
  std::uint32_t slice = 0;   ///< the slice selected from (`partitioned_selector`), else 0
};

namespace detail {

// The emission sink the `selector` concept is checked with.
struct emit_archetype {
  void operator()(std::uint64_t pos, std::uint64_t index, std::uint32_t bits) const;
};

// The span interface of a selector, on top of its `select_from` with `state` and `ws`:
// argument checks (errors name `who`), k = 0, k >= n (every element), else `select_from` on
// the elements of `x` with a sink that writes (index_base + i, value) to the front of
// `indices` and `values`.
template <class S, class State, class Workspace, executor Ex, class T, class Index>
selection_stats select_into(const char* who, const S& selector, Ex& ex, State& state, Workspace& ws,
                            std::span<const T> x, std::uint64_t k, std::span<Index> indices,
                            std::span<T> values, std::uint64_t index_base,
                            const selection_context& ctx = {}) {
  const std::uint64_t n = x.size();
  check_selection_args<Index>(who, n, k, indices.size(), values.size(), index_base);
  if (k == 0 || n == 0) return {};
  if (k >= n) {
    select_all(ex, x, indices, values, index_base);
    return {.count = n, .passes = 1};
  }
  auto emit = [&](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
    indices[pos] = static_cast<Index>(index_base + i);
    values[pos] = value_from_bits<T>(bits);
  };
  return selector.select_from(ex, state, ws, plain_source<T>{x.data()}, n, k, ctx, emit);
}

// The same into `out`, resized to min(k, n) first (its capacity grows if too small).
template <class S, class State, class Workspace, executor Ex, class T, class Index>
selection_stats select_into(const char* who, const S& selector, Ex& ex, State& state, Workspace& ws,
                            std::span<const T> x, std::uint64_t k, sparse_buffer<T, Index>& out,
                            std::uint64_t index_base, const selection_context& ctx = {}) {
  resize_for_selection(out, x.size(), k);
  return select_into(who, selector, ex, state, ws, x, k, out.indices(), out.values(), index_base,
                     ctx);
}

}  // namespace detail

/// A CPU selector: chooses k of n elements that a `selection_source` yields and hands them to
/// a sink in index order. `error_feedback_compressor<Selector>` is built on it, and so is
/// every selector's span interface (`select(ex, x, k, indices, values)`).
///
/// Requirements, for `const S& cs`, an executor `ex`, a source `src` (a `selection_source`),
/// sizes `n` and `k`, a `selection_context ctx` and a sink `emit(pos, index, bits)`:
/// - `S::tensor_state`: what a selector keeps per tensor from call to call and what a
///   checkpoint saves (the persistent bound of threshold selection, say): default
///   constructible (the state of a tensor never selected from) and copyable. When it is not
///   an empty type, `cs.save(state, w)` writes it to a `state_record_writer& w` and
///   `cs.load(state, r)` reads it back from a `state_record_reader& r` (core/saved_state.hpp).
/// - `S::workspace`: the scratch of one call, default constructible and movable; reused from
///   call to call, grown on demand and never shrunk.
/// - `cs.reserve(ex, ws, n, k)`: allocates (pre-faulted) what calls on fp32 sources of up to n
///   elements and k selected need, so that they do not allocate.
/// - `cs.select_from(ex, state, ws, src, n, k, ctx, emit)` -> `selection_stats`: one call, for
///   any n and k. Its first pass loads every element of [0, n) exactly once (the source may
///   act on the load; see `selection_source`); then it calls `emit(pos, i, bits)` exactly once
///   for each pos in [0, c), c = the returned `count`: the pos-th selected element is element
///   i, with raw bits `bits`, i strictly ascending with pos. c is min(k, n), or, for a
///   selector that takes a share of the tensor (`partitioned_selector`), at most that. Calls
///   with different states and workspaces may run concurrently on one selector.
///
/// Models: `exact_topk_selector`, `threshold_selector`, `sampled_threshold_selector`,
/// `block_topk_selector`, `random_k_selector`, `partitioned_selector`, and
/// `dynamic_selector` (any of them, chosen at run time). A minimal conforming selector (the
/// first k elements):
/// \code
///   struct first_k_selector {
///     struct tensor_state {};
///     struct workspace {};
///     template <stellatrain::executor Ex>
///     void reserve(Ex&, workspace&, std::uint64_t, std::uint64_t) const {}
///     template <stellatrain::executor Ex, class Source, class Emit>
///     stellatrain::selection_stats select_from(Ex&, tensor_state&, workspace&, const Source& src,
///     std::uint64_t n,
///                                              std::uint64_t k, const
///                                              stellatrain::selection_context&, Emit&& emit) const
///                                              {
///       const std::uint64_t m = std::min(k, n);
///       for (std::uint64_t i = 0; i < n; ++i) (void)src.load_scalar(i);  // every element once
///       const auto values = src.reread();                                 // what that pass
///       produced for (std::uint64_t i = 0; i < m; ++i) emit(i, i, values.load_scalar(i)); return
///       {.count = m, .exact = m == n, .passes = 1};
///     }
///   };
///   static_assert(stellatrain::selector<first_k_selector>);
/// \endcode
template <class S>
concept selector = std::default_initializable<typename S::tensor_state> &&
    std::copyable<typename S::tensor_state> && std::default_initializable<typename S::workspace> &&
    std::movable<typename S::workspace> &&
    requires(const S& cs, inline_executor& ex, typename S::tensor_state& state,
             typename S::workspace& ws, const plain_source<float>& src, std::uint64_t n,
             std::uint64_t k, const selection_context& ctx, detail::emit_archetype& emit) {
  cs.reserve(ex, ws, n, k);
  { cs.select_from(ex, state, ws, src, n, k, ctx, emit) } -> std::convertible_to<selection_stats>;
} &&(std::is_empty_v<typename S::tensor_state> ||
     requires(const S& cs, const typename S::tensor_state& saved, typename S::tensor_state& state,
              state_record_writer& w, state_record_reader& r) {
       cs.save(saved, w);
       cs.load(state, r);
     });

}  // namespace stellatrain
