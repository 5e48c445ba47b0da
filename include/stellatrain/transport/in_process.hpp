// SPDX-License-Identifier: Apache-2.0
// The in-process backend: P ranks as threads of one process, each message copied once,
// straight from the sender's buffer into the receiver's. The default for tests and demos.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
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
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace stellatrain {

namespace detail {

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

}  // namespace detail

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

/// P ranks in one process. Make it, hand `transport(r)` to the thread of each rank.
///
/// \code
///   stellatrain::in_process_world world(4);
///   std::vector<std::jthread> threads;
///   for (int r = 0; r < 4; ++r)
///     threads.emplace_back([&world, t = world.transport(r)]() mutable { /* use t */ });
/// \endcode
/// Or let `run_in_process` do it. The world's state lives as long as the world or any of its
/// transports.
class in_process_world {
 public:
  /// \pre ranks >= 1
  explicit in_process_world(int ranks) {
    if (ranks < 1) {
      throw_error(errc::invalid_argument,
                  "in_process_world: " + std::to_string(ranks) + " ranks, need at least 1");
    }
    world_ = std::make_shared<detail::inproc_world>(ranks);
  }

  [[nodiscard]] int size() const noexcept { return world_->size; }

  /// The transport of `rank`; each rank's transport can be taken once.
  [[nodiscard]] in_process_transport transport(int rank) {
    if (rank < 0 || rank >= world_->size) {
      throw_error(errc::invalid_argument, "in_process_world::transport: rank " +
                                              std::to_string(rank) + " of " +
                                              std::to_string(world_->size));
    }
    detail::inproc_rank& r = world_->ranks[static_cast<std::size_t>(rank)];
    std::lock_guard lock(r.mutex);
    if (r.attached) {
      throw_error(errc::invalid_argument, "in_process_world::transport: rank " +
                                              std::to_string(rank) + " was already taken");
    }
    r.attached = true;
    return {world_, rank};
  }

  /// Fails every rank, as `in_process_transport::abort` of `rank` does.
  void abort(int rank, std::string_view reason) noexcept { world_->abort(rank, reason); }

  /// True after an abort.
  [[nodiscard]] bool failed() const noexcept {
    return world_->failed.load(std::memory_order_acquire);
  }

  /// The rank whose abort failed the world, or -1.
  [[nodiscard]] int abort_rank() const noexcept {
    std::lock_guard lock(world_->fail_mutex);
    return world_->failed.load(std::memory_order_acquire) ? world_->fail_rank : -1;
  }

 private:
  std::shared_ptr<detail::inproc_world> world_;
};

/// Runs `fn(in_process_transport&)` on `ranks` threads, one per rank, and joins them.
///
/// When a rank's `fn` throws, the world is aborted at once (the other ranks' pending and
/// later operations fail with `errc::peer_failure` rather than wait for a timeout); when a
/// rank's `fn` returns, its transport closes. After every thread has ended, the cause is
/// rethrown: the exception of the rank that aborted the world first, else the first thrown.
///
/// \code
///   stellatrain::run_in_process(4, [](stellatrain::in_process_transport& t) {
///     stellatrain::barrier(t);
///   });
/// \endcode
template <class Fn>
void run_in_process(int ranks, Fn&& fn) {
  in_process_world world(ranks);
  std::mutex error_mutex;
  std::exception_ptr first;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  auto record = [&](int r) {
    std::lock_guard lock(error_mutex);
    errors[static_cast<std::size_t>(r)] = std::current_exception();
    if (!first) first = errors[static_cast<std::size_t>(r)];
  };
  auto body = [&](int r) {
    try {
      in_process_transport t = world.transport(r);
      try {
        fn(t);
      } catch (const std::exception& e) {
        record(r);
        t.abort(e.what());
      }
    } catch (...) {
      record(r);
      world.abort(r, "unknown exception");
    }
  };
  try {
    for (int r = 1; r < ranks; ++r) threads.emplace_back(body, r);
  } catch (...) {
    world.abort(0, "could not start a thread");
    for (auto& th : threads) th.join();
    throw;
  }
  body(0);
  for (auto& th : threads) th.join();
  // The cause is the exception of the rank that aborted the world first (collectives abort
  // before their exception reaches here); failing that, the first one thrown.
  const int cause = world.abort_rank();
  if (cause >= 0 && errors[static_cast<std::size_t>(cause)])
    std::rethrow_exception(errors[static_cast<std::size_t>(cause)]);
  if (first) std::rethrow_exception(first);
}

/// Runs `fn(lan, wan)` on one thread per rank of `topology`, and joins them: `wan` is the rank's
/// transport in a world of all ranks (its global rank), `lan` its transport in a world of its
/// cluster's ranks (its local rank) — the two links of a hierarchical pipeline
/// (`hierarchical_links`). Failures behave as in `run_in_process`: a rank that throws aborts
/// both of its worlds, and the cause is rethrown after every thread has ended.
///
/// \code
///   stellatrain::run_in_process_clusters(stellatrain::cluster_topology::parse("2,2"),
///       [](stellatrain::in_process_transport& lan, stellatrain::in_process_transport& wan) {
///         /* lan.size() == 2, wan.size() == 4 */
///       });
/// \endcode
template <class Fn>
void run_in_process_clusters(const cluster_topology& topology, Fn&& fn) {
  const int ranks = topology.ranks();
  in_process_world wan_world(ranks);
  std::vector<std::unique_ptr<in_process_world>> lan_worlds;
  for (int c = 0; c < topology.clusters(); ++c)
    lan_worlds.push_back(std::make_unique<in_process_world>(topology.size_of(c)));
  std::mutex error_mutex;
  std::exception_ptr first;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  auto body = [&](int r) {
    const int c = topology.cluster_of(r);
    in_process_world& lan_world = *lan_worlds[static_cast<std::size_t>(c)];
    const int local = topology.local_rank(r);
    try {
      in_process_transport wan = wan_world.transport(r);
      in_process_transport lan = lan_world.transport(local);
      fn(lan, wan);
    } catch (const std::exception& e) {
      {
        std::lock_guard lock(error_mutex);
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        if (!first) first = errors[static_cast<std::size_t>(r)];
      }
      wan_world.abort(r, e.what());
      lan_world.abort(local, e.what());
    } catch (...) {
      {
        std::lock_guard lock(error_mutex);
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        if (!first) first = errors[static_cast<std::size_t>(r)];
      }
      wan_world.abort(r, "unknown exception");
      lan_world.abort(local, "unknown exception");
    }
  };
  try {
    for (int r = 1; r < ranks; ++r) threads.emplace_back(body, r);
  } catch (...) {
    wan_world.abort(0, "could not start a thread");
    for (auto& w : lan_worlds) w->abort(0, "could not start a thread");
    for (auto& th : threads) th.join();
    throw;
  }
  body(0);
  for (auto& th : threads) th.join();
  const int cause = wan_world.abort_rank();
  if (cause >= 0 && errors[static_cast<std::size_t>(cause)])
    std::rethrow_exception(errors[static_cast<std::size_t>(cause)]);
  if (first) std::rethrow_exception(first);
}

}  // namespace stellatrain
