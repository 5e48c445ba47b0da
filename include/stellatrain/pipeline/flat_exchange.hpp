// SPDX-License-Identifier: Apache-2.0
// The flat exchange strategy: every rank selects with error feedback, packs, and the sparse
// all-gather gives every rank every rank's selection, which each merges the same way.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/detail/bucket_message.hpp>
#include <stellatrain/pipeline/detail/tags.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

/// The flat `exchange_strategy`, for ranks joined by one network: per bucket and step, each
/// rank selects each tensor with the compressor (error feedback) and packs the selection with
/// its step reports (`encode`, on the executor); one `sparse_allgather` over `transport`
/// (`pipeline_options::algorithm`) brings every rank every rank's message (`exchange`); each
/// rank reads the messages in rank order, never by arrival (`decode`), and merges them
/// (k-way merge or a dense scatter, `sparse_merger`) into the same update (`update`).
/// A selection handed over instead of a gradient is packed as it is. A compressor with a wire
/// section of its own (`chunked_compressor::wire_section`) is packed as that section. Built by the
/// pipeline from its first constructor argument, a transport: `pipeline p(transport, executor,
/// compressor, optimizer, ...)`.
template <transport Transport, compressor Compressor>
class flat_exchange {
 public:
  using transport_type = Transport;
  using compressor_type = Compressor;
  using value_type = typename Compressor::value_type;
  using index_type = typename Compressor::index_type;
  using links_type = Transport&;
  static constexpr bool takes_selections = true;

  flat_exchange(Transport& transport, Compressor compressor)
      : transport_(&transport), compressor_(std::move(compressor)) {}

  [[nodiscard]] Transport& transport() noexcept { return *transport_; }
  [[nodiscard]] Compressor& compressor() noexcept { return compressor_; }

  void start(const pipeline_options& options) { options_ = options; }

  template <class Executor>
  void add_bucket(std::span<const bucket_tensor> tensors, Executor& ex) {
    auto b = std::make_unique<bucket>();
    const std::size_t ranks = static_cast<std::size_t>(transport_->size());
    std::uint64_t largest = 0;
    b->tensors.assign(tensors.begin(), tensors.end());
    for (const auto& t : tensors) {
      compressor_.add_tensor(ex, t.id, t.size);
      b->unpacker.register_tensor(t.id, t.size);
      largest = std::max(largest, t.size);
    }
    for (auto& r : b->received) r.resize(ranks);
    b->selections.resize(tensors.size());
    b->decoded.resize(ranks);
    for (auto& per_rank : b->decoded) per_rank.resize(tensors.size());
    b->dense = aligned_buffer<float>(largest, {.prefault = true}, ex);
    buckets_.push_back(std::move(b));
    tags_.emplace(options_.tag_base, buckets_.size());
  }

  /// Selects every tensor of bucket `b` (or takes the selection handed over) and packs them
  /// with this rank's step reports.
  template <class Executor>
  exchange_traffic encode(std::size_t b, std::int64_t step,
                          const bucket_input<value_type, index_type>& in, Executor& ex) {
    bucket& bs = *buckets_[b];
    bs.packer.clear(static_cast<std::uint64_t>(step));
    std::uint64_t elements = 0;
    for (std::size_t i = 0; i < bs.tensors.size(); ++i) {
      const bucket_tensor& t = bs.tensors[i];
      const bool handed_over = in.preselected[i] != 0;
      auto& selection = handed_over ? in.selections[i] : bs.selections[i];
      if (!handed_over) {
        compressor_.compress(ex, t.id, in.gradient.subspan(t.offset, t.size),
                             in.rule.k(t.size, t.size), bs.selections[i]);
      }
      elements += selection.size();
      if constexpr (detail::packs_chunked<Compressor>) {
        if (!handed_over) {  // the compressor's own wire section (chunked_compressor)
          bs.packer.add_chunked(t.id, compressor_.wire_section(t.id));
          continue;
        }
      }
      bs.packer.add(t.id, selection.view(),
                    {.indices = options_.wire_indices, .values = value_encoding_of<value_type>});
    }
    if (!in.reports.empty()) bs.packer.add_control(control_type::step_reports, in.reports);
    std::vector<std::byte>& message = bs.message[slot(step)];
    const std::size_t bytes = bs.packer.prepare(ex);
    message.resize(bytes);
    bs.packer.write(message, ex);
    return {.message_bytes = bytes, .elements = elements, .sent_bytes = bytes};
  }

