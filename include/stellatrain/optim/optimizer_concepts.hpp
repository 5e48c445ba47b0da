// SPDX-License-Identifier: Apache-2.0
// The concepts every CPU optimizer models: `dense_optimizer` (steps with a dense gradient)
// and `sparse_optimizer` (also steps with a sorted sparse gradient).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/optimizer_types.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace stellatrain {

/// An optimizer that owns fp32 master parameters of registered tensors and updates them from
/// dense gradients.
///
/// Requirements, for `O& o`, `const O& co`, `std::size_t t`, `std::span<const float> init, g`
/// and an `inline_executor& ex`:
/// - `o.add_tensor(init)` registers a tensor with initial parameters, returns its index;
/// - `co.tensor_count()`, `co.params(t)` (the current fp32 parameters, a span of const float);
/// - `o.step(t, g, ex)` applies one step with gradient `g` (one value per element) through
///   the executor and returns a `step_report`.
///
/// A minimal conforming optimizer (plain SGD without state):
/// \code
///   struct plain_sgd {
///     float lr = 0.1f;
///     std::vector<std::vector<float>> p;
///     std::size_t add_tensor(std::span<const float> x) { p.emplace_back(x.begin(), x.end());
///     return p.size() - 1; } std::size_t tensor_count() const { return p.size(); } std::span<const
///     float> params(std::size_t t) const { return p[t]; } template <stellatrain::executor E>
///     stellatrain::step_report step(std::size_t t, std::span<const float> g, E&) {
///       for (std::size_t i = 0; i < g.size(); ++i) p[t][i] -= lr * g[i];
///       return {.updated = g.size()};
///     }
///   };
///   static_assert(stellatrain::dense_optimizer<plain_sgd>);
/// \endcode
template <class O>
concept dense_optimizer = requires(O& o, const O& co, std::size_t t, std::span<const float> g,
                                   inline_executor& ex) {
  { o.add_tensor(g) } -> std::convertible_to<std::size_t>;
  { co.tensor_count() } -> std::convertible_to<std::size_t>;
  { co.params(t) } -> std::convertible_to<std::span<const float>>;
  { o.step(t, g, ex) } -> std::same_as<step_report>;
};

/// A `dense_optimizer` that also takes sparse gradients: `o.step(t, s, ex)` for a
/// `sparse_view<const float, const std::uint32_t>` or `<const float, const std::uint64_t>`
/// `s` whose `dense_size()` is the tensor's size and whose indices are sorted, updating the
/// touched elements only (the "lazy" semantics the model documents).
template <class O>
concept sparse_optimizer = dense_optimizer<O> &&
    requires(O& o, std::size_t t, const sparse_view<const float, const std::uint32_t>& s32,
             const sparse_view<const float, const std::uint64_t>& s64, inline_executor& ex) {
  { o.step(t, s32, ex) } -> std::same_as<step_report>;
  { o.step(t, s64, ex) } -> std::same_as<step_report>;
};

}  // namespace stellatrain
