// SPDX-License-Identifier: Apache-2.0
// The state and the steps of one bucket's hierarchical exchange: a dense reduce-scatter inside
// the cluster (LAN), selection with error feedback of this rank's shard of the cluster's sum, a
// sparse exchange with the owners of overlapping shards in the other clusters (WAN), the merge,
// and an all-gather of the merged shards inside the cluster (LAN).
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/detail/bucket_message.hpp>
#include <stellatrain/pipeline/detail/shard_layout.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace stellatrain::detail {

// What every bucket of a hierarchical exchange shares: the two tiers and the settings.
template <class Transport>
struct hierarchical_context {
  Transport* lan = nullptr;
  Transport* wan = nullptr;
  reduction op = reduction::mean;
  index_encoding indices = index_encoding::automatic;
  std::chrono::milliseconds timeout{};
};

// The tags of one bucket's exchange at one step.
struct hierarchical_tags {
  tag_type reduce = 0;  // LAN
  tag_type wan = 0;
  tag_type gather = 0;  // LAN
};

// One bucket: its layout, selections, messages and the merged update, kept between steps so
// that a warm exchange allocates little.
template <transport Transport, class Value, class Index>
class hierarchical_bucket {
 public:
  hierarchical_bucket(const hierarchical_context<Transport>& links, const cluster_topology& topo,
                      int rank, std::span<const bucket_tensor> tensors,
                      std::uint32_t& next_compressor_id)
      : tensors_(tensors.begin(), tensors.end()),
        layout_(make_shard_layout(topo, rank, tensors, next_compressor_id)),
        clusters_(topo.clusters()),
        cluster_(topo.cluster_of(rank)),
        ranks_(topo.ranks()),
        links_(links),
        lan_first_(topo.first_rank(topo.cluster_of(rank))) {
    for (const auto& t : tensors_) unpacker_.register_tensor(t.id, t.size);
    selections_.resize(layout_.pieces.size());
    own_float_.resize(layout_.pieces.size());
    merged_.resize(layout_.pieces.size());
    from_peer_.resize(layout_.peers.size());
    for (auto& p : from_peer_) p.resize(layout_.pieces.size());
    received_.resize(layout_.peers.size());
    lan_received_.resize(static_cast<std::size_t>(topo.size_of(cluster_)));
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      const auto& p = layout_.pieces[i];
      const auto& t = tensors_[p.tensor];
      const std::uint64_t len = p.end - p.begin;
      piece_unpacker_.register_tensor(static_cast<std::uint32_t>(i), len);
      selections_[i].reserve(len, {.prefault = false});
      own_float_[i].reserve(len, {.prefault = false});
      merged_[i].set_dense_size(t.size);
    }
  }

  [[nodiscard]] const shard_layout& layout() const noexcept { return layout_; }

  // Registers the shard's pieces with the compressor (their residuals).
  template <class Compressor, class Executor>
  void add_to(Compressor& compressor, Executor& ex) const {
    for (const auto& p : layout_.pieces)
      compressor.add_tensor(ex, p.compressor_id, p.end - p.begin);
  }

  // The whole exchange of `step`: reduce `grad` (the bucket, concatenated; overwritten) inside
  // the cluster, select this rank's shard with error feedback (k by `rule`), exchange with the
  // overlapping shards of the other clusters, merge, and gather the cluster's merged shards;
  // afterwards `update(step, i)` holds tensor i's averaged (or summed) update, the same on
  // every rank of every cluster. `reports` (may be empty) goes with every message; the
  // reports of every message received go to `sink`.
  template <class Compressor, class Executor>
  exchange_traffic run(std::int64_t step, const hierarchical_tags& tags, std::span<float> grad,
                       const selection_rule& rule, std::span<const std::byte> reports,
                       Compressor& compressor, Executor& ex, report_sink sink) {
    const hierarchical_context<Transport>& links = links_;
    dense_reduce_scatter(*links.lan, grad, {.tag = tags.reduce, .timeout = links.timeout}, lan_ws_);
    exchange_traffic res;
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      const auto& p = layout_.pieces[i];
      const auto& t = tensors_[p.tensor];
      const std::uint64_t len = p.end - p.begin;
      auto& sel = selections_[i];
      sel.set_dense_size(len);
      compressor.compress(
          ex, p.compressor_id,
          std::span<const float>(grad.data() + t.offset + p.begin, static_cast<std::size_t>(len)),
          rule.k(t.size, len), sel);
      // From here on in the tensor's own indices.
      for (auto& x : sel.indices()) x = static_cast<Index>(x + p.begin);
      sel.set_dense_size(t.size);
      res.elements += sel.size();
    }
    exchange_wan(step, tags.wan, reports, compressor, ex, res);
    res.link_bytes = res.sent_bytes;
    for (std::size_t q = 0; q < layout_.peers.size(); ++q)
      decode_peer(q, per_piece<Compressor>(layout_.peers[q]), step, ex, sink);
    merge(ex);
    gather_lan(step, tags.gather, reports, ex, sink);
    return res;
  }

  // Tensor `tensor`'s update of `step` (kept until the exchange of step + 2).
  [[nodiscard]] const sparse_buffer<float, Index>& update(std::int64_t step,
                                                          std::size_t tensor) const {
    return updates_[static_cast<std::size_t>(step % 2)][tensor];
  }

 private:
  // The pieces of tensor `tensor` in this rank's shard.
  std::size_t piece_of(std::uint32_t id) const noexcept {
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i)
      if (tensors_[layout_.pieces[i].tensor].id == id) return i;
    return npos;
  }

  // Whether the selections for peer `p` travel per piece, as the compressor encoded them
  // (chunked sections, section id = the piece's index in the layout): where the compressor has
  // a wire section of its own and the peer holds the same pieces. Elsewhere they travel per
  // tensor, cut to the overlap, as pairs.
  template <class Compressor>
  static bool per_piece(const shard_peer& p) noexcept {
    return packs_chunked<Compressor> && p.same_shard;
  }

  template <class Compressor, class Executor>
  void exchange_wan(std::int64_t step, tag_type tag, std::span<const std::byte> reports,
                    const Compressor& compressor, Executor& ex, exchange_traffic& res) {
    const hierarchical_context<Transport>& links = links_;
    Transport& wan = *links.wan;
    const auto& peers = layout_.peers;
    if (peers.empty()) return;
    const auto ctx = make_context(wan, "hierarchical exchange", "shard peers", tag, links.timeout);
    // One message per distinct overlap (with equal cluster sizes every peer gets the same).
    messages_.resize(peers.size());
    std::size_t distinct = 0;
    std::vector<std::size_t>& message_of = message_of_;
    message_of.assign(peers.size(), 0);
    for (std::size_t q = 0; q < peers.size(); ++q) {
      std::size_t same = npos;
      for (std::size_t e = 0; e < q; ++e)
        if (peers[e].begin == peers[q].begin && peers[e].end == peers[q].end) same = message_of[e];
      if (same != npos) {
        message_of[q] = same;
        continue;
      }
      packer_.clear(static_cast<std::uint64_t>(step));
      for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
        if constexpr (packs_chunked<Compressor>) {
          if (per_piece<Compressor>(peers[q])) {
            packer_.add_chunked(static_cast<std::uint32_t>(i),
                                compressor.wire_section(layout_.pieces[i].compressor_id));
            continue;
          }
        }
        const auto& t = tensors_[layout_.pieces[i].tensor];
        const auto v = std::as_const(selections_[i]).view();
        // The pairs inside the overlap, in the tensor's indices.
        const std::uint64_t lo = peers[q].begin > t.offset ? peers[q].begin - t.offset : 0;
        const std::uint64_t hi = std::min(peers[q].end - std::min(peers[q].end, t.offset), t.size);
        if (lo >= hi) continue;
        const auto idx = v.indices();
        const auto b = std::lower_bound(idx.begin(), idx.end(), lo) - idx.begin();
        const auto e = std::lower_bound(idx.begin(), idx.end(), hi) - idx.begin();
        packer_.add(
            t.id,
            sparse_view<const Value, const Index>(
                idx.subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(e - b)),
                v.values().subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(e - b)),
                t.size),
            {.indices = links.indices, .values = value_encoding_of<Value>});
      }
      if (!reports.empty()) packer_.add_control(control_type::step_reports, reports);
      auto& out = messages_[distinct];
      out.resize(packer_.prepare(ex));
      packer_.write(out, ex);
      message_of[q] = distinct++;
    }
    res.message_bytes = messages_[message_of[0]].size();
    wan_ws_.release_requests();
    res.link_begin = transport_clock::now();
    // Each message as its length and then chunks of the transport's preferred size, as the
    // collectives send theirs: on MPI a whole message above the eager limit would wait for a
    // rendezvous round trip, and TCP would idle during it.
    const std::uint64_t chunk = chunk_bytes_for(wan, auto_chunk_bytes);
    auto& lengths = wan_ws_.lengths;  // the peers' lengths, then those of the distinct messages
    lengths.resize(peers.size() + distinct);
    for (std::size_t m = 0; m < distinct; ++m)
      lengths[peers.size() + m] = encode_length(messages_[m].size());
    run_collective(wan, wan_ws_, /*abort_on_failure=*/true, [&] {
      for (std::size_t q = 0; q < peers.size(); ++q)
        wan_ws_.recvs.push_back(wan.irecv(peers[q].rank, tag, lengths[q]));
      for (std::size_t q = 0; q < peers.size(); ++q) {
        const std::span<const std::byte> m(messages_[message_of[q]]);
        wan_ws_.sends.push_back(
            wan.isend(peers[q].rank, tag, lengths[peers.size() + message_of[q]]));
        for (std::uint64_t c = 0; c < message_chunk_count(m.size(), chunk); ++c)
          wan_ws_.sends.push_back(wan.isend(peers[q].rank, tag, message_chunk(m, chunk, c)));
        res.sent_bytes += m.size();
      }
      auto who = [&](std::size_t q) {
        return "rank " + std::to_string(peers[q].rank) + " (cluster " +
               std::to_string(peers[q].cluster) + ")";
      };
      std::vector<std::size_t>& first_chunk = wan_ws_.marks;
      first_chunk.assign(peers.size() + 1, 0);
      for (std::size_t q = 0; q < peers.size(); ++q) {
        await(wan_ws_.recvs[q], ctx, [&] { return "the length of the selection of " + who(q); });
        const std::uint64_t n =
            decode_length(lengths[q], allgather_options{}.max_message_bytes, ctx, peers[q].rank);
        received_[q].resize_for_overwrite(static_cast<std::size_t>(n));
        first_chunk[q] = wan_ws_.recvs.size();
        for (std::uint64_t c = 0; c < message_chunk_count(n, chunk); ++c)
          wan_ws_.recvs.push_back(
              wan.irecv(peers[q].rank, tag, message_chunk(received_[q].span(), chunk, c)));
      }
      first_chunk[peers.size()] = wan_ws_.recvs.size();
      for (std::size_t q = 0; q < peers.size(); ++q) {
        for (std::size_t i = first_chunk[q]; i < first_chunk[q + 1]; ++i) {
          await(wan_ws_.recvs[i], ctx, [&] {
            return "chunk " + std::to_string(i - first_chunk[q] + 1) + " of " +
                   std::to_string(first_chunk[q + 1] - first_chunk[q]) + " of the selection of " +
                   who(q);
          });
        }
      }
      await_sends(wan_ws_, ctx);
    });
    res.link_end = transport_clock::now();
  }

  // Decodes the message of peer q into from_peer_[q], checking that every section lies in
  // this rank's shard (where a peer's selection must be). `pieces`: its sections are this
  // rank's pieces by index (`per_piece`), each of the piece's length, else tensors.
  template <class Executor>
  void decode_peer(std::size_t q, bool pieces, std::int64_t step, Executor& ex, report_sink sink) {
    const int from = layout_.peers[q].rank;
    auto who = [&] { return tier_name(from, "the WAN"); };
    const message_buffer& m = received_[q];
    message_unpacker& u = pieces ? piece_unpacker_ : unpacker_;
    const message_info& info = read_bucket_message(
        u, std::span<const std::byte>(m.data(), m.size()), step, from, ex, sink, who);
    for (std::size_t s = 0; s < info.sections.size(); ++s) {
      const section_info& sec = info.sections[s];
      const std::size_t piece = pieces ? sec.tensor : piece_of(sec.tensor);
      if (piece == npos) {
        throw_error(errc::malformed_message, who() + " sent tensor " + std::to_string(sec.tensor) +
                                                 ", which has no element in this rank's shard");
      }
      auto& dst = from_peer_[q][piece];
      dst.resize(0);
      dst.reserve(sec.count, {.prefault = false});
      dst.set_dense_size(sec.dense_size);
      u.decode(s, dst, ex);
      const auto& p = layout_.pieces[piece];
      if (pieces) {
        // The unpacker took only the pieces' ids, at their lengths: every index lies in the
        // piece, counted from its start.
        for (auto& x : dst.indices()) x = static_cast<Index>(x + p.begin);
        continue;
      }
      if (dst.size() > 0 && (dst.indices().front() < p.begin || dst.indices().back() >= p.end)) {
        throw_error(errc::malformed_message,
                    who() + " sent indices of tensor " + std::to_string(sec.tensor) +
                        " outside this rank's shard [" + std::to_string(p.begin) + ", " +
                        std::to_string(p.end) + ")");
      }
    }
  }

  // Sums, per piece, every cluster's contribution in cluster order (this rank's own at its
  // cluster's place), so that the owner of the same elements in every cluster computes the
  // same bits; then scales for the mean over all ranks.
  template <class Executor>
  void merge(Executor& ex) {
    const float scale = links_.op == reduction::mean ? 1.0f / static_cast<float>(ranks_) : 1.0f;
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      const auto& t = tensors_[layout_.pieces[i].tensor];
      // This rank's own pairs in float, as the peers decode them.
      auto& own = own_float_[i];
      const auto sel = std::as_const(selections_[i]).view();
      own.reserve(sel.size(), {.prefault = false});
      own.resize(sel.size());
      own.set_dense_size(t.size);
      std::copy(sel.indices().begin(), sel.indices().end(), own.indices().begin());
      for (std::size_t j = 0; j < sel.size(); ++j)
        own.values()[j] = stellatrain::to_float(sel.values()[j]);
      inputs_.clear();
      std::uint64_t total = 0;
      std::size_t q = 0;
      for (int c = 0; c < clusters_; ++c) {
        if (c == cluster_) {
          inputs_.push_back(std::as_const(own).view());
          total += own.size();
        }
        for (; q < layout_.peers.size() && layout_.peers[q].cluster == c; ++q) {
          auto& d = from_peer_[q][i];
          d.set_dense_size(t.size);
          inputs_.push_back(std::as_const(d).view());
          total += d.size();
        }
      }
      auto& out = merged_[i];
      out.set_dense_size(t.size);
      out.reserve(total, {.prefault = false});
      merger_.merge<float, Index>(std::span<const sparse_view<const float, const Index>>(inputs_),
                                  out, reduction::sum, ex);
      if (scale != 1.0f)
        for (auto& v : out.values()) v *= scale;
      // The peers' buffers are reused next step: forget this step's pairs.
      for (std::size_t p = 0; p < layout_.peers.size(); ++p) from_peer_[p][i].resize(0);
    }
  }

  template <class Executor>
  void gather_lan(std::int64_t step, tag_type tag, std::span<const std::byte> reports, Executor& ex,
                  report_sink sink) {
    const hierarchical_context<Transport>& links = links_;
    packer_.clear(static_cast<std::uint64_t>(step));
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      packer_.add(tensors_[layout_.pieces[i].tensor].id, std::as_const(merged_[i]).view(),
                  {.values = value_encoding::fp32});
    }
    if (!reports.empty()) packer_.add_control(control_type::step_reports, reports);
    lan_message_.resize(packer_.prepare(ex));
    packer_.write(lan_message_, ex);
    sparse_allgather(*links.lan, std::span<const std::byte>(lan_message_),
                     std::span<message_buffer>(lan_received_),
                     {.tag = tag, .timeout = links.timeout}, lan_ws_);
    // Every owner's merged shard, in local-rank order: ascending, disjoint ranges per tensor.
    auto& updates = updates_[static_cast<std::size_t>(step % 2)];
    updates.resize(tensors_.size());
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      updates[i].resize(0);
      updates[i].set_dense_size(tensors_[i].size);
    }
    const int first = lan_first_;
    for (std::size_t j = 0; j < lan_received_.size(); ++j) {
      const message_buffer& m = lan_received_[j];
      const int from = first + static_cast<int>(j);
      auto who = [&] { return tier_name(from, "the LAN"); };
      const message_info& info = read_bucket_message(
          unpacker_, std::span<const std::byte>(m.data(), m.size()), step, from, ex, sink, who);
      for (std::size_t s = 0; s < info.sections.size(); ++s) {
        const section_info& sec = info.sections[s];
        const std::size_t t = tensor_in_bucket(tensors_, sec.tensor, who);
        scratch_.resize(0);
        scratch_.reserve(sec.count, {.prefault = false});
        scratch_.set_dense_size(sec.dense_size);
        unpacker_.decode(s, scratch_, ex);
        auto& u = updates[t];
        const std::size_t at = u.size();
        if (scratch_.size() > 0 && at > 0 && scratch_.indices().front() <= u.indices()[at - 1]) {
          throw_error(errc::malformed_message, who() + " sent tensor " +
                                                   std::to_string(sec.tensor) +
                                                   " indices that overlap an earlier shard's");
        }
        grow(u, at + scratch_.size());
        std::copy(scratch_.indices().begin(), scratch_.indices().end(), u.indices().begin() + at);
        std::copy(scratch_.values().begin(), scratch_.values().end(), u.values().begin() + at);
      }
    }
  }

  static void grow(sparse_buffer<float, Index>& b, std::uint64_t n) {
    if (n > b.capacity())
      b.reserve(std::max<std::uint64_t>(n, 2 * b.capacity()), {.prefault = false});
    b.resize(n);
  }

  static std::string tier_name(int from, const char* tier) {
    return "hierarchical exchange: rank " + std::to_string(from) + " over " + tier;
  }

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::vector<bucket_tensor> tensors_;
  shard_layout layout_;
  int clusters_ = 1;
  int cluster_ = 0;
  int ranks_ = 1;
  hierarchical_context<Transport> links_;
  int lan_first_ = 0;  // global rank of the cluster's local rank 0
  std::uint64_t elements_ = 0;
  std::vector<sparse_buffer<Value, Index>> selections_;              // per piece, tensor indices
  std::vector<sparse_buffer<float, Index>> own_float_;               // per piece
  std::vector<std::vector<sparse_buffer<float, Index>>> from_peer_;  // [peer][piece]
  std::vector<sparse_buffer<float, Index>> merged_;                  // per piece
  std::vector<sparse_buffer<float, Index>> updates_[2];  // [step % 2][tensor of the bucket]
  sparse_buffer<float, Index> scratch_;
  std::vector<sparse_view<const float, const Index>> inputs_;
  std::vector<std::vector<std::byte>> messages_;
  std::vector<std::size_t> message_of_;
  std::vector<message_buffer> received_;  // per peer
  std::vector<std::byte> lan_message_;
  std::vector<message_buffer> lan_received_;  // per local rank
  message_packer packer_;
  message_unpacker unpacker_;
  message_unpacker piece_unpacker_;  // the pieces by index, at their lengths (`per_piece`)
  sparse_merger merger_;
  collective_workspace<Transport> lan_ws_;
  collective_workspace<Transport> wan_ws_;
};

}  // namespace stellatrain::detail