  /// The sparse all-gather of this rank's message of bucket `b`.
  template <class Executor>
  exchange_traffic exchange(std::size_t b, std::int64_t step,
                            const bucket_input<value_type, index_type>&, Executor&, report_sink) {
    bucket& bs = *buckets_[b];
    const std::vector<std::byte>& message = bs.message[slot(step)];
    const auto t0 = transport_clock::now();
    sparse_allgather(*transport_, std::span<const std::byte>(message),
                     std::span<message_buffer>(bs.received[slot(step)]),
                     allgather_for(tags_->exchange(step, b)));
    return {.link_bytes = static_cast<std::uint64_t>(transport_->size() - 1) * message.size(),
            .link_begin = t0,
            .link_end = transport_clock::now()};
  }

  /// Unpacks every rank's message of bucket `b`, by rank.
  template <class Executor>
  void decode(std::size_t b, std::int64_t step, Executor& ex, report_sink sink) {
    bucket& bs = *buckets_[b];
    for (int r = 0; r < transport_->size(); ++r) {
      auto& per_rank = bs.decoded[static_cast<std::size_t>(r)];
      for (auto& d : per_rank) d.resize(0);
      const message_buffer& m = bs.received[slot(step)][static_cast<std::size_t>(r)];
      auto who = [&] {
        return "pipeline: rank " + std::to_string(r) + " (bucket " + std::to_string(b) + ")";
      };
      const message_info& info = detail::read_bucket_message(
          bs.unpacker, std::span<const std::byte>(m.data(), m.size()), step, r, ex, sink, who);
      for (std::size_t s = 0; s < info.sections.size(); ++s) {
        const section_info& sec = info.sections[s];
        auto& out = per_rank[detail::tensor_in_bucket(bs.tensors, sec.tensor, who)];
        out.reserve(sec.count, {.prefault = true});
        out.set_dense_size(sec.dense_size);
        bs.unpacker.decode(s, out, ex);
      }
    }
  }

  /// Tensor `i` of bucket `b`: every rank's pairs merged (reduced by `pipeline_options::op`).
  template <class Executor>
  merged_update<index_type> update(std::size_t b, std::int64_t, std::size_t i, Executor& ex) {
    bucket& bs = *buckets_[b];
    const std::uint64_t n = bs.tensors[i].size;
    bs.inputs.clear();
    std::uint64_t total = 0;
    for (auto& per_rank : bs.decoded) {
      auto& d = per_rank[i];
      d.set_dense_size(n);
      bs.inputs.push_back(std::as_const(d).view());
      total += d.size();
    }
    bs.merged.set_dense_size(n);
    if (bs.merged.capacity() < total) bs.merged.reserve(total, {.prefault = true});
    const std::span<float> dense(bs.dense.data(), n);
    const aggregate_kind kind = bs.merger.aggregate(
        std::span<const sparse_view<const float, const index_type>>(bs.inputs), bs.merged, dense,
        {.op = options_.op, .dense_threshold = options_.dense_threshold}, ex);
    return {.kind = kind, .sparse = std::as_const(bs.merged).view(), .dense = dense};
  }

  [[nodiscard]] exchange_shape shape() const noexcept {
    const int ranks = transport_->size();
    const bool one_round = options_.algorithm == allgather_algorithm::native ||
                           allgather_is_direct(allgather_for(0), ranks);
    return {.ranks = static_cast<std::uint32_t>(ranks),
            .share = 1,
            .rounds = one_round ? 1.0 : static_cast<double>(ranks - 1)};
  }

  [[nodiscard]] std::vector<int> report_sources() const {
    std::vector<int> all(static_cast<std::size_t>(transport_->size()));
    std::iota(all.begin(), all.end(), 0);
    return all;
  }

  void abort(std::string_view why) noexcept { detail::abort_transport(*transport_, why); }

 private:
  struct bucket {
    std::vector<bucket_tensor> tensors;
    std::vector<sparse_buffer<value_type, index_type>> selections;  // per tensor
    message_packer packer;
    std::vector<std::byte> message[2];        // this rank's, by step % 2
    std::vector<message_buffer> received[2];  // every rank's, by step % 2, then rank
    message_unpacker unpacker;
    std::vector<std::vector<sparse_buffer<float, index_type>>> decoded;  // [rank][tensor]
    std::vector<sparse_view<const float, const index_type>> inputs;
    sparse_merger merger;
    sparse_buffer<float, index_type> merged;
    aligned_buffer<float> dense;  // the largest tensor's size
  };

  static std::size_t slot(std::int64_t step) noexcept { return static_cast<std::size_t>(step % 2); }

  allgather_options allgather_for(tag_type tag) const noexcept {
    return {.tag = tag, .timeout = options_.timeout, .algorithm = options_.algorithm};
  }

  Transport* transport_;
  Compressor compressor_;
  pipeline_options options_;
  std::optional<detail::pipeline_tags> tags_;
  std::vector<std::unique_ptr<bucket>> buckets_;
};

template <transport Transport, class Compressor>
struct exchange_for<Transport, Compressor> {
  using type = flat_exchange<Transport, Compressor>;
};

}  // namespace stellatrain
