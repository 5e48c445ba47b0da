// SPDX-License-Identifier: Apache-2.0
// The exchange of one gradient bucket across clusters: a dense reduce-scatter inside the
// cluster (LAN), selection with error feedback of each rank's shard of the cluster's sum, a
// sparse exchange among the owners of overlapping shards in the other clusters (WAN), the
// merge, and an all-gather of the merged shards inside the cluster (LAN). Each cluster's
// uplink carries its selection once per other cluster, not once per rank.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
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

namespace detail {

// A tensor of a bucket: its wire id, its size, where it starts in the bucket.
struct bucket_tensor {
  std::uint32_t id = 0;
  std::uint64_t size = 0;
  std::uint64_t offset = 0;
};

// The part of a tensor inside this rank's shard: [begin, end) in the tensor's own indices.
struct shard_piece {
  std::size_t tensor = 0;  // index in the bucket
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint32_t compressor_id = 0;  // the piece's residual in the compressor
};

// A rank of another cluster whose shard overlaps this rank's: both send each other their
// selection inside the overlap [begin, end) (bucket coordinates).
struct shard_peer {
  int rank = 0;  // global (WAN) rank
  int cluster = 0;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

// Who owns what of an n-element bucket: local rank j of cluster c owns segment j of n over the
// cluster's size (`segment_of`). Computed identically on every rank.
struct shard_layout {
  segment_range mine;
  std::vector<shard_piece> pieces;
  std::vector<shard_peer> peers;  // by cluster, then local rank: ascending ranges per cluster
};

inline shard_layout make_shard_layout(const cluster_topology& topo, int rank,
                                      std::span<const bucket_tensor> tensors,
                                      std::uint32_t& next_compressor_id) {
  std::uint64_t n = 0;
  for (const auto& t : tensors) n = std::max(n, t.offset + t.size);
  const int cluster = topo.cluster_of(rank);
  shard_layout L;
  L.mine = segment_of(n, topo.size_of(cluster), topo.local_rank(rank));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::uint64_t b = std::max(L.mine.begin, tensors[i].offset);
    const std::uint64_t e = std::min(L.mine.end, tensors[i].offset + tensors[i].size);
    if (b < e) {
      L.pieces.push_back({.tensor = i,
                          .begin = b - tensors[i].offset,
                          .end = e - tensors[i].offset,
                          .compressor_id = next_compressor_id++});
    }
  }
  if (L.mine.size() == 0) return L;
  for (int c = 0; c < topo.clusters(); ++c) {
    if (c == cluster) continue;
    for (int j = 0; j < topo.size_of(c); ++j) {
      const auto theirs = segment_of(n, topo.size_of(c), j);
      const std::uint64_t b = std::max(L.mine.begin, theirs.begin);
      const std::uint64_t e = std::min(L.mine.end, theirs.end);
      if (b < e) L.peers.push_back({topo.global_rank(c, j), c, b, e});
    }
  }
  return L;
}

// What one hierarchical exchange of a bucket did on this rank.
struct hierarchical_result {
  std::uint64_t wan_bytes = 0;        // bytes this rank sent over the WAN
  std::uint64_t elements = 0;         // pairs this rank selected
  std::uint64_t selection_bytes = 0;  // its packed selection, once (the first peer's message)
  // When its WAN messages were in flight (equal when it had none): the span the density
  // controller's bandwidth estimate is measured over, without the LAN and selection work.
  transport_clock::time_point wan_begin{};
  transport_clock::time_point wan_end{};
};

// The state of one bucket's hierarchical exchange: its layout, selections, messages and the
// merged update, kept between steps so that a warm exchange allocates little.
template <transport Transport, class Value, class Index>
class hierarchical_bucket {
 public:
  hierarchical_bucket(const cluster_topology& topo, int rank,
                      std::span<const bucket_tensor> tensors, std::uint32_t& next_compressor_id)
      : tensors_(tensors.begin(), tensors.end()),
        layout_(make_shard_layout(topo, rank, tensors, next_compressor_id)),
        clusters_(topo.clusters()),
        cluster_(topo.cluster_of(rank)),
        ranks_(topo.ranks()),
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

