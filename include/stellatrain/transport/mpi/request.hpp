// SPDX-License-Identifier: Apache-2.0
// The completion handle of the MPI backend (`mpi_request`).
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/mpi/engine.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace stellatrain {

class mpi_transport;

/// The completion handle of `mpi_transport`. Waits poll MPI (driving its progress) with a
/// short, growing sleep. Dropping a pending receive that has not matched a message withdraws
/// it; dropping one that has, or a pending send (MPI cannot take sends back), fails the
/// transport, and MPI keeps the request: its buffer must then stay valid until the process
/// ends (after a failure, end it; `MPI_Abort` is the usual way).
class mpi_request {
 public:
  mpi_request() = default;
  mpi_request(mpi_request&&) noexcept = default;
  mpi_request& operator=(mpi_request&& other) noexcept {
    if (this != &other) {
      cancel();
      state_ = std::exchange(other.state_, nullptr);
      op_ = std::move(other.op_);
    }
    return *this;
  }
  mpi_request(const mpi_request&) = delete;
  mpi_request& operator=(const mpi_request&) = delete;
  ~mpi_request() { cancel(); }

  bool test() {
    if (!op_) return true;
    std::lock_guard lock(state_->mutex);
    return check(state_->poll(*op_));
  }

  bool wait_until(transport_clock::time_point deadline) {
    if (!op_) return true;
    auto sleep = std::chrono::microseconds(1);
    for (;;) {
      {
        std::lock_guard lock(state_->mutex);
        if (check(state_->poll(*op_))) return true;
      }
      if (transport_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, state_->options.max_poll_sleep);
    }
  }

 private:
  friend class mpi_transport;
  mpi_request(detail::mpi_state* s, std::shared_ptr<detail::mpi_op> op)
      : state_(s), op_(std::move(op)) {}

  bool check(bool final) {
    if (final && op_->state == detail::mpi_done) {
      op_.reset();
      return true;
    }
    if (state_->failed) throw error(errc::peer_failure, state_->failure);
    if (final) throw error(op_->code, op_->message);
    return false;
  }

  void cancel() noexcept {
    if (!op_) return;
    try {
      std::lock_guard lock(state_->mutex);
      if (op_->state == detail::mpi_queued) {
        const auto it = std::find(state_->queued.begin(), state_->queued.end(), op_);
        if (it != state_->queued.end()) state_->queued.erase(it);
      } else if (op_->state == detail::mpi_active && !state_->poll(*op_)) {
        state_->fail_locked(
            state_->who() + ": a " +
            std::string(op_->kind == detail::mpi_op_kind::send ? "send to" : "receive from") +
            " rank " + std::to_string(op_->peer) + " was dropped before it completed");
        state_->orphans.push_back(op_);
      }
    } catch (...) {
    }
    op_.reset();
  }

  detail::mpi_state* state_ = nullptr;
  std::shared_ptr<detail::mpi_op> op_;
};

static_assert(transport_request<mpi_request>);

}  // namespace stellatrain
