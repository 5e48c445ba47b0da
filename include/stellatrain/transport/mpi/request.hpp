// SPDX-License-Identifier: Apache-2.0
// The completion handle of the MPI backend (`mpi_request`).
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
#include <stellatrain/transport/mpi/engine.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace stellatrain {

namespace detail {

// The operation of an mpi_request; empty once it completed.
struct mpi_handle {
  mpi_state* state = nullptr;
  std::shared_ptr<mpi_op> op;

  bool empty() const noexcept { return !op; }

  bool test() {
    std::lock_guard lock(state->mutex);
    return check(state->poll(*op));
  }

  bool wait_until(transport_clock::time_point deadline) {
    auto sleep = std::chrono::microseconds(1);
    for (;;) {
      {
        std::lock_guard lock(state->mutex);
        if (check(state->poll(*op))) return true;
      }
      if (transport_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, state->options.max_poll_sleep);
    }
  }

  bool check(bool final) {
    if (final && op->state == mpi_done) {
      op.reset();
      return true;
    }
    if (state->failed) throw error(errc::peer_failure, state->failure);
    if (final) throw error(op->code, op->message);
    return false;
  }

  void cancel() noexcept {
    try {
      std::unique_lock lock(state->mutex);
      if (op->state == mpi_queued) {
        const auto it = std::find(state->queued.begin(), state->queued.end(), op);
        if (it != state->queued.end()) state->queued.erase(it);
      } else if (op->state == mpi_active) {
        if (op->kind != mpi_op_kind::send) {
          // Matched: MPI writes into the caller's memory until the receive completes, which
          // it will, the message being under way. Only then may that memory be released.
          const auto deadline = transport_clock::now() + state->options.drop_wait;
          auto sleep = std::chrono::microseconds(1);
          while (!state->poll(*op) && transport_clock::now() < deadline) {
            lock.unlock();
            std::this_thread::sleep_for(sleep);
            sleep = std::min(sleep * 2, state->options.max_poll_sleep);
            lock.lock();
          }
        }
        if (!state->poll(*op)) {
          state->fail_locked(
              state->who() + ": a " +
              std::string(op->kind == mpi_op_kind::send ? "send to" : "receive from") + " rank " +
              std::to_string(op->peer) + " was dropped before it completed");
          state->orphans.push_back(op);
        }
      }
    } catch (...) {
    }
    op.reset();
  }
};

}  // namespace detail

class mpi_transport;

/// The completion handle of `mpi_transport`. Waits poll MPI (driving its progress) with a
/// short, growing sleep. Dropping a pending receive that has not matched a message withdraws
/// it; dropping one that has waits for it to complete (its message is under way), at most
/// `mpi_options::drop_wait`. Dropping a pending send (MPI cannot take sends back), or a
/// receive still pending after that wait, fails the transport, and MPI keeps the request: its
/// buffer must then stay valid until the process ends (after a failure, end it; `MPI_Abort`
/// is the usual way).
class mpi_request : public detail::request_base<detail::mpi_handle> {
 public:
  mpi_request() = default;

 private:
  friend class mpi_transport;
  mpi_request(detail::mpi_state* s, std::shared_ptr<detail::mpi_op> op)
      : request_base({s, std::move(op)}) {}
};

static_assert(transport_request<mpi_request>);

}  // namespace stellatrain
