// SPDX-License-Identifier: Apache-2.0
// Which cluster each rank belongs to: the clusters of the multi-cluster setting (fast links
// inside a cluster, one shared slow uplink out of each), given by the application or by the
// environment, and checked to agree on every rank.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace stellatrain {

/// Ranks grouped into clusters, in rank order: cluster 0 holds ranks [0, sizes[0]), cluster 1
/// the next sizes[1] ranks, and so on. A rank's place in its cluster is its `local_rank`.
///
/// The hierarchical exchange (pipeline/pipeline.hpp, `hierarchical_transports`) runs a LAN
/// transport per cluster (its ranks are the local ranks) and a WAN transport over all ranks
/// (its ranks are the global ones); the topology says how the two number the same rank.
///
/// \code
///   auto topo = stellatrain::cluster_topology::parse("2,2");   // or from_environment(P)
///   topo.cluster_of(3);   // 1
///   topo.local_rank(3);   // 1
/// \endcode
class cluster_topology {
 public:
  /// Clusters of the given sizes; throws `errc::invalid_argument` for no cluster, an empty
  /// cluster, or more than INT_MAX ranks.
  explicit cluster_topology(std::vector<int> sizes) : sizes_(std::move(sizes)) {
    if (sizes_.empty()) throw_error(errc::invalid_argument, "cluster_topology: no cluster");
    long long total = 0;
    for (std::size_t c = 0; c < sizes_.size(); ++c) {
      if (sizes_[c] < 1) {
        throw_error(errc::invalid_argument, "cluster_topology: cluster " + std::to_string(c) +
                                                " has " + std::to_string(sizes_[c]) +
                                                " ranks, needs at least 1");
      }
      total += sizes_[c];
      if (total > std::numeric_limits<int>::max()) {
        throw_error(errc::invalid_argument, "cluster_topology: more than 2^31 - 1 ranks");
      }
    }
    first_.reserve(sizes_.size() + 1);
    int at = 0;
    for (int s : sizes_) {
      first_.push_back(at);
      at += s;
    }
    first_.push_back(at);
  }

  /// One rank per cluster: every link is a WAN link (the flat setting).
  [[nodiscard]] static cluster_topology flat(int ranks) {
    return cluster_topology(std::vector<int>(static_cast<std::size_t>(check_ranks(ranks)), 1));
  }

  /// All ranks in one cluster (no WAN link).
  [[nodiscard]] static cluster_topology single(int ranks) {
    return cluster_topology(std::vector<int>{check_ranks(ranks)});
  }

  /// Parses comma-separated cluster sizes such as "2,2" or "3,1" (decimal digits and commas
  /// only); anything else is `errc::invalid_argument`, naming the text.
  [[nodiscard]] static cluster_topology parse(std::string_view text) {
    auto bad = [&](const std::string& why) {
      throw_error(errc::invalid_argument, "cluster_topology: \"" + std::string(text) +
                                              "\" is not a list of cluster "
                                              "sizes such as 2,2: " +
                                              why);
    };
    std::vector<int> sizes;
    long long value = 0;
    bool digits = false;
    for (std::size_t i = 0; i <= text.size(); ++i) {
      if (i == text.size() || text[i] == ',') {
        if (!digits) bad("an empty entry");
        sizes.push_back(static_cast<int>(value));
        value = 0;
        digits = false;
      } else if (text[i] >= '0' && text[i] <= '9') {
        value = value * 10 + (text[i] - '0');
        if (value > std::numeric_limits<int>::max()) bad("a size above 2^31 - 1");
        digits = true;
      } else {
        bad(std::string("the character '") + text[i] + "'");
      }
    }
    return cluster_topology(std::move(sizes));
  }

  /// The topology in the environment variable `variable` (format of `parse`), checked against
  /// the world size; without the variable, `flat(world_size)`. Throws `errc::invalid_argument`
  /// when the variable does not parse or its sizes do not add up to `world_size`.
  [[nodiscard]] static cluster_topology from_environment(
      int world_size, const char* variable = "STELLATRAIN_CLUSTERS") {
    const char* text = std::getenv(variable);
    if (text == nullptr || *text == '\0') return flat(world_size);
    cluster_topology t = [&] {
      try {
        return parse(text);
      } catch (const error& e) {
        throw error(errc::invalid_argument, std::string(variable) + ": " + e.what());
      }
    }();
    t.check_world(world_size, variable);
    return t;
  }

  /// Throws `errc::invalid_argument` unless the clusters hold exactly `world_size` ranks.
  void check_world(int world_size, std::string_view who = "cluster_topology") const {
    if (world_size != ranks()) {
      throw_error(errc::invalid_argument, std::string(who) + ": clusters " + to_string() +
                                              " hold " + std::to_string(ranks()) +
                                              " ranks, the world has " +
                                              std::to_string(world_size));
    }
  }

  [[nodiscard]] int clusters() const noexcept { return static_cast<int>(sizes_.size()); }
  [[nodiscard]] int ranks() const noexcept { return first_.back(); }
  [[nodiscard]] const std::vector<int>& sizes() const noexcept { return sizes_; }

  /// Ranks of cluster `c`.
  [[nodiscard]] int size_of(int c) const { return sizes_[check_cluster(c)]; }
  /// The global rank of cluster `c`'s local rank 0.
  [[nodiscard]] int first_rank(int c) const { return first_[check_cluster(c)]; }
  /// The cluster of global rank `rank`.
  [[nodiscard]] int cluster_of(int rank) const {
    check_rank(rank);
    int c = 0;
    while (first_[static_cast<std::size_t>(c) + 1] <= rank) ++c;
    return c;
  }
  /// The place of global rank `rank` in its cluster.
  [[nodiscard]] int local_rank(int rank) const { return rank - first_rank(cluster_of(rank)); }
  /// The global rank of local rank `local` of cluster `c`.
  [[nodiscard]] int global_rank(int c, int local) const {
    if (local < 0 || local >= size_of(c)) {
      throw_error(errc::out_of_range, "cluster_topology: cluster " + std::to_string(c) +
                                          " has no local rank " + std::to_string(local));
    }
    return first_rank(c) + local;
  }

  /// "2,2": the format of `parse`.
  [[nodiscard]] std::string to_string() const {
    std::string s;
    for (std::size_t c = 0; c < sizes_.size(); ++c) {
      if (c > 0) s += ',';
      s += std::to_string(sizes_[c]);
    }
    return s;
  }

  friend bool operator==(const cluster_topology& a, const cluster_topology& b) noexcept {
    return a.sizes_ == b.sizes_;
  }

 private:
  static int check_ranks(int ranks) {
    if (ranks < 1) {
      throw_error(errc::invalid_argument,
                  "cluster_topology: " + std::to_string(ranks) + " ranks, needs at least 1");
    }
    return ranks;
  }
  std::size_t check_cluster(int c) const {
    if (c < 0 || c >= clusters()) {
      throw_error(errc::out_of_range, "cluster_topology: no cluster " + std::to_string(c) + " (" +
                                          std::to_string(clusters()) + " clusters)");
    }
    return static_cast<std::size_t>(c);
  }
  void check_rank(int rank) const {
    if (rank < 0 || rank >= ranks()) {
      throw_error(errc::out_of_range, "cluster_topology: no rank " + std::to_string(rank) + " (" +
                                          std::to_string(ranks()) + " ranks)");
    }
  }

  std::vector<int> sizes_;
  std::vector<int> first_;  // first global rank of each cluster, then the total
};

}  // namespace stellatrain
