// SPDX-License-Identifier: Apache-2.0
// Who owns what of a bucket in a hierarchical exchange: this rank's shard of the bucket, the
// pieces of tensors inside it, and the ranks of other clusters whose shards overlap it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/cluster_topology.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace stellatrain::detail {

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
  // Its shard is this rank's (clusters of one size): both hold the same pieces, in the same
  // order, so a selection can travel per piece as the compressor encoded it.
  bool same_shard = false;
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
      if (b < e) {
        L.peers.push_back({.rank = topo.global_rank(c, j),
                           .cluster = c,
                           .begin = b,
                           .end = e,
                           .same_shard = theirs.begin == L.mine.begin && theirs.end == L.mine.end});
      }
    }
  }
  return L;
}

}  // namespace stellatrain::detail
