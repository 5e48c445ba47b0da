// SPDX-License-Identifier: Apache-2.0
// The hierarchical exchange strategy, across clusters: a dense reduce-scatter inside the
// cluster (LAN), selection with error feedback of each rank's shard of the cluster's sum, a
// sparse exchange among the owners of overlapping shards in the other clusters (WAN), the
// merge, and an all-gather of the merged shards inside the cluster (LAN). Each cluster's
// uplink carries its selection once per other cluster, not once per rank.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pipeline/detail/hierarchical_bucket.hpp>
#include <stellatrain/pipeline/detail/start_checks.hpp>
#include <stellatrain/pipeline/detail/step_accounting.hpp>
#include <stellatrain/pipeline/detail/tags.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

/// The two tiers of a hierarchical pipeline, as the application connects them:
/// - `lan`: the ranks of this rank's cluster (size = the cluster's size, rank = the local
///   rank; any backend: in-process, MPI on a sub-communicator, ZeroMQ on the cluster's hosts);
/// - `wan`: every rank of every cluster (size = `topology.ranks()`, rank = the global rank, in
///   cluster order); only messages between clusters travel on it;
/// - `topology`: the clusters, the same on every rank (checked at `start`).
template <transport Transport>
struct hierarchical_links {
  Transport& lan;
  Transport& wan;
  cluster_topology topology;
};

/// The hierarchical `exchange_strategy` (the multi-cluster setting), built by the pipeline
/// from `hierarchical_links`: `pipeline p(hierarchical_links<T>{lan, wan, topology},
/// executor, compressor, optimizer, ...)`. Per bucket and step, all on an exchange thread:
/// 1. `dense_reduce_scatter` of the bucket over the cluster's LAN (fp32): rank j of a cluster
///    of G ends with the sum over its cluster of segment j (`segment_of`).
/// 2. Error-feedback compression of that shard, in pieces aligned to the tensors (the
///    compressor's ids are piece ids, so the residuals stay per shard).
/// 3. Over the WAN, each rank sends its packed shard only to the ranks of other clusters
///    whose shard overlaps it, as its length and then chunks of the transport's preferred
///    size, and decodes theirs after checking every index against the range. A compressor
///    with a wire section of its own (`chunked_compressor`) sends it per piece to an owner of
///    the same shard (clusters of one size); other overlaps travel as pairs.
/// 4. The merged shard (its own values plus the others', summed in cluster order, scaled for
///    the mean) is all-gathered over the LAN, so that every rank applies the same update.
/// `rank()` and `ranks()` of the pipeline are the WAN's (global) ones; `start` checks every
/// rank's topology and links against rank 0's. A selection handed over in place of a
/// gradient cannot be reduced inside the cluster: such a pipeline has no `push_selection`.
template <transport Transport, compressor Compressor>
class hierarchical_exchange {
  using bucket = detail::hierarchical_bucket<Transport, typename Compressor::value_type,
                                             typename Compressor::index_type>;

 public:
  using transport_type = Transport;
  using compressor_type = Compressor;
  using value_type = typename Compressor::value_type;
  using index_type = typename Compressor::index_type;
  using links_type = hierarchical_links<Transport>;
  static constexpr bool takes_selections = false;

  hierarchical_exchange(hierarchical_links<Transport> links, Compressor compressor)
      : lan_(&links.lan),
        wan_(&links.wan),
        topology_(std::move(links.topology)),
        compressor_(std::move(compressor)) {}

  [[nodiscard]] Transport& transport() noexcept { return *wan_; }
  [[nodiscard]] Compressor& compressor() noexcept { return compressor_; }

  void start(const pipeline_options& options) {
    options_ = options;
    detail::check_topology(*lan_, *wan_, topology_,
                           detail::pipeline_tags(options.tag_base, 0).topology(), options.timeout);
  }

  template <class Executor>
  void add_bucket(std::span<const bucket_tensor> tensors, Executor& ex) {
    const detail::hierarchical_context<Transport> links{.lan = lan_,
                                                        .wan = wan_,
                                                        .op = options_.op,
                                                        .indices = options_.wire_indices,
                                                        .timeout = options_.timeout};
    auto b = std::make_unique<bucket>(links, topology_, wan_->rank(), tensors, pieces_);
    b->add_to(compressor_, ex);
    std::uint64_t largest = 0;
    for (const auto& t : tensors) largest = std::max(largest, t.size);
    tensors_.emplace_back(tensors.begin(), tensors.end());
    dense_.emplace_back(largest, buffer_options{.prefault = true}, ex);
    buckets_.push_back(std::move(b));
    tags_.emplace(options_.tag_base, buckets_.size());
  }

