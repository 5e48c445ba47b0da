// SPDX-License-Identifier: Apache-2.0
// The `exchange_strategy` concept: how a pipeline turns one bucket's gradients on every rank
// into one merged update (select, pack, exchange, unpack, merge), and the vocabulary it shares
// with the pipeline.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace stellatrain {

/// A tensor of a bucket: its wire id, its size, where it starts in the bucket's gradient.
struct bucket_tensor {
  std::uint32_t id = 0;
  std::uint64_t size = 0;
  std::uint64_t offset = 0;
};

/// How many elements a selection keeps at a density: the rule every strategy applies.
struct selection_rule {
  double density = 0;
  std::uint64_t min_k = 1;           ///< `pipeline_options::min_k`
  std::uint64_t send_all_below = 0;  ///< `pipeline_options::send_all_below`

  /// k for `n` elements of a tensor of `tensor_size` elements (n < tensor_size: a shard's
  /// piece of it): all of them for a tensor of at most `send_all_below` elements, else
  /// ceil(density n), at least `min_k`, at most n.
  [[nodiscard]] std::uint64_t k(std::uint64_t tensor_size, std::uint64_t n) const noexcept {
    if (tensor_size <= send_all_below) return n;
    const auto k = static_cast<std::uint64_t>(std::ceil(density * static_cast<double>(n)));
    return std::min(n, std::max(k, min_k));
  }
};

/// One step's input to a bucket's exchange.
template <class Value, class Index>
struct bucket_input {
  /// The bucket's gradients, concatenated (`bucket_tensor::offset`); the strategy may
  /// overwrite them.
  std::span<float> gradient;
  /// Per tensor of the bucket: true when a selection was handed over instead of a gradient
  /// (`pipeline::push_selection`); it is then in `selections`.
  std::span<const char> preselected;
  std::span<const sparse_buffer<Value, Index>> selections;
  selection_rule rule;
  /// This rank's step reports (pipeline/step_reports.hpp), to go with its messages; may be
  /// empty.
  std::span<const std::byte> reports;
};

/// What a phase of an exchange did on this rank; the pipeline adds the phases up.
struct exchange_traffic {
  std::uint64_t message_bytes = 0;  ///< its packed selection, counted once
  std::uint64_t elements = 0;       ///< pairs it selected
  std::uint64_t sent_bytes = 0;     ///< bytes it sent
  std::uint64_t link_bytes = 0;     ///< bytes its link carried, by the cost model
  /// When its messages were on the link (equal: none were). The density policy learns the
  /// link from this span alone, so it must leave out CPU work and collectives of other links.
  transport_clock::time_point link_begin{};
  transport_clock::time_point link_end{};
  /// CPU time of stage work (select, pack, unpack, merge) the phase did on an exchange thread;
  /// the pipeline measures its executor tasks itself. Transfers are not stage work.
  double cpu_seconds = 0;
};

/// What crosses one rank's link per step, for the cost model (`exchange_cost_model`).
struct exchange_shape {
  std::uint32_t ranks = 1;  ///< ranks whose selections meet on the link (the link carries P - 1)
  std::uint32_t share = 1;  ///< this rank selects 1/share of the elements
  double rounds = 1;        ///< sequential latencies one bucket's exchange waits
};

/// A tensor's merged update of one step; valid until the next `update` of the same bucket.
template <class Index>
struct merged_update {
  aggregate_kind kind = aggregate_kind::sparse;
  sparse_view<const float, const Index> sparse{};  ///< kind == sparse: the pairs
  std::span<const float> dense{};                  ///< kind == dense: the whole tensor
};

/// Where a strategy hands the step reports of the messages it reads: `sink(rank, step,
/// payload)` with the sender's global rank and the message's step. A non-owning reference to
/// a callable that outlives the call it is passed to.
class report_sink {
 public:
  template <class F>
  requires(!std::same_as<F, report_sink>) report_sink(F& f)
  noexcept  // NOLINT: implicit
      : object_(&f),
        call_([](void* o, int rank, std::int64_t step, std::span<const std::byte> payload) {
          (*static_cast<F*>(o))(rank, step, payload);
        }) {}
  void operator()(int rank, std::int64_t step, std::span<const std::byte> payload) const {
    call_(object_, rank, step, payload);
  }

 private:
  void* object_;
  void (*call_)(void*, int, std::int64_t, std::span<const std::byte>);
};

/// The strategy a pipeline's first constructor argument picks: `exchange_for<L,
/// Compressor>::type` for links `L` (a transport: `flat_exchange`; `hierarchical_links`:
/// `hierarchical_exchange`). A strategy of one's own adds a specialization for its links.
template <class Links, class Compressor>
struct exchange_for;

