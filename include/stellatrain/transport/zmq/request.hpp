// SPDX-License-Identifier: Apache-2.0
// The completion handle of the ZeroMQ backend (`zmq_request`).
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/zmq/engine.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace stellatrain {

class zmq_transport;

/// The completion handle of `zmq_transport`.
///
/// A send completes when ZeroMQ has handed the caller's bytes to the kernel (it sends them
/// without copying); a receive when the bytes are in the caller's memory. Dropping a pending
/// receive withdraws it; dropping a pending send that is not yet with ZeroMQ withdraws it,
/// and one that is fails the transport (ZeroMQ cannot take a message back) and shuts its
/// sockets down, so that no buffer is referenced after the destructor returns.
class zmq_request {
 public:
  zmq_request() = default;
  zmq_request(zmq_request&&) noexcept = default;
  zmq_request& operator=(zmq_request&& other) noexcept {
    if (this != &other) {
      cancel();
      op_ = std::move(other.op_);
    }
    return *this;
  }
  zmq_request(const zmq_request&) = delete;
  zmq_request& operator=(const zmq_request&) = delete;
  ~zmq_request() { cancel(); }

  bool test() {
    if (!op_) return true;
    std::lock_guard lock(op_->engine->mutex);
    return check();
  }

  bool wait_until(transport_clock::time_point deadline) {
    if (!op_) return true;
    std::unique_lock lock(op_->engine->mutex);
    auto ready = [&] {
      return op_->state.load(std::memory_order_acquire) >= detail::zmq_done || op_->engine->failed;
    };
    if (deadline == transport_clock::time_point::max()) {
      op_->engine->cv.wait(lock, ready);
    } else {
      op_->engine->cv.wait_until(lock, deadline, ready);
    }
    return check();
  }

 private:
  friend class zmq_transport;
  explicit zmq_request(std::shared_ptr<detail::zmq_op> op) : op_(std::move(op)) {}

  // With the engine's mutex held.
  bool check() {
    const int state = op_->state.load(std::memory_order_acquire);
    if (state == detail::zmq_done) {
      op_.reset();
      return true;
    }
    if (op_->engine->failed) throw error(errc::peer_failure, op_->engine->failure);
    if (state == detail::zmq_failed) throw error(op_->code, op_->message);
    return false;
  }

  void cancel() noexcept {
    if (!op_) return;
    detail::zmq_engine& e = *op_->engine;
    std::unique_lock lock(e.mutex);
    const int state = op_->state.load(std::memory_order_acquire);
    if (state == detail::zmq_pending) {
      if (op_->kind == detail::zmq_op_kind::send) {
        const auto it = std::find(e.outbox.begin(), e.outbox.end(), op_);
        if (it != e.outbox.end()) e.outbox.erase(it);
      } else {
        const auto it = std::find(e.posted.begin(), e.posted.end(), op_);
        if (it != e.posted.end()) e.posted.erase(it);
      }
      op_->state.store(detail::zmq_failed, std::memory_order_relaxed);
    } else if (state == detail::zmq_taken) {
      if (op_->kind == detail::zmq_op_kind::send) {
        // With ZeroMQ already: it cannot be taken back. Fail the transport and stop the
        // sockets now, which releases every zero-copy buffer.
        if (!e.failed) {
          e.fail_locked(errc::peer_failure, e.who + ": rank " + std::to_string(e.rank) +
                                                " dropped a send to rank " +
                                                std::to_string(op_->peer) + " before it completed");
        }
        e.teardown = true;
        e.wake();
      }
      // A receive being copied, or a send being released: wait for the end.
      e.cv.wait(lock, [&] {
        return op_->state.load(std::memory_order_acquire) >= detail::zmq_done || e.io_done;
      });
    }
    op_.reset();
  }

  std::shared_ptr<detail::zmq_op> op_;
};

static_assert(transport_request<zmq_request>);

}  // namespace stellatrain
