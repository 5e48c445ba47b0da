// SPDX-License-Identifier: Apache-2.0
// One rank of the in-process backend and its requests: each message is copied once, straight
// from the sender's buffer into the receiver's, by whichever side arrives second.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/in_process_mailboxes.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

class in_process_transport;

/// The completion handle of `in_process_transport` (models `transport_request`).
///
/// `test()` is true once the operation completed and throws `stellatrain::error` when the
/// operation or the world failed; `wait_until(deadline)` blocks until complete (`true`) or
/// `deadline` (`false`) and throws as `test()`.
///
/// Destroying it while its operation is pending withdraws the operation: a receive is never
/// filled, a send not yet matched is never delivered. If another rank's thread is copying
/// the message at that moment, the destructor waits for the copy (never longer).
class in_process_request : public detail::request_base<detail::inproc_handle> {
 public:
  in_process_request() = default;

 private:
  friend class in_process_transport;
  in_process_request(detail::inproc_world* w, detail::inproc_op* op) noexcept
      : request_base({w, op}) {}
};

/// One rank of an `in_process_world` (models `message_transport`).
///
/// Sends and receives match in the receiving rank's queues; whichever side arrives second
/// copies the bytes once, directly from the sender's span into the receiver's memory (no
/// staging copy), and completes both requests. Receives from a rank whose transport was
/// destroyed fail at once with `errc::peer_failure` when no message from it is queued, and
/// after `abort` every pending and later operation of every rank fails with
/// `errc::peer_failure`. Requests must not outlive their transport. Movable.
class in_process_transport {
 public:
  using request_type = in_process_request;

  in_process_transport(in_process_transport&& other) noexcept
      : world_(std::move(other.world_)), rank_(other.rank_) {}
  in_process_transport& operator=(in_process_transport&&) = delete;
  in_process_transport(const in_process_transport&) = delete;
  in_process_transport& operator=(const in_process_transport&) = delete;

  /// Closes this rank: receives that other ranks posted from it fail unless a message from
  /// it is already queued for them; messages sent to it that nobody received fail.
  ~in_process_transport() { close(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return world_ ? world_->size : 0; }

  /// Starts sending `bytes` to rank `dest`; completes when the receiver has its copy.
  /// \pre 0 <= dest < size()
  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    check_peer(dest, "isend");
    detail::inproc_world& w = *world_;
    detail::inproc_rank& d = w.ranks[static_cast<std::size_t>(dest)];
    detail::inproc_op* op = w.acquire();
    op->kind = detail::inproc_kind::send;
    op->owner = rank_;
    op->peer = dest;
    op->tag = tag;
    op->send_data = bytes.data();
    op->size = bytes.size();
    detail::inproc_op* recv = nullptr;
    {
      std::lock_guard lock(d.mutex);
      if (d.closed.load()) {
        op->error_code = errc::peer_failure;
        op->error_message = "in_process: rank " + std::to_string(rank_) + " sends to rank " +
                            std::to_string(dest) + ", which has closed its transport";
        op->state.store(detail::inproc_failed, std::memory_order_relaxed);
        return {world_.get(), op};
      }
      recv = detail::inproc_take_first(
          d.posted, [&](const detail::inproc_op* r) { return r->peer == rank_ && r->tag == tag; });
      if (recv == nullptr) {
        d.unexpected.push_back(op);
        return {world_.get(), op};
      }
      op->state.store(detail::inproc_taken, std::memory_order_relaxed);
    }
    detail::inproc_deliver(w, op, recv);
    return {world_.get(), op};
  }