/// How a pipeline exchanges a bucket: it owns each bucket's select -> pack -> exchange ->
/// unpack -> merge, with the compressor and the transports, and hands back the merged update
/// and the step reports it received. The pipeline owns the rest (the hand-overs, the gates,
/// the schedule, the accounting, the optimizer) and calls the phases of bucket b in step
/// order, each phase of one bucket after the previous one:
///
///   encode (executor) -> exchange (an exchange thread) -> decode (executor) -> update(i)
///
/// Requirements, for `S& s`, `const S& cs`, `const pipeline_options& o`, an executor `ex`,
/// `std::span<const bucket_tensor> tensors`, bucket `b` and step `step`, a `bucket_input in`,
/// a `report_sink sink` and a reason `std::string_view why`:
/// - `S::compressor_type` (a `compressor`), `S::transport_type` (a `transport`: the one of
///   every rank, global ranks), `S::value_type` and `S::index_type` (the compressor's), and
///   `S::takes_selections` (bool): whether a selection handed over in place of a gradient
///   (`in.preselected`) is exchanged as it is.
/// - `s.transport()`, `s.compressor()`: references to them.
/// - `s.start(o)`: collective, once, before anything else: checks that every rank's view of
///   the links agrees and keeps `o`; a mismatch throws on every rank.
/// - `s.add_bucket(tensors, ex)`: the next bucket (b = 0, 1, ...) holds these tensors; the
///   strategy registers their state (the compressor's residuals among it).
/// - `s.encode(b, step, in, ex)`: the work that needs no other rank (a flat exchange selects
///   and packs here); returns its traffic.
/// - `s.exchange(b, step, in, ex, sink)`: the messages. Every rank calls the exchanges of
///   the buckets in the same order, on threads that may block; after it returns `in` is no
///   longer read. Returns its traffic.
/// - `s.decode(b, step, ex, sink)`: reads what arrived (checking every byte of it).
/// - `s.update(b, step, i, ex)`: tensor i's merged update (`merged_update`), the same bits on
///   every rank.
/// - `cs.shape()`: `exchange_shape`, for the cost model; `cs.report_sources()`: the ranks
///   whose reports this rank receives, ascending (`std::vector<int>`).
/// - `s.abort(why)` (noexcept): aborts the transports, so that every rank fails.
/// Messages that break the format or the exchange's rules throw `errc::malformed_message`
/// (or the unpacker's error), never undefined behaviour.
///
/// Models: `flat_exchange` (pipeline/flat_exchange.hpp) and `hierarchical_exchange`
/// (pipeline/hierarchical_exchange.hpp). A minimal model, one rank that steps with its own
/// gradient (a complete, tested version is in tests/pipeline/test_exchange_strategy.cpp):
/// \code
///   struct alone {
///     using compressor_type = send_all;  // any compressor
///     using transport_type = loopback;   // any transport of one rank
///     using value_type = float;
///     using index_type = std::uint32_t;
///     static constexpr bool takes_selections = false;
///     transport_type& transport() { return t; }
///     compressor_type& compressor() { return c; }
///     void start(const stellatrain::pipeline_options&) {}
///     template <class E> void add_bucket(std::span<const stellatrain::bucket_tensor> ts, E&) {
///       buckets.emplace_back(ts.begin(), ts.end()); grads.emplace_back();
///     }
///     template <class E> stellatrain::exchange_traffic encode(std::size_t b, std::int64_t,
///         const stellatrain::bucket_input<float, std::uint32_t>& in, E&) {
///       grads[b].assign(in.gradient.begin(), in.gradient.end()); return {};
///     }
///     template <class E> stellatrain::exchange_traffic exchange(std::size_t, std::int64_t,
///         const stellatrain::bucket_input<float, std::uint32_t>&, E&,
///         stellatrain::report_sink) { return {}; }
///     template <class E> void decode(std::size_t, std::int64_t, E&, stellatrain::report_sink) {}
///     template <class E> stellatrain::merged_update<std::uint32_t> update(std::size_t b,
///         std::int64_t, std::size_t i, E&) {
///       const auto& t = buckets[b][i];
///       return {.kind = stellatrain::aggregate_kind::dense,
///               .dense = std::span<const float>(grads[b]).subspan(t.offset, t.size)};
///     }
///     stellatrain::exchange_shape shape() const { return {}; }
///     std::vector<int> report_sources() const { return {0}; }
///     void abort(std::string_view) noexcept {}
///     loopback t; send_all c;
///     std::vector<std::vector<stellatrain::bucket_tensor>> buckets;
///     std::vector<std::vector<float>> grads;
///   };
///   static_assert(stellatrain::exchange_strategy<alone>);
/// \endcode
template <class S>
concept exchange_strategy = compressor<typename S::compressor_type> &&
    transport<typename S::transport_type> &&
    std::same_as<typename S::value_type, typename S::compressor_type::value_type> &&
    std::same_as<typename S::index_type, typename S::compressor_type::index_type> &&
    requires(S& s, const S& cs, const pipeline_options& o, inline_executor& ex,
             std::span<const bucket_tensor> tensors, std::size_t b, std::int64_t step,
             const bucket_input<typename S::value_type, typename S::index_type>& in,
             report_sink sink, std::string_view why) {
  { S::takes_selections } -> std::convertible_to<bool>;
  { s.transport() } -> std::same_as<typename S::transport_type&>;
  { s.compressor() } -> std::same_as<typename S::compressor_type&>;
  s.start(o);
  s.add_bucket(tensors, ex);
  { s.encode(b, step, in, ex) } -> std::same_as<exchange_traffic>;
  { s.exchange(b, step, in, ex, sink) } -> std::same_as<exchange_traffic>;
  s.decode(b, step, ex, sink);
  { s.update(b, step, b, ex) } -> std::same_as<merged_update<typename S::index_type>>;
  { cs.shape() } -> std::same_as<exchange_shape>;
  { cs.report_sources() } -> std::same_as<std::vector<int>>;
  { s.abort(why) }
  noexcept;
};

namespace detail {

// The links from which the pipeline builds strategy `Exchange` with a compressor
// (`Exchange::links_type`), else a type no argument converts to.
template <class Exchange>
struct links_of {
  struct none {
    none() = delete;
  };
  using type = none;
};
template <class Exchange>
requires requires { typename Exchange::links_type; }
struct links_of<Exchange> {
  using type = typename Exchange::links_type;
};

// The strategy that links `Links` (a reference to them, too) and compressor `Compressor` make.
template <class Links, class Compressor>
using exchange_of = typename exchange_for<std::remove_cvref_t<Links>, Compressor>::type;

}  // namespace detail

}  // namespace stellatrain
