// SPDX-License-Identifier: Apache-2.0
// An opt-in run-time choice between the flat and the hierarchical exchange, for applications
// that pick the setting from a command line.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/flat_exchange.hpp>
#include <stellatrain/pipeline/hierarchical_exchange.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/transport/concept.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace stellatrain {

/// An `exchange_strategy` that is `flat_exchange` or `hierarchical_exchange`, decided when it
/// is constructed (from a transport, or from `hierarchical_links`); every call goes to the
/// one it holds. Costs the compile time of both and a branch per call; a program that knows
/// its setting at compile time passes the links to the pipeline instead. A selection handed
/// over in place of a gradient needs the flat exchange: such a pipeline has no
/// `push_selection`.
/// \code
///   using exchange = stellatrain::runtime_exchange<link, compressor>;
///   auto ex = across_clusters ? exchange(stellatrain::hierarchical_links<link>{lan, wan, topo},
///                                        compressor())
///                             : exchange(wan, compressor());
///   stellatrain::pipeline p(std::move(ex), pool, stellatrain::adam_optimizer());
/// \endcode
template <transport Transport, compressor Compressor>
class runtime_exchange {
  using flat = flat_exchange<Transport, Compressor>;
  using hierarchical = hierarchical_exchange<Transport, Compressor>;

 public:
  using transport_type = Transport;
  using compressor_type = Compressor;
  using value_type = typename Compressor::value_type;
  using index_type = typename Compressor::index_type;
  static constexpr bool takes_selections = false;

  runtime_exchange(Transport& transport, Compressor compressor)
      : held_(std::in_place_type<flat>, transport, std::move(compressor)) {}
  runtime_exchange(hierarchical_links<Transport> links, Compressor compressor)
      : held_(std::in_place_type<hierarchical>, std::move(links), std::move(compressor)) {}

  /// Whether it holds the hierarchical exchange.
  [[nodiscard]] bool hierarchical_setting() const noexcept {
    return std::holds_alternative<hierarchical>(held_);
  }

  Transport& transport() noexcept {
    return visit([](auto& s) -> Transport& { return s.transport(); });
  }
  Compressor& compressor() noexcept {
    return visit([](auto& s) -> Compressor& { return s.compressor(); });
  }
  void start(const pipeline_options& o) {
    visit([&](auto& s) { s.start(o); });
  }
  template <class Executor>
  void add_bucket(std::span<const bucket_tensor> tensors, Executor& ex) {
    visit([&](auto& s) { s.add_bucket(tensors, ex); });
  }
  template <class Executor>
  exchange_traffic encode(std::size_t b, std::int64_t step,
                          const bucket_input<value_type, index_type>& in, Executor& ex) {
    return visit([&](auto& s) { return s.encode(b, step, in, ex); });
  }
  template <class Executor>
  exchange_traffic exchange(std::size_t b, std::int64_t step,
                            const bucket_input<value_type, index_type>& in, Executor& ex,
                            report_sink sink) {
    return visit([&](auto& s) { return s.exchange(b, step, in, ex, sink); });
  }
  template <class Executor>
  void decode(std::size_t b, std::int64_t step, Executor& ex, report_sink sink) {
    visit([&](auto& s) { s.decode(b, step, ex, sink); });
  }
  template <class Executor>
  merged_update<index_type> update(std::size_t b, std::int64_t step, std::size_t i, Executor& ex) {
    return visit([&](auto& s) { return s.update(b, step, i, ex); });
  }
  [[nodiscard]] exchange_shape shape() const {
    return std::visit([](const auto& s) { return s.shape(); }, held_);
  }
  [[nodiscard]] std::vector<int> report_sources() const {
    return std::visit([](const auto& s) { return s.report_sources(); }, held_);
  }
  void abort(std::string_view why) noexcept {
    visit([&](auto& s) { s.abort(why); });
  }

 private:
  template <class F>
  decltype(auto) visit(F&& f) {
    if (auto* h = std::get_if<hierarchical>(&held_)) return f(*h);
    return f(std::get<flat>(held_));
  }

  std::variant<flat, hierarchical> held_;
};

}  // namespace stellatrain