  /// Starts receiving a message of exactly `into.size()` bytes from rank `source`.
  /// \pre 0 <= source < size()
  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    return post_recv(source, tag, detail::inproc_kind::recv_span, into.data(), into.size(),
                     nullptr);
  }

  /// Starts receiving a message of any length from rank `source` into `into` (resized).
  /// \pre 0 <= source < size()
  request_type irecv(int source, tag_type tag, message_buffer& into) {
    return post_recv(source, tag, detail::inproc_kind::recv_buffer, nullptr, 0, &into);
  }

  /// Fails the whole world: every pending and later operation of every rank throws
  /// `errc::peer_failure` with a message naming this rank and `reason`.
  void abort(std::string_view reason) noexcept {
    if (world_) world_->abort(rank_, reason);
  }

 private:
  friend class in_process_world;
  in_process_transport(std::shared_ptr<detail::inproc_world> w, int rank) noexcept
      : world_(std::move(w)), rank_(rank) {}

  void check_peer(int peer, const char* what) const {
    if (!world_)
      throw_error(errc::invalid_argument,
                  std::string("in_process: ") + what + " on a moved-from transport");
    if (peer < 0 || peer >= world_->size) {
      throw_error(errc::invalid_argument, std::string("in_process: ") + what + " with peer " +
                                              std::to_string(peer) + ", world has " +
                                              std::to_string(world_->size) + " ranks");
    }
    if (world_->failed.load(std::memory_order_acquire)) {
      throw error(errc::peer_failure, world_->failure());
    }
  }

  request_type post_recv(int source, tag_type tag, detail::inproc_kind kind, std::byte* data,
                         std::size_t size, message_buffer* buffer) {
    check_peer(source, "irecv");
    detail::inproc_world& w = *world_;
    detail::inproc_rank& me = w.ranks[static_cast<std::size_t>(rank_)];
    detail::inproc_rank& src = w.ranks[static_cast<std::size_t>(source)];
    detail::inproc_op* op = w.acquire();
    op->kind = kind;
    op->owner = rank_;
    op->peer = source;
    op->tag = tag;
    op->recv_data = data;
    op->size = size;
    op->recv_buffer = buffer;
    detail::inproc_op* send = nullptr;
    {
      std::lock_guard lock(me.mutex);
      send = detail::inproc_take_first(me.unexpected, [&](const detail::inproc_op* s) {
        return s->owner == source && s->tag == tag;
      });
      if (send == nullptr) {
        // close() sets `closed` before it takes this rank's mutex to fail the receives posted
        // from it, so either it sees the receive queued below or this load sees true.
        if (src.closed.load()) {
          op->error_code = errc::peer_failure;
          op->error_message = "in_process: rank " + std::to_string(rank_) + " receives from rank " +
                              std::to_string(source) + " (tag " + std::to_string(tag) +
                              "), which has closed its transport";
          op->state.store(detail::inproc_failed, std::memory_order_relaxed);
          return {world_.get(), op};
        }
        me.posted.push_back(op);
        return {world_.get(), op};
      }
      op->state.store(detail::inproc_taken, std::memory_order_relaxed);
    }
    detail::inproc_deliver(w, send, op);
    return {world_.get(), op};
  }

  void close() noexcept {
    if (!world_) return;
    detail::inproc_world& w = *world_;
    detail::inproc_rank& me = w.ranks[static_cast<std::size_t>(rank_)];
    std::vector<detail::inproc_op*> orphans;
    {
      std::lock_guard lock(me.mutex);
      me.closed.store(true);
      try {
        orphans = me.unexpected;
      } catch (...) {
      }
      me.unexpected.clear();
      for (detail::inproc_op* op : orphans)
        op->state.store(detail::inproc_taken, std::memory_order_relaxed);
    }
    for (detail::inproc_op* op : orphans) {
      w.fail_op(op, errc::peer_failure,
                "in_process: rank " + std::to_string(op->owner) + " sent a message (tag " +
                    std::to_string(op->tag) + ") to rank " + std::to_string(rank_) +
                    ", which closed its transport without receiving it");
    }
    for (int r = 0; r < w.size; ++r) {
      if (r == rank_) continue;
      detail::inproc_rank& other = w.ranks[static_cast<std::size_t>(r)];
      std::vector<detail::inproc_op*> failed;
      {
        std::lock_guard lock(other.mutex);
        auto it = other.posted.begin();
        while (it != other.posted.end()) {
          if ((*it)->peer == rank_) {
            (*it)->state.store(detail::inproc_taken, std::memory_order_relaxed);
            try {
              failed.push_back(*it);
            } catch (...) {
            }
            it = other.posted.erase(it);
          } else {
            ++it;
          }
        }
      }
      for (detail::inproc_op* op : failed) {
        w.fail_op(op, errc::peer_failure,
                  "in_process: rank " + std::to_string(op->owner) + " receives from rank " +
                      std::to_string(rank_) + " (tag " + std::to_string(op->tag) +
                      "), which closed its transport without sending it");
      }
    }
    world_.reset();
  }

  std::shared_ptr<detail::inproc_world> world_;
  int rank_ = 0;
};

static_assert(transport_request<in_process_request>);
static_assert(message_transport<in_process_transport>);

}  // namespace stellatrain