  /// Nothing: the selection needs the cluster's sum, which `exchange` reduces first.
  template <class Executor>
  exchange_traffic encode(std::size_t, std::int64_t, const bucket_input<value_type, index_type>&,
                          Executor&) {
    return {};
  }

  /// Steps 1 to 4 for bucket `b`; the link span it reports is the WAN messages' alone (the
  /// LAN collectives and the selection around them would otherwise count as transfer time,
  /// and a lower density would then look like a slower link).
  template <class Executor>
  exchange_traffic exchange(std::size_t b, std::int64_t step,
                            const bucket_input<value_type, index_type>& in, Executor& ex,
                            report_sink sink) {
    const detail::pipeline_tags& tags = *tags_;
    // All of it is counted as stage work, the LAN collectives' CPU time included.
    const double cpu0 = detail::thread_cpu_seconds();
    exchange_traffic t = buckets_[b]->run(step,
                                          {.reduce = tags.cluster_reduce(step, b),
                                           .wan = tags.exchange(step, b),
                                           .gather = tags.cluster_gather(step, b)},
                                          in.gradient, in.rule, in.reports, compressor_, ex, sink);
    t.cpu_seconds = detail::thread_cpu_seconds() - cpu0;
    return t;
  }

  /// Nothing: `exchange` decoded and merged.
  template <class Executor>
  void decode(std::size_t, std::int64_t, Executor&, report_sink) {}

  /// Tensor `i` of bucket `b`, as the cluster gathered it: sparse, or scattered into a dense
  /// gradient where it holds more than `pipeline_options::dense_threshold` pairs per element.
  template <class Executor>
  merged_update<index_type> update(std::size_t b, std::int64_t step, std::size_t i, Executor&) {
    const auto& u = buckets_[b]->update(step, i);
    const std::uint64_t n = tensors_[b][i].size;
    if (choose_aggregate(u.size(), n, options_.dense_threshold) == aggregate_kind::sparse)
      return {.kind = aggregate_kind::sparse, .sparse = u.view()};
    float* d = dense_[b].data();
    std::fill(d, d + n, 0.0f);
    for (std::uint64_t j = 0; j < u.size(); ++j)
      d[static_cast<std::size_t>(u.indices()[j])] = u.values()[j];
    return {.kind = aggregate_kind::dense,
            .dense = std::span<const float>(d, static_cast<std::size_t>(n))};
  }

  /// A cluster's uplink carries each of its G owners' selections (1/G of the elements each) to
  /// each other cluster: per owner, the flat model over C ranks with 1/G of the elements, at
  /// the owner's share of the uplink (what it measures, as all G send at once).
  [[nodiscard]] exchange_shape shape() const {
    const int c = topology_.cluster_of(wan_->rank());
    return {.ranks = static_cast<std::uint32_t>(topology_.clusters()),
            .share = static_cast<std::uint32_t>(topology_.size_of(c)),
            .rounds = 1};
  }

  /// Its cluster and the ranks of other clusters that share a shard with it. Each cluster may
  /// choose its own density: every rank still applies the same update, as the exchange does
  /// not depend on the densities agreeing.
  [[nodiscard]] std::vector<int> report_sources() const {
    std::vector<int> heard;
    const int c = topology_.cluster_of(wan_->rank());
    for (int j = 0; j < topology_.size_of(c); ++j) heard.push_back(topology_.global_rank(c, j));
    for (const auto& b : buckets_)
      for (const auto& peer : b->layout().peers) heard.push_back(peer.rank);
    std::sort(heard.begin(), heard.end());
    heard.erase(std::unique(heard.begin(), heard.end()), heard.end());
    return heard;
  }

  void abort(std::string_view why) noexcept {
    detail::abort_transport(*wan_, why);
    detail::abort_transport(*lan_, why);
  }

 private:
  Transport* lan_;
  Transport* wan_;
  cluster_topology topology_;
  Compressor compressor_;
  pipeline_options options_;
  std::optional<detail::pipeline_tags> tags_;
  std::uint32_t pieces_ = 0;  // the compressor's ids of the shards' pieces so far
  std::vector<std::unique_ptr<bucket>> buckets_;
  std::vector<std::vector<bucket_tensor>> tensors_;  // per bucket
  std::vector<aligned_buffer<float>> dense_;         // per bucket: its largest tensor's size
};

template <class Transport, class Compressor>
struct exchange_for<hierarchical_links<Transport>, Compressor> {
  using type = hierarchical_exchange<Transport, Compressor>;
};

}  // namespace stellatrain
