// SPDX-License-Identifier: Apache-2.0
// The state of an in-process world: per rank a mailbox (the receives it posted, the sends to it
// that nobody received yet) and the operations in them, matched by (source, tag); the copy of
// a matched pair; the failure of the whole world; and the handle a request waits on.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain::detail {

enum class inproc_kind : std::uint8_t { send, recv_span, recv_buffer };

// pending: in a queue; taken: removed from the queue by the thread that copies; done/failed:
// final. pending -> taken happens under the mutex of the rank whose queue holds the op (the
// receiver); every change is followed by lock/unlock of the owner's mutex and a notify of its
// condition variable, so that waiters never miss a completion.
enum inproc_state : int {
  inproc_pending = 0,
  inproc_taken = 1,
  inproc_done = 2,
  inproc_failed = 3
};

struct inproc_op {
  std::atomic<int> state{inproc_pending};
  inproc_kind kind = inproc_kind::send;
  int owner = 0;  // rank that posted the operation
  int peer = 0;   // destination of a send, source of a receive
  tag_type tag = 0;
  const std::byte* send_data = nullptr;
  std::size_t size = 0;  // bytes of a send, expected bytes of a span receive
  std::byte* recv_data = nullptr;
  message_buffer* recv_buffer = nullptr;
  errc error_code = errc::peer_failure;
  std::string error_message;  // written before state becomes inproc_failed (release)
};

struct inproc_rank {
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<inproc_op*> posted;      // receives of this rank, unmatched, in posting order
  std::vector<inproc_op*> unexpected;  // sends to this rank, unmatched, in sending order
  bool attached = false;
  std::atomic<bool> closed{false};  // set under `mutex`; read by other ranks without it
};

struct inproc_world {
  explicit inproc_world(int n)
      : size(n), ranks(std::make_unique<inproc_rank[]>(static_cast<std::size_t>(n))) {}

  inproc_world(const inproc_world&) = delete;
  inproc_world& operator=(const inproc_world&) = delete;

  ~inproc_world() {
    for (inproc_op* op : free_ops) delete op;
  }

  inproc_op* acquire() {
    {
      std::lock_guard lock(pool_mutex);
      if (!free_ops.empty()) {
        inproc_op* op = free_ops.back();
        free_ops.pop_back();
        return op;
      }
    }
    return new inproc_op;
  }

  void release(inproc_op* op) noexcept {
    op->state.store(inproc_pending, std::memory_order_relaxed);
    op->error_message.clear();
    op->recv_buffer = nullptr;
    op->recv_data = nullptr;
    op->send_data = nullptr;
    std::lock_guard lock(pool_mutex);
    try {
      free_ops.push_back(op);
    } catch (...) {
      delete op;
    }
  }

  // Wakes the waiters of `rank` after a state change made without its mutex.
  void notify(int rank) noexcept {
    inproc_rank& r = ranks[static_cast<std::size_t>(rank)];
    { std::lock_guard lock(r.mutex); }
    r.cv.notify_all();
  }

  void finish(inproc_op* op, int state) noexcept {
    op->state.store(state, std::memory_order_release);
    notify(op->owner);
  }

  void fail_op(inproc_op* op, errc code, std::string message) noexcept {
    op->error_code = code;
    try {
      op->error_message = std::move(message);
    } catch (...) {
    }
    finish(op, inproc_failed);
  }

  void abort(int rank, std::string_view reason) noexcept {
    {
      std::lock_guard lock(fail_mutex);
      if (failed.load(std::memory_order_relaxed)) return;
      try {
        fail_message =
            "in_process: rank " + std::to_string(rank) + " aborted: " + std::string(reason);
      } catch (...) {
      }
      fail_rank = rank;
      failed.store(true, std::memory_order_release);
    }
    for (int r = 0; r < size; ++r) notify(r);
  }

  [[nodiscard]] std::string failure() {
    std::lock_guard lock(fail_mutex);
    return fail_message;
  }

  int size;
  std::unique_ptr<inproc_rank[]> ranks;
  std::atomic<bool> failed{false};
  std::mutex fail_mutex;
  std::string fail_message;
  int fail_rank = -1;
  std::mutex pool_mutex;
  std::vector<inproc_op*> free_ops;
};

