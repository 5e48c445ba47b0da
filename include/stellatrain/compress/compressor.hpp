// SPDX-License-Identifier: Apache-2.0
// The `compressor` concept: per-tensor state (residual and more) in, sparse selection out.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/select/selection.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace stellatrain {

/// Turns each step's dense gradient of a tensor into a sparse selection to send, keeping what
/// it did not send (the residual) in its own per-tensor state.
///
/// Requirements, for `C& c`, `const C& cc`, an executor `ex`, a tensor id `id`
/// (`std::uint32_t`, chosen by the caller), sizes `n` and `k`, a gradient
/// `std::span<const float> g`, an output `sparse_buffer<C::value_type, C::index_type>& out`
/// and saved bytes `std::span<const std::byte> saved`:
/// - `C::value_type` (float, fp16 or bf16: the type of the values sent) and `C::index_type`
///   (std::uint32_t or std::uint64_t).
/// - `c.add_tensor(ex, id, n)` registers tensor `id` of `n` elements: allocates its state
///   (pre-faulted across `ex`; zero residual). Registering an id twice is an error. Register
///   every tensor before compressing tensors concurrently.
/// - `c.compress(ex, id, g, k, out)` (g.size() == n): one step of tensor `id`. Writes the
///   selection to `out` (resized; its dense size set to n): indices strictly ascending, in
///   [0, n); returns `selection_stats`. Calls for different tensors may run concurrently;
///   calls for one tensor must not.
/// - `cc.residual(id)`: the n residual values after the last step.
/// - `cc.save_state()` returns every tensor's state as bytes, and `c.load_state(ex, saved)`
///   restores it into a compressor built with the same options: the run then continues
///   exactly as it would have.
///
/// Model: `error_feedback_compressor`. A minimal conforming compressor:
/// \code
///   struct send_all {
///     using value_type = float;
///     using index_type = std::uint32_t;
///     template <stellatrain::executor E> void add_tensor(E&, std::uint32_t, std::uint64_t) {}
///     template <stellatrain::executor E>
///     stellatrain::selection_stats compress(E&, std::uint32_t, std::span<const float> g,
///     std::uint64_t,
///                                           stellatrain::sparse_buffer<float>& out) {
///       out.reserve(g.size()); out.resize(g.size()); out.set_dense_size(g.size());
///       for (std::size_t i = 0; i < g.size(); ++i) { out.indices()[i] = i; out.values()[i] = g[i];
///       } return {.count = g.size()};
///     }
///     std::span<const float> residual(std::uint32_t) const { return {}; }
///     std::vector<std::byte> save_state() const { return {}; }
///     template <stellatrain::executor E> void load_state(E&, std::span<const std::byte>) {}
///   };
///   static_assert(stellatrain::compressor<send_all>);
/// \endcode
template <class C>
concept compressor = value_type<typename C::value_type> && index_type<typename C::index_type> &&
    requires(C& c, const C& cc, inline_executor& ex, std::uint32_t id, std::uint64_t n,
             std::uint64_t k, std::span<const float> g,
             sparse_buffer<typename C::value_type, typename C::index_type>& out,
             std::span<const std::byte> saved) {
  c.add_tensor(ex, id, n);
  { c.compress(ex, id, g, k, out) } -> std::convertible_to<selection_stats>;
  { cc.residual(id) } -> std::convertible_to<std::span<const float>>;
  { cc.save_state() } -> std::same_as<std::vector<std::byte>>;
  c.load_state(ex, saved);
};

namespace detail {

// A compressor whose selections travel as chunked sections (`chunked_compressor`): after
// `compress` of tensor `id`, `wire_section(id)` is the same selection as the wire carries it.
template <class C>
concept packs_chunked = requires(const C& c, std::uint32_t id) {
  { c.wire_section(id) } -> std::same_as<chunked_section>;
};

}  // namespace detail

}  // namespace stellatrain