  // Step 1 and 2: reduce the bucket inside the cluster, then select this rank's shard with
  // error feedback. `grad` (the bucket, concatenated) is read and overwritten; when this
  // returns it is no longer needed.
  template <class Compressor, class Executor, class K>
  void reduce_and_select(Transport& lan, std::span<float> grad, Compressor& compressor,
                         Executor& ex, K&& k_for, tag_type tag, std::chrono::milliseconds timeout) {
    dense_reduce_scatter(lan, grad, {.tag = tag, .timeout = timeout}, lan_ws_);
    elements_ = 0;
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      const auto& p = layout_.pieces[i];
      const auto& t = tensors_[p.tensor];
      const std::uint64_t len = p.end - p.begin;
      const std::span<const float> g(grad.data() + t.offset + p.begin,
                                     static_cast<std::size_t>(len));
      auto& sel = selections_[i];
      sel.set_dense_size(len);
      compressor.compress(ex, p.compressor_id, g, std::min<std::uint64_t>(len, k_for(t, len)), sel);
      // From here on in the tensor's own indices.
      for (auto& x : sel.indices()) x = static_cast<Index>(x + p.begin);
      sel.set_dense_size(t.size);
      elements_ += sel.size();
    }
  }

  // Steps 3 to 5: exchange with the overlapping shards of the other clusters, merge, and
  // gather the merged shards of the cluster; afterwards `update(i)` holds tensor i's averaged
  // (or summed) update, the same on every rank of every cluster. `reports` (may be empty) goes
  // with every message; `take_reports(global_rank, payload)` is called for every message
  // received that carries some.
  template <class Executor, class TakeReports>
  hierarchical_result exchange(Transport& lan, Transport& wan, std::int64_t step, reduction op,
                               index_encoding indices, std::span<const std::byte> reports,
                               Executor& ex, tag_type wan_tag, tag_type lan_tag,
                               std::chrono::milliseconds timeout, TakeReports&& take_reports) {
    hierarchical_result res;
    res.elements = elements_;
    exchange_wan(wan, step, indices, reports, ex, wan_tag, timeout, res);
    for (std::size_t q = 0; q < layout_.peers.size(); ++q) {
      const message_buffer& m = received_[q];
      decode_message(
          std::span<const std::byte>(m.data(), m.size()), step, layout_.peers[q].rank, "the WAN",
          ex, take_reports, [&](std::size_t piece) -> auto& { return from_peer_[q][piece]; });
    }
    merge(op, ex);
    gather_lan(lan, step, reports, ex, lan_tag, timeout, take_reports);
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

  template <class Executor>
  void exchange_wan(Transport& wan, std::int64_t step, index_encoding indices,
                    std::span<const std::byte> reports, Executor& ex, tag_type tag,
                    std::chrono::milliseconds timeout, hierarchical_result& res) {
    const auto& peers = layout_.peers;
    if (peers.empty()) return;
    const auto ctx = make_context(wan, "hierarchical exchange", "shard peers", tag, timeout);
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
            {.indices = indices, .values = value_encoding_of<Value>});
      }
      if (!reports.empty()) packer_.add_control(control_type::step_reports, reports);
      auto& out = messages_[distinct];
      out.resize(packer_.prepare(ex));
      packer_.write(out, ex);
      message_of[q] = distinct++;
    }
    res.selection_bytes = messages_[message_of[0]].size();
    wan_ws_.release_requests();
    res.wan_begin = transport_clock::now();
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
        res.wan_bytes += m.size();
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
    res.wan_end = transport_clock::now();
  }

  // Parses `from`'s message of `step`, checks its step and hands its step reports over.
  template <class Executor, class TakeReports>
  const message_info& parse_step(std::span<const std::byte> m, std::int64_t step, int from,
                                 const std::string& who, Executor& ex, TakeReports& take_reports) {
    const message_info& info = unpacker_.parse(m, ex);
    if (info.tag != static_cast<std::uint64_t>(step)) {
      throw_error(errc::malformed_message, who + " sent step " + std::to_string(info.tag) +
                                               " at step " + std::to_string(step));
    }
    if (const std::size_t c = unpacker_.find_control(control_type::step_reports);
        c != message_unpacker::npos) {
      take_reports(from, step, info.controls[c].payload);
    }
    return info;
  }

  // Parses one received message of `step` and decodes its sections into `out(piece)`, checking
  // that every section lies in this rank's shard (where a peer's selection must be).
  template <class Executor, class TakeReports, class Out>
  void decode_message(std::span<const std::byte> m, std::int64_t step, int from, const char* tier,
                      Executor& ex, TakeReports& take_reports, Out&& out) {
    const std::string who = "hierarchical exchange: rank " + std::to_string(from) + " over " + tier;
    const message_info& info = parse_step(m, step, from, who, ex, take_reports);
    for (std::size_t s = 0; s < info.sections.size(); ++s) {
      const section_info& sec = info.sections[s];
      const std::size_t piece = piece_of(sec.tensor);
      if (piece == npos) {
        throw_error(errc::malformed_message, who + " sent tensor " + std::to_string(sec.tensor) +
                                                 ", which has no element in this rank's shard");
      }
      auto& dst = out(piece);
      dst.resize(0);
      dst.reserve(sec.count, {.prefault = false});
      dst.set_dense_size(sec.dense_size);
      unpacker_.decode(s, dst, ex);
      const auto& p = layout_.pieces[piece];
      if (dst.size() > 0 && (dst.indices().front() < p.begin || dst.indices().back() >= p.end)) {
        throw_error(errc::malformed_message,
                    who + " sent indices of tensor " + std::to_string(sec.tensor) +
                        " outside this rank's shard [" + std::to_string(p.begin) + ", " +
                        std::to_string(p.end) + ")");
      }
    }
  }

  // Sums, per piece, every cluster's contribution in cluster order (this rank's own at its
  // cluster's place), so that the owner of the same elements in every cluster computes the
  // same bits; then scales for the mean over all ranks.
  template <class Executor>
  void merge(reduction op, Executor& ex) {
    const float scale = op == reduction::mean ? 1.0f / static_cast<float>(ranks_) : 1.0f;
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

  template <class Executor, class TakeReports>
  void gather_lan(Transport& lan, std::int64_t step, std::span<const std::byte> reports,
                  Executor& ex, tag_type tag, std::chrono::milliseconds timeout,
                  TakeReports& take_reports) {
    packer_.clear(static_cast<std::uint64_t>(step));
    for (std::size_t i = 0; i < layout_.pieces.size(); ++i) {
      packer_.add(tensors_[layout_.pieces[i].tensor].id, std::as_const(merged_[i]).view(),
                  {.values = value_encoding::fp32});
    }
    if (!reports.empty()) packer_.add_control(control_type::step_reports, reports);
    lan_message_.resize(packer_.prepare(ex));
    packer_.write(lan_message_, ex);
    sparse_allgather(lan, std::span<const std::byte>(lan_message_),
                     std::span<message_buffer>(lan_received_), {.tag = tag, .timeout = timeout},
                     lan_ws_);
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
      const std::string who =
          "hierarchical exchange: rank " + std::to_string(from) + " over the LAN";
      const message_info& info = parse_step(std::span<const std::byte>(m.data(), m.size()), step,
                                            from, who, ex, take_reports);
      for (std::size_t s = 0; s < info.sections.size(); ++s) {
        const section_info& sec = info.sections[s];
        std::size_t t = 0;
        while (t < tensors_.size() && tensors_[t].id != sec.tensor) ++t;
        if (t == tensors_.size()) {
          throw_error(errc::malformed_message,
                      who + " sent tensor " + std::to_string(sec.tensor) + ", not of this bucket");
        }
        scratch_.resize(0);
        scratch_.reserve(sec.count, {.prefault = false});
        scratch_.set_dense_size(sec.dense_size);
        unpacker_.decode(s, scratch_, ex);
        auto& u = updates[t];
        const std::size_t at = u.size();
        if (scratch_.size() > 0 && at > 0 && scratch_.indices().front() <= u.indices()[at - 1]) {
          throw_error(errc::malformed_message, who + " sent tensor " + std::to_string(sec.tensor) +
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

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  std::vector<bucket_tensor> tensors_;
  shard_layout layout_;
  int clusters_ = 1;
  int cluster_ = 0;
  int ranks_ = 1;
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
  sparse_merger merger_;
  collective_workspace<Transport> lan_ws_;
  collective_workspace<Transport> wan_ws_;
};

}  // namespace detail

}  // namespace stellatrain
