// SPDX-License-Identifier: Apache-2.0
// The completion handle of the ZeroMQ backend (`zmq_request`).
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
#include <stellatrain/transport/zmq/engine.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace stellatrain {

namespace detail {

// The operation of a zmq_request; empty once it completed.
struct zmq_handle {
  std::shared_ptr<zmq_op> op;

  bool empty() const noexcept { return !op; }

  bool test() {
    std::lock_guard lock(op->engine->mutex);
    return check();
  }

  bool wait_until(transport_clock::time_point deadline) {
    std::unique_lock lock(op->engine->mutex);
    auto ready = [&] {
      return op->state.load(std::memory_order_acquire) >= zmq_done || op->engine->failed;
    };
    if (deadline == transport_clock::time_point::max()) {
      op->engine->cv.wait(lock, ready);
    } else {
      op->engine->cv.wait_until(lock, deadline, ready);
    }
    return check();
  }

  // With the engine's mutex held.
  bool check() {
    const int state = op->state.load(std::memory_order_acquire);
    if (state == zmq_done) {
      op.reset();
      return true;
    }
    if (op->engine->failed) throw error(errc::peer_failure, op->engine->failure);
    if (state == zmq_failed) throw error(op->code, op->message);
    return false;
  }

  void cancel() noexcept {
    zmq_engine& e = *op->engine;
    std::unique_lock lock(e.mutex);
    const int state = op->state.load(std::memory_order_acquire);
    if (state == zmq_pending) {
      if (op->kind == zmq_op_kind::send) {
        const auto it = std::find(e.outbox.begin(), e.outbox.end(), op);
        if (it != e.outbox.end()) e.outbox.erase(it);
      } else {
        const auto it = std::find(e.posted.begin(), e.posted.end(), op);
        if (it != e.posted.end()) e.posted.erase(it);
      }
      op->state.store(zmq_failed, std::memory_order_relaxed);
    } else if (state == zmq_taken) {
      if (op->kind == zmq_op_kind::send) {
        // With ZeroMQ already: it cannot be taken back. Fail the transport and stop the
        // sockets now, which releases every zero-copy buffer.
        if (!e.failed) {
          e.fail_locked(errc::peer_failure, e.who + ": rank " + std::to_string(e.rank) +
                                                " dropped a send to rank " +
                                                std::to_string(op->peer) + " before it completed");
        }
        e.teardown = true;
        e.wake();
      }
      // A receive being copied, or a send being released: wait for the end.
      e.cv.wait(lock,
                [&] { return op->state.load(std::memory_order_acquire) >= zmq_done || e.io_done; });
    }
    op.reset();
  }
};

}  // namespace detail

class zmq_transport;

/// The completion handle of `zmq_transport`.
///
/// A send completes when ZeroMQ has handed the caller's bytes to the kernel (it sends them
/// without copying); a receive when the bytes are in the caller's memory. Dropping a pending
/// receive withdraws it; dropping a pending send that is not yet with ZeroMQ withdraws it,
/// and one that is fails the transport (ZeroMQ cannot take a message back) and shuts its
/// sockets down, so that no buffer is referenced after the destructor returns.
class zmq_request : public detail::request_base<detail::zmq_handle> {
 public:
  zmq_request() = default;

 private:
  friend class zmq_transport;
  explicit zmq_request(std::shared_ptr<detail::zmq_op> op) : request_base({std::move(op)}) {}
};

static_assert(transport_request<zmq_request>);

}  // namespace stellatrain
