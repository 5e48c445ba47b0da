// SPDX-License-Identifier: Apache-2.0
// A subset of a transport's ranks seen as a transport of its own (as an MPI sub-communicator
// is): the ranks of one cluster, or the owners of one shard in every cluster, without a second
// connection between them.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace stellatrain {

/// The ranks `members` of `parent` (distinct, in the order that numbers them), as a transport
/// whose rank i is `parent` rank `members[i]`. It refers to `parent` (which must outlive it)
/// and shares its tags: collectives on a group and on its parent, or on two groups with
/// common members, in flight at the same time need tags of their own.
///
/// Every member must construct the group with the same `members`; this rank must be one of
/// them (else `errc::invalid_argument`).
///
/// \code
///   // The owners of shard j in every cluster of a 2x2 topology (global ranks j and 2 + j):
///   stellatrain::group_transport<T> owners(wan, {j, 2 + j});
///   stellatrain::dense_allreduce(owners, shard, {.tag = 9});
/// \endcode
template <transport Parent>
class group_transport {
 public:
  using request_type = typename Parent::request_type;

  group_transport(Parent& parent, std::vector<int> members)
      : parent_(&parent), members_(std::move(members)) {
    std::vector<int> sorted = members_;
    std::sort(sorted.begin(), sorted.end());
    if (sorted.empty() || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() ||
        sorted.front() < 0 || sorted.back() >= parent.size()) {
      throw_error(errc::invalid_argument,
                  "group_transport: members must be distinct ranks of the parent's " +
                      std::to_string(parent.size()));
    }
    const auto at = std::find(members_.begin(), members_.end(), parent.rank());
    if (at == members_.end()) {
      throw_error(errc::invalid_argument, "group_transport: rank " + std::to_string(parent.rank()) +
                                              " is not a member of the group");
    }
    rank_ = static_cast<int>(at - members_.begin());
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return static_cast<int>(members_.size()); }
  /// The parent's rank of group rank `r`.
  [[nodiscard]] int parent_rank(int r) const { return members_.at(static_cast<std::size_t>(r)); }

  request_type isend(int peer, tag_type tag, std::span<const std::byte> bytes) {
    return parent_->isend(to_parent(peer), tag, bytes);
  }
  request_type irecv(int peer, tag_type tag, std::span<std::byte> bytes) {
    return parent_->irecv(to_parent(peer), tag, bytes);
  }
  request_type irecv(int peer, tag_type tag, message_buffer& m) requires message_transport<Parent> {
    return parent_->irecv(to_parent(peer), tag, m);
  }

  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept {
    return chunk_bytes_for(*parent_, auto_chunk_bytes);
  }

  /// Aborts the parent (every rank of it fails, not only the group's).
  void abort(std::string_view reason) noexcept { detail::abort_transport(*parent_, reason); }

 private:
  int to_parent(int peer) const {
    if (peer < 0 || peer >= size()) {
      throw_error(errc::invalid_argument, "group_transport: no rank " + std::to_string(peer) +
                                              " in a group of " + std::to_string(size()));
    }
    return members_[static_cast<std::size_t>(peer)];
  }

  Parent* parent_;
  std::vector<int> members_;
  int rank_ = 0;
};

}  // namespace stellatrain