// Copies the message of `send` into the receive `recv` (both already taken off their queues)
// and completes both. Runs on whichever thread matched second, without any lock held.
inline void inproc_deliver(inproc_world& w, inproc_op* send, inproc_op* recv) noexcept {
  auto mismatch = [&](const std::string& what) {
    w.fail_op(recv, errc::size_mismatch, what);
    w.fail_op(send, errc::size_mismatch, what);
  };
  if (recv->kind == inproc_kind::recv_span && recv->size != send->size) {
    mismatch("in_process: rank " + std::to_string(recv->owner) + " posted a receive of " +
             std::to_string(recv->size) + " bytes from rank " + std::to_string(send->owner) +
             " (tag " + std::to_string(send->tag) + "), the message has " +
             std::to_string(send->size) + " bytes");
    return;
  }
  std::byte* target = recv->recv_data;
  if (recv->kind == inproc_kind::recv_buffer) {
    try {
      recv->recv_buffer->resize_for_overwrite(send->size);
    } catch (const std::exception& e) {
      w.fail_op(recv, errc::resource_exhausted, e.what());
      w.fail_op(send, errc::peer_failure,
                "in_process: rank " + std::to_string(recv->owner) +
                    " could not store the message: " + e.what());
      return;
    }
    target = recv->recv_buffer->data();
  }
  if (send->size != 0) std::memcpy(target, send->send_data, send->size);
  w.finish(recv, inproc_done);
  w.finish(send, inproc_done);
}

template <class Pred>
inproc_op* inproc_take_first(std::vector<inproc_op*>& queue, Pred&& match) {
  const auto it = std::find_if(queue.begin(), queue.end(), match);
  if (it == queue.end()) return nullptr;
  inproc_op* op = *it;
  queue.erase(it);
  op->state.store(inproc_taken, std::memory_order_relaxed);
  return op;
}

// The operation of an in_process_request; empty once it completed (the op is back in the
// world's pool then).
struct inproc_handle {
  inproc_world* world = nullptr;
  inproc_op* op = nullptr;

  bool empty() const noexcept { return op == nullptr; }

  bool test() { return check(op->state.load(std::memory_order_acquire)); }

  bool wait_until(transport_clock::time_point deadline) {
    inproc_rank& me = world->ranks[static_cast<std::size_t>(op->owner)];
    {
      std::unique_lock lock(me.mutex);
      auto ready = [&] {
        return op->state.load(std::memory_order_acquire) >= inproc_done ||
               world->failed.load(std::memory_order_acquire);
      };
      if (deadline == transport_clock::time_point::max()) {
        me.cv.wait(lock, ready);
      } else {
        me.cv.wait_until(lock, deadline, ready);
      }
    }
    return check(op->state.load(std::memory_order_acquire));
  }

  bool check(int state) {
    if (state == inproc_done) {
      world->release(std::exchange(op, nullptr));
      return true;
    }
    // After an abort the abort's reason is the news, not its consequences (a rank that
    // closed while failing, say).
    if (world->failed.load(std::memory_order_acquire)) {
      throw error(errc::peer_failure, world->failure());
    }
    if (state == inproc_failed) throw error(op->error_code, op->error_message);
    return false;
  }

  void cancel() noexcept {
    // The op sits in the queue of the receiving rank.
    const int queue_rank = op->kind == inproc_kind::send ? op->peer : op->owner;
    inproc_rank& q = world->ranks[static_cast<std::size_t>(queue_rank)];
    {
      std::lock_guard lock(q.mutex);
      if (op->state.load(std::memory_order_relaxed) == inproc_pending) {
        auto& queue = op->kind == inproc_kind::send ? q.unexpected : q.posted;
        const auto it = std::find(queue.begin(), queue.end(), op);
        if (it != queue.end()) queue.erase(it);
        op->state.store(inproc_failed, std::memory_order_relaxed);
      }
    }
    // Taken by another thread: it is copying; wait for it to finish.
    inproc_rank& me = world->ranks[static_cast<std::size_t>(op->owner)];
    {
      std::unique_lock lock(me.mutex);
      me.cv.wait(lock, [&] { return op->state.load(std::memory_order_acquire) >= inproc_done; });
    }
    world->release(std::exchange(op, nullptr));
  }
};

}  // namespace stellatrain::detail
