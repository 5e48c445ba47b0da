// SPDX-License-Identifier: Apache-2.0
// The ZeroMQ backend: ranks on any hosts, peers from an explicit address list, TCP
// underneath; the WAN-friendly backend (the StellaTrain paper used ZeroMQ). Needs libzmq and
// cppzmq (CMake target stellatrain::zmq); not part of <stellatrain/stellatrain.hpp>.
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace stellatrain {

/// Options of `zmq_transport`. All ranks should use the same values.
struct zmq_options {
  /// How long the constructor waits for every peer to connect and greet.
  std::chrono::milliseconds connect_timeout{30'000};
  /// ZeroMQ heartbeats on every connection: a peer silent for `heartbeat_timeout` (crashed
  /// host, frozen process, cut network) is disconnected, and the transport fails.
  std::chrono::milliseconds heartbeat_interval{1'000};
  std::chrono::milliseconds heartbeat_timeout{5'000};
  /// A peer that disconnects without having said goodbye fails the transport once this much
  /// time has passed without its goodbye arriving (the goodbye and the disconnect travel on
  /// different connections, so a clean close may be seen as a disconnect first).
  std::chrono::milliseconds close_grace{500};
  /// At destruction, how long queued messages may still take to leave.
  std::chrono::milliseconds linger{5'000};
  /// Also protect every payload with a CRC32C (headers always have one).
  bool payload_checksum = false;
  /// Frames announcing more bytes are refused (and ZeroMQ drops such connections).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// Where this rank binds; empty = its own entry of the peer list.
  std::string bind_endpoint{};
};

namespace detail {

enum zmq_op_state : int { zmq_pending = 0, zmq_taken = 1, zmq_done = 2, zmq_failed = 3 };
enum class zmq_op_kind : std::uint8_t { send, recv_span, recv_buffer, control };

struct zmq_engine;

struct zmq_op {
  std::atomic<int> state{zmq_pending};
  zmq_op_kind kind = zmq_op_kind::send;
  int peer = 0;
  tag_type tag = 0;
  frame_kind frame = frame_kind::data;
  std::span<const std::byte> send_bytes;
  std::string control_payload;  // payload of a control frame (abort reason)
  std::byte* recv_data = nullptr;
  std::size_t recv_size = 0;
  message_buffer* recv_buffer = nullptr;
  errc code = errc::peer_failure;
  std::string message;
  zmq_engine* engine = nullptr;
};

struct zmq_incoming {
  int peer = 0;
  tag_type tag = 0;
  zmq::message_t payload;
};

// All state of one zmq_transport; the I/O thread owns the sockets, user threads post work
// under `mutex` and wake the I/O thread through a self-pipe.
struct zmq_engine {
  using op_ptr = std::shared_ptr<zmq_op>;

  zmq_engine(int rank_, int size_, zmq_options opt)
      : rank(rank_), size(size_), options(std::move(opt)) {
    peers.resize(static_cast<std::size_t>(size));
  }

  // ---- shared state (guarded by mutex)
  std::mutex mutex;
  std::condition_variable cv;  // completions, greetings, failure
  std::deque<op_ptr> outbox;   // sends for the I/O thread, in posting order
  std::vector<op_ptr> posted;  // receives not yet matched, in posting order
  std::deque<zmq_incoming> unexpected;
  struct peer_state {
    std::string endpoint;
    bool greeted = false;    // its hello arrived
    bool connected = false;  // our connection to it is up
    bool said_bye = false;
    bool dropped = false;  // our connection to it went down
    transport_clock::time_point dropped_at{};
  };
  std::vector<peer_state> peers;
  bool failed = false;
  std::string failure;
  bool stop = false;      // orderly stop: send what is queued, then close
  bool teardown = false;  // stop now, drop what is queued (after an abandoned send)
  bool io_done = false;

  // ---- fixed
  int rank;
  int size;
  zmq_options options;
  std::string who = "zmq_transport";
  int wake_read = -1;
  int wake_write = -1;
  zmq::context_t context;
  std::optional<zmq::socket_t> router;
  std::vector<std::optional<zmq::socket_t>> dealers;   // by rank; none for this rank
  std::vector<std::optional<zmq::socket_t>> monitors;  // by rank
  std::thread io;

  ~zmq_engine() {
    if (wake_read >= 0) ::close(wake_read);
    if (wake_write >= 0) ::close(wake_write);
  }

  void wake() noexcept {
    const char c = 1;
    [[maybe_unused]] const auto n = ::write(wake_write, &c, 1);  // full pipe: a wake is pending
  }

  // Marks the transport failed (first reason wins) and fails every pending operation.
  // Call with `mutex` held.
  void fail_locked(errc code, const std::string& why) {
    if (!failed) {
      failed = true;
      failure = why;
      (void)code;
    }
    for (auto& op : posted) finish_locked(*op, zmq_failed, errc::peer_failure, failure);
    posted.clear();
    cv.notify_all();
  }

  void finish_locked(zmq_op& op, int state, errc code = errc::peer_failure,
                     const std::string& message = {}) {
    if (state == zmq_failed) {
      op.code = code;
      op.message = message;
    }
    op.state.store(state, std::memory_order_release);
    cv.notify_all();
  }

  // ZeroMQ calls this when it no longer needs the bytes of a zero-copy send.
  static void release_send(void*, void* hint) noexcept {
    auto* holder = static_cast<op_ptr*>(hint);
    zmq_op& op = **holder;
    {
      std::lock_guard lock(op.engine->mutex);
      if (op.state.load(std::memory_order_relaxed) != zmq_failed)
        op.state.store(zmq_done, std::memory_order_release);
      op.engine->cv.notify_all();
    }
    delete holder;
  }

  std::string peer_name(int p) const {
    return "rank " + std::to_string(p) + " (" + peers[static_cast<std::size_t>(p)].endpoint + ")";
  }

  // Copies `payload` into the receive `op` (taken off `posted` already), outside the lock.
  void deliver(zmq_op& op, const zmq::message_t& payload) {
    const std::size_t n = payload.size();
    int state = zmq_done;
    errc code = errc::peer_failure;
    std::string message;
    if (op.kind == zmq_op_kind::recv_span && n != op.recv_size) {
      state = zmq_failed;
      code = errc::size_mismatch;
      message = who + ": rank " + std::to_string(rank) + " posted a receive of " +
                std::to_string(op.recv_size) + " bytes from rank " + std::to_string(op.peer) +
                " (tag " + std::to_string(op.tag) + "), the message has " + std::to_string(n) +
                " bytes";
    } else {
      std::byte* target = op.recv_data;
      try {
        if (op.kind == zmq_op_kind::recv_buffer) {
          op.recv_buffer->resize_for_overwrite(n);
          target = op.recv_buffer->data();
        }
        if (n != 0) std::memcpy(target, payload.data(), n);
      } catch (const std::exception& e) {
        state = zmq_failed;
        code = errc::resource_exhausted;
        message = e.what();
      }
    }
    std::lock_guard lock(mutex);
    finish_locked(op, state, code, message);
  }

  // ---------------------------------------------------------------- I/O thread
  void run() noexcept {
    try {
      loop();
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      fail_locked(errc::io_error,
                  who + ": I/O thread of rank " + std::to_string(rank) + " failed: " + e.what());
    }
    close_sockets();
    {
      std::lock_guard lock(mutex);
      if (!failed && !stop) fail_locked(errc::io_error, who + ": I/O thread stopped");
      // Whatever is still queued will never be sent.
      for (auto& op : outbox)
        finish_locked(*op, zmq_failed, errc::peer_failure,
                      failure.empty() ? who + ": closed" : failure);
      outbox.clear();
      io_done = true;
      cv.notify_all();
    }
  }

  void close_sockets() noexcept {
    int linger = 0;
    {
      std::lock_guard lock(mutex);
      if (!teardown && !failed) linger = static_cast<int>(options.linger.count());
      if (failed && !teardown)
        linger = static_cast<int>(std::min<long long>(options.linger.count(), 1000));
    }
    try {
      for (auto& m : monitors) m.reset();
      for (auto& d : dealers) {
        if (d) {
          d->set(zmq::sockopt::linger, linger);
          d.reset();
        }
      }
      if (router) {
        router->set(zmq::sockopt::linger, 0);
        router.reset();
      }
      // Blocks until ZeroMQ has sent (within the linger) or dropped every queued message and
      // released every zero-copy buffer: after this no send buffer is referenced.
      context.close();
    } catch (...) {
    }
  }

  void send_frames(int dest, const frame_header& h, zmq::message_t&& payload) {
    frame_bytes hb{};
    encode_frame(h, hb);
    zmq::socket_t& s = *dealers[static_cast<std::size_t>(dest)];
    zmq::message_t header(hb.data(), hb.size());
    // High-water marks are off (0): sends never block and never fail with EAGAIN.
    (void)s.send(header, zmq::send_flags::sndmore);
    (void)s.send(payload, zmq::send_flags::none);
  }

  void drain_outbox() {
    for (;;) {
      op_ptr op;
      {
        std::lock_guard lock(mutex);
        if (outbox.empty() || teardown) return;
        op = std::move(outbox.front());
        outbox.pop_front();
        op->state.store(zmq_taken, std::memory_order_relaxed);
      }
      frame_header h;
      h.kind = op->frame;
      h.source = static_cast<std::uint32_t>(rank);
      h.tag = op->tag;
      if (op->kind == zmq_op_kind::control) {
        h.length = op->control_payload.size();
        zmq::message_t payload(op->control_payload.data(), op->control_payload.size());
        send_frames(op->peer, h, std::move(payload));
        std::lock_guard lock(mutex);
        finish_locked(*op, zmq_done);
        continue;
      }
      h = data_frame(static_cast<std::uint32_t>(rank), op->tag, op->send_bytes,
                     options.payload_checksum);
      if (op->send_bytes.empty()) {
        send_frames(op->peer, h, zmq::message_t());
        std::lock_guard lock(mutex);
        finish_locked(*op, zmq_done);
        continue;
      }
      // Zero copy: ZeroMQ reads the caller's bytes and calls release_send when done.
      auto* holder = new op_ptr(op);
      zmq::message_t payload(const_cast<std::byte*>(op->send_bytes.data()), op->send_bytes.size(),
                             &zmq_engine::release_send, holder);
      send_frames(op->peer, h, std::move(payload));
    }
  }

  void on_frame(int from, zmq::message_t& header, zmq::message_t& payload) {
    const frame_header h = decode_frame(
        std::span<const std::byte>(static_cast<const std::byte*>(header.data()), header.size()),
        static_cast<std::uint32_t>(from), options.max_message_bytes, who);
    verify_payload(
        h,
        std::span<const std::byte>(static_cast<const std::byte*>(payload.data()), payload.size()),
        who);
    std::unique_lock lock(mutex);
    auto& peer = peers[static_cast<std::size_t>(from)];
    switch (h.kind) {
      case frame_kind::hello:
        if (h.tag != static_cast<std::uint32_t>(size)) {
          fail_locked(errc::invalid_argument,
                      who + ": " + peer_name(from) + " belongs to a world of " +
                          std::to_string(h.tag) + " ranks, this rank to one of " +
                          std::to_string(size));
        }
        peer.greeted = true;
        cv.notify_all();
        return;
      case frame_kind::bye: {
        peer.said_bye = true;
        // No message follows a goodbye: receives still waiting for this peer never complete.
        auto it = posted.begin();
        while (it != posted.end()) {
          if ((*it)->peer == from) {
            finish_locked(**it, zmq_failed, errc::peer_failure,
                          who + ": " + peer_name(from) + " closed its transport while rank " +
                              std::to_string(rank) + " waited for a message from it (tag " +
                              std::to_string((*it)->tag) + ")");
            it = posted.erase(it);
          } else {
            ++it;
          }
        }
        cv.notify_all();
        return;
      }
      case frame_kind::abort:
        fail_locked(errc::peer_failure,
                    who + ": rank " + std::to_string(from) + " aborted: " +
                        std::string(static_cast<const char*>(payload.data()), payload.size()));
        return;
      case frame_kind::data:
        break;
    }
    const auto it = std::find_if(posted.begin(), posted.end(), [&](const op_ptr& op) {
      return op->peer == from && op->tag == h.tag;
    });
    if (it == posted.end()) {
      unexpected.push_back({from, h.tag, std::move(payload)});
      return;
    }
    op_ptr op = std::move(*it);
    posted.erase(it);
    op->state.store(zmq_taken, std::memory_order_relaxed);
    lock.unlock();
    deliver(*op, payload);
  }

  void read_router() {
    for (;;) {
      zmq::message_t id;
      if (!router->recv(id, zmq::recv_flags::dontwait)) return;
      std::vector<zmq::message_t> parts;
      while (router->get(zmq::sockopt::rcvmore)) {
        parts.emplace_back();
        (void)router->recv(parts.back(), zmq::recv_flags::none);
      }
      int from = -1;
      if (id.size() == 5 && static_cast<const char*>(id.data())[0] == 'r') {
        const auto* b = static_cast<const std::byte*>(id.data()) + 1;
        const std::uint32_t v = frame_load_u32(b);
        if (v < static_cast<std::uint32_t>(size) && static_cast<int>(v) != rank)
          from = static_cast<int>(v);
      }
      if (from < 0 || parts.size() != 2) {
        throw error(errc::malformed_message, who + ": rank " + std::to_string(rank) +
                                                 " received a message with an unknown sender or " +
                                                 std::to_string(parts.size()) +
                                                 " frames instead of 2");
      }
      on_frame(from, parts[0], parts[1]);
    }
  }

  void read_monitor(int p) {
    for (;;) {
      zmq::message_t event;
      if (!monitors[static_cast<std::size_t>(p)]->recv(event, zmq::recv_flags::dontwait)) return;
      zmq::message_t address;
      if (event.more())
        (void)monitors[static_cast<std::size_t>(p)]->recv(address, zmq::recv_flags::none);
      if (event.size() < 2) continue;
      std::uint16_t what = 0;
      std::memcpy(&what, event.data(), 2);
      std::lock_guard lock(mutex);
      auto& peer = peers[static_cast<std::size_t>(p)];
      if (what == ZMQ_EVENT_CONNECTED) {
        peer.connected = true;
        cv.notify_all();
      } else if (what == ZMQ_EVENT_DISCONNECTED && peer.connected && !peer.said_bye &&
                 !peer.dropped) {
        peer.dropped = true;
        peer.dropped_at = transport_clock::now();
      }
    }
  }

  // Peers that dropped without a goodbye fail the transport after the grace period; returns
  // the milliseconds until the next such check is due (-1: none).
  long check_dropped() {
    std::lock_guard lock(mutex);
    long next = -1;
    const auto now = transport_clock::now();
    for (int p = 0; p < size; ++p) {
      auto& peer = peers[static_cast<std::size_t>(p)];
      if (!peer.dropped || peer.said_bye || failed) continue;
      const auto due = peer.dropped_at + options.close_grace;
      if (now >= due) {
        fail_locked(errc::peer_failure,
                    who + ": " + peer_name(p) +
                        " disconnected without closing its transport (it crashed, was killed, "
                        "stopped answering heartbeats for " +
                        std::to_string(options.heartbeat_timeout.count()) +
                        " ms, or the network failed); rank " + std::to_string(rank) +
                        " cannot continue");
      } else {
        const long ms =
            static_cast<long>(std::chrono::ceil<std::chrono::milliseconds>(due - now).count());
        next = next < 0 ? ms : std::min(next, ms);
      }
    }
    return next;
  }

  void loop() {
    std::vector<zmq::pollitem_t> items;
    items.push_back({static_cast<void*>(*router), 0, ZMQ_POLLIN, 0});
    items.push_back({nullptr, wake_read, ZMQ_POLLIN, 0});
    std::vector<int> monitor_rank;
    for (int p = 0; p < size; ++p) {
      if (monitors[static_cast<std::size_t>(p)]) {
        items.push_back(
            {static_cast<void*>(*monitors[static_cast<std::size_t>(p)]), 0, ZMQ_POLLIN, 0});
        monitor_rank.push_back(p);
      }
    }
    for (;;) {
      drain_outbox();
      const long next = check_dropped();
      {
        std::lock_guard lock(mutex);
        if (teardown) return;
        if (stop && outbox.empty()) return;
      }
      const long timeout = next < 0 ? 1000 : std::max(1L, next);
      if (zmq_poll(items.data(), static_cast<int>(items.size()), timeout) < 0) {
        if (zmq_errno() == EINTR) continue;
        throw zmq::error_t();
      }
      if ((items[1].revents & ZMQ_POLLIN) != 0) {
        char buf[256];
        while (::read(wake_read, buf, sizeof buf) > 0) {
        }
      }
      for (std::size_t i = 0; i < monitor_rank.size(); ++i) {
        if ((items[2 + i].revents & ZMQ_POLLIN) != 0) read_monitor(monitor_rank[i]);
      }
      if ((items[0].revents & ZMQ_POLLIN) != 0) read_router();
    }
  }

  // ---------------------------------------------------------------- user side
  void check_usable(const char* what) {
    if (failed) throw error(errc::peer_failure, failure);
    if (stop) throw_error(errc::invalid_argument, who + ": " + what + " on a closed transport");
  }

  void post_control(int dest, frame_kind kind, std::string payload = {}) {
    auto op = std::make_shared<zmq_op>();
    op->kind = zmq_op_kind::control;
    op->frame = kind;
    op->peer = dest;
    op->tag = kind == frame_kind::hello ? static_cast<tag_type>(size) : 0;
    op->control_payload = std::move(payload);
    op->engine = this;
    outbox.push_back(std::move(op));
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

/// A ZeroMQ socket bound before the transport exists, so that its address (for example a
/// port the system chose: "tcp://127.0.0.1:*") can be told to the other ranks first.
///
/// \code
///   stellatrain::zmq_listener l("tcp://127.0.0.1:*");
///   publish(rank, l.endpoint());                      // e.g. "tcp://127.0.0.1:40123"
///   stellatrain::zmq_transport t(std::move(l), rank, gather_all_endpoints());
/// \endcode
class zmq_listener {
 public:
  explicit zmq_listener(const std::string& bind_endpoint)
      : context_(std::make_unique<zmq::context_t>(1)) {
    try {
      router_.emplace(*context_, zmq::socket_type::router);
      router_->set(zmq::sockopt::rcvhwm, 0);
      router_->set(zmq::sockopt::linger, 0);
      router_->bind(bind_endpoint);
      endpoint_ = router_->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      throw error(errc::io_error, "zmq_listener: cannot bind " + bind_endpoint + ": " + e.what());
    }
  }

  /// The address peers connect to (the port resolved when it was given as `*` or 0).
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }

 private:
  friend class zmq_transport;
  std::unique_ptr<zmq::context_t> context_;
  std::optional<zmq::socket_t> router_;
  std::string endpoint_;
};

/// The rank and peer list of this process, from the environment:
/// `STELLATRAIN_RANK` (0-based) and either `STELLATRAIN_ZMQ_PEERS` (endpoints separated by
/// commas or white space, in rank order: "tcp://10.0.0.1:5555,tcp://10.0.0.2:5555") or
/// `STELLATRAIN_ZMQ_PEERS_FILE` (one endpoint per line; blank lines and `#` comments are
/// skipped). Throws `errc::invalid_argument` naming the variable when something is missing
/// or malformed.
struct zmq_peer_list {
  int rank = 0;
  std::vector<std::string> endpoints;

  [[nodiscard]] static zmq_peer_list from_environment() {
    zmq_peer_list out;
    const char* rank = std::getenv("STELLATRAIN_RANK");
    if (rank == nullptr)
      throw_error(errc::invalid_argument, "zmq_peer_list: STELLATRAIN_RANK is not set");
    char* end = nullptr;
    const long r = std::strtol(rank, &end, 10);
    if (end == rank || *end != '\0' || r < 0 || r > 1'000'000) {
      throw_error(errc::invalid_argument,
                  std::string("zmq_peer_list: STELLATRAIN_RANK='") + rank + "' is not a rank");
    }
    out.rank = static_cast<int>(r);
    std::string text;
    std::string source;
    if (const char* list = std::getenv("STELLATRAIN_ZMQ_PEERS"); list != nullptr) {
      text = list;
      source = "STELLATRAIN_ZMQ_PEERS";
    } else if (const char* file = std::getenv("STELLATRAIN_ZMQ_PEERS_FILE"); file != nullptr) {
      std::ifstream in(file);
      if (!in)
        throw_error(errc::io_error,
                    std::string("zmq_peer_list: cannot read STELLATRAIN_ZMQ_PEERS_FILE=") + file);
      std::string line;
      while (std::getline(in, line)) {
        const auto hash = line.find('#');
        if (hash != std::string::npos) line.resize(hash);
        text += line + "\n";
      }
      source = std::string("STELLATRAIN_ZMQ_PEERS_FILE=") + file;
    } else {
      throw_error(errc::invalid_argument,
                  "zmq_peer_list: set STELLATRAIN_ZMQ_PEERS or STELLATRAIN_ZMQ_PEERS_FILE");
    }
    for (char& c : text) {
      if (c == ',' || c == '\n' || c == '\t' || c == '\r') c = ' ';
    }
    std::istringstream words(text);
    std::string w;
    while (words >> w) out.endpoints.push_back(w);
    if (out.endpoints.empty())
      throw_error(errc::invalid_argument, "zmq_peer_list: " + source + " lists no endpoint");
    if (out.rank >= static_cast<int>(out.endpoints.size())) {
      throw_error(errc::invalid_argument,
                  "zmq_peer_list: STELLATRAIN_RANK=" + std::to_string(out.rank) + " but " + source +
                      " lists " + std::to_string(out.endpoints.size()) + " endpoints");
    }
    return out;
  }
};

/// A rank of a ZeroMQ world (models `message_transport`).
///
/// Each rank binds one ROUTER socket and connects one DEALER to every other rank (a full
/// mesh of TCP connections); one I/O thread per transport moves the messages. Every message
/// is a 32-byte header (length, tag, source, CRC32C of the header; see detail/frame.hpp)
/// and the payload, sent without copying; the receiver verifies the header and the payload
/// length (and CRC32C with `payload_checksum`) before it trusts or copies anything.
///
/// - Construction blocks until every rank has connected and greeted (each greeting carries
///   the world size, so a mismatched peer list fails), or `connect_timeout` passes.
/// - Faults: a peer whose connection drops without its goodbye (crash, kill, heartbeat
///   timeout) fails the transport: every pending and later operation throws
///   `errc::peer_failure` naming it. `abort(reason)` tells every peer, which fail the same
///   way. A peer that closed cleanly fails only the receives still waiting for it.
/// - Destruction says goodbye to every peer, lets queued messages leave (up to `linger`) and
///   joins the I/O thread. Requests must not outlive the transport.
///
/// \code
///   auto peers = stellatrain::zmq_peer_list::from_environment();
///   stellatrain::zmq_transport t(peers.rank, peers.endpoints);
///   stellatrain::barrier(t);
/// \endcode
class zmq_transport {
 public:
  using request_type = zmq_request;

  /// Binds `options.bind_endpoint` (default: `endpoints[rank]`) and connects to the others.
  zmq_transport(int rank, std::vector<std::string> endpoints, zmq_options options = {}) {
    check_arguments(rank, endpoints);
    const std::string bind = options.bind_endpoint.empty()
                                 ? endpoints[static_cast<std::size_t>(rank)]
                                 : options.bind_endpoint;
    start(zmq_listener(bind), rank, std::move(endpoints), std::move(options));
  }

  /// Uses a socket bound beforehand (see `zmq_listener`); `endpoints[rank]` is informational.
  zmq_transport(zmq_listener&& bound, int rank, std::vector<std::string> endpoints,
                zmq_options options = {}) {
    check_arguments(rank, endpoints);
    start(std::move(bound), rank, std::move(endpoints), std::move(options));
  }

  /// From `zmq_peer_list::from_environment()`.
  [[nodiscard]] static zmq_transport from_environment(zmq_options options = {}) {
    auto peers = zmq_peer_list::from_environment();
    return zmq_transport(peers.rank, std::move(peers.endpoints), std::move(options));
  }

  zmq_transport(zmq_transport&&) noexcept = default;
  zmq_transport& operator=(zmq_transport&&) = delete;
  zmq_transport(const zmq_transport&) = delete;
  zmq_transport& operator=(const zmq_transport&) = delete;

  ~zmq_transport() { shutdown(); }

  [[nodiscard]] int rank() const noexcept { return engine_ ? engine_->rank : 0; }
  [[nodiscard]] int size() const noexcept { return engine_ ? engine_->size : 0; }

  /// Starts sending `bytes` to `dest` (without copying them: keep them until completion).
  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    detail::zmq_engine& e = engine();
    check_peer(dest, "isend");
    auto op = std::make_shared<detail::zmq_op>();
    op->kind = detail::zmq_op_kind::send;
    op->peer = dest;
    op->tag = tag;
    op->send_bytes = bytes;
    op->engine = &e;
    std::unique_lock lock(e.mutex);
    e.check_usable("isend");
    if (dest == e.rank) {  // to itself: deliver here (a copy)
      zmq::message_t copy(bytes.data(), bytes.size());
      const auto it = std::find_if(e.posted.begin(), e.posted.end(),
                                   [&](const auto& r) { return r->peer == dest && r->tag == tag; });
      if (it == e.posted.end()) {
        e.unexpected.push_back({dest, tag, std::move(copy)});
      } else {
        auto recv = std::move(*it);
        e.posted.erase(it);
        recv->state.store(detail::zmq_taken, std::memory_order_relaxed);
        lock.unlock();
        e.deliver(*recv, copy);
        lock.lock();
      }
      e.finish_locked(*op, detail::zmq_done);
      return request_type(std::move(op));
    }
    if (e.peers[static_cast<std::size_t>(dest)].said_bye) {
      e.finish_locked(*op, detail::zmq_failed, errc::peer_failure,
                      e.who + ": rank " + std::to_string(e.rank) + " sends to " +
                          e.peer_name(dest) + ", which has closed its transport");
      return request_type(std::move(op));
    }
    e.outbox.push_back(op);
    lock.unlock();
    e.wake();
    return request_type(std::move(op));
  }

  /// Starts receiving exactly `into.size()` bytes from `source`.
  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    return post_recv(source, tag, detail::zmq_op_kind::recv_span, into.data(), into.size(),
                     nullptr);
  }

  /// Starts receiving a message of any length from `source` into `into` (resized).
  request_type irecv(int source, tag_type tag, message_buffer& into) {
    return post_recv(source, tag, detail::zmq_op_kind::recv_buffer, nullptr, 0, &into);
  }

  /// Fails this transport and tells every peer (their operations fail with
  /// `errc::peer_failure` and `reason`).
  void abort(std::string_view reason) noexcept {
    if (!engine_) return;
    detail::zmq_engine& e = *engine_;
    try {
      std::lock_guard lock(e.mutex);
      if (e.failed) return;
      const std::string why(reason);
      for (int p = 0; p < e.size; ++p) {
        if (p != e.rank && !e.peers[static_cast<std::size_t>(p)].said_bye)
          e.post_control(p, detail::frame_kind::abort, why);
      }
      e.fail_locked(errc::peer_failure,
                    e.who + ": rank " + std::to_string(e.rank) + " aborted: " + why);
    } catch (...) {
    }
    e.wake();
  }

  /// The address this rank's socket is bound to.
  [[nodiscard]] const std::string& endpoint() const {
    return engine_->peers[static_cast<std::size_t>(engine_->rank)].endpoint;
  }

 private:
  static void check_arguments(int rank, const std::vector<std::string>& endpoints) {
    if (endpoints.empty() || rank < 0 || rank >= static_cast<int>(endpoints.size())) {
      throw_error(errc::invalid_argument, "zmq_transport: rank " + std::to_string(rank) + " with " +
                                              std::to_string(endpoints.size()) + " endpoints");
    }
  }

  detail::zmq_engine& engine() {
    if (!engine_) throw_error(errc::invalid_argument, "zmq_transport: moved-from transport");
    return *engine_;
  }

  void check_peer(int peer, const char* what) const {
    if (peer < 0 || peer >= engine_->size) {
      throw_error(errc::invalid_argument, std::string("zmq_transport: ") + what + " with peer " +
                                              std::to_string(peer) + ", world has " +
                                              std::to_string(engine_->size) + " ranks");
    }
  }

  void start(zmq_listener&& bound, int rank, std::vector<std::string> endpoints,
             zmq_options options) {
    const int p = static_cast<int>(endpoints.size());
    const auto deadline = deadline_after(options.connect_timeout);
    auto e = std::make_unique<detail::zmq_engine>(rank, p, std::move(options));
    for (int i = 0; i < p; ++i)
      e->peers[static_cast<std::size_t>(i)].endpoint = endpoints[static_cast<std::size_t>(i)];
    e->peers[static_cast<std::size_t>(rank)].endpoint = bound.endpoint();
    e->who = "zmq_transport (rank " + std::to_string(rank) + " of " + std::to_string(p) + ")";
    int fds[2];
    if (::pipe(fds) != 0) throw_error(errc::io_error, "zmq_transport: cannot create a pipe");
    e->wake_read = fds[0];
    e->wake_write = fds[1];
    (void)::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
    (void)::fcntl(fds[1], F_SETFL, ::fcntl(fds[1], F_GETFL) | O_NONBLOCK);
    // The listener's context and socket move into the engine.
    e->context.swap(*bound.context_);
    e->router.emplace(std::move(*bound.router_));
    const zmq_options& o = e->options;
    e->router->set(zmq::sockopt::maxmsgsize, static_cast<std::int64_t>(std::min<std::uint64_t>(
                                                 o.max_message_bytes, INT64_MAX)));
    e->dealers.resize(static_cast<std::size_t>(p));
    e->monitors.resize(static_cast<std::size_t>(p));
    try {
      for (int i = 0; i < p; ++i) {
        if (i == rank) continue;
        auto& d =
            e->dealers[static_cast<std::size_t>(i)].emplace(e->context, zmq::socket_type::dealer);
        // Routing id "r" + rank (u32 little-endian): ids starting with a zero byte are
        // reserved by ZeroMQ.
        char id[5] = {'r', 0, 0, 0, 0};
        detail::frame_store_u32(reinterpret_cast<std::byte*>(id + 1),
                                static_cast<std::uint32_t>(rank));
        d.set(zmq::sockopt::routing_id, std::string_view(id, sizeof id));
        d.set(zmq::sockopt::sndhwm, 0);
        d.set(zmq::sockopt::linger, static_cast<int>(o.linger.count()));
        d.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(o.heartbeat_interval.count()));
        d.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(o.heartbeat_timeout.count()));
        d.set(zmq::sockopt::heartbeat_ttl, static_cast<int>(o.heartbeat_timeout.count()));
        const std::string mon = "inproc://stellatrain-monitor-" +
                                std::to_string(reinterpret_cast<std::uintptr_t>(e.get())) + "-" +
                                std::to_string(i);
        if (zmq_socket_monitor(static_cast<void*>(d), mon.c_str(),
                               ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED) != 0) {
          throw zmq::error_t();
        }
        auto& m =
            e->monitors[static_cast<std::size_t>(i)].emplace(e->context, zmq::socket_type::pair);
        m.connect(mon);
        d.connect(endpoints[static_cast<std::size_t>(i)]);
      }
    } catch (const zmq::error_t& err) {
      throw error(errc::io_error, e->who + ": cannot set up the connections: " + err.what());
    }
    {
      std::lock_guard lock(e->mutex);
      for (int i = 0; i < p; ++i) {
        if (i != rank) e->post_control(i, detail::frame_kind::hello);
      }
    }
    detail::zmq_engine* raw = e.get();
    e->io = std::thread([raw] { raw->run(); });
    engine_ = std::move(e);
    // Wait for every peer's greeting and our connection to it.
    std::unique_lock lock(raw->mutex);
    auto ready = [&] {
      if (raw->failed || raw->io_done) return true;
      for (int i = 0; i < p; ++i) {
        const auto& peer = raw->peers[static_cast<std::size_t>(i)];
        if (i != rank && !(peer.greeted && peer.connected)) return false;
      }
      return true;
    };
    if (!raw->cv.wait_until(lock, deadline, ready) || raw->failed) {
      std::string missing;
      for (int i = 0; i < p; ++i) {
        const auto& peer = raw->peers[static_cast<std::size_t>(i)];
        if (i != rank && !(peer.greeted && peer.connected))
          missing += (missing.empty() ? "" : ", ") + raw->peer_name(i);
      }
      const std::string why = raw->failed
                                  ? raw->failure
                                  : raw->who + ": not connected within " +
                                        std::to_string(raw->options.connect_timeout.count()) +
                                        " ms to " + missing;
      const errc code = raw->failed ? errc::peer_failure : errc::timeout;
      raw->teardown = true;
      lock.unlock();
      raw->wake();
      raw->io.join();
      engine_.reset();
      throw error(code, why);
    }
  }

  request_type post_recv(int source, tag_type tag, detail::zmq_op_kind kind, std::byte* data,
                         std::size_t size, message_buffer* buffer) {
    detail::zmq_engine& e = engine();
    check_peer(source, "irecv");
    auto op = std::make_shared<detail::zmq_op>();
    op->kind = kind;
    op->peer = source;
    op->tag = tag;
    op->recv_data = data;
    op->recv_size = size;
    op->recv_buffer = buffer;
    op->engine = &e;
    std::unique_lock lock(e.mutex);
    e.check_usable("irecv");
    const auto it = std::find_if(
        e.unexpected.begin(), e.unexpected.end(),
        [&](const detail::zmq_incoming& m) { return m.peer == source && m.tag == tag; });
    if (it != e.unexpected.end()) {
      zmq::message_t payload = std::move(it->payload);
      e.unexpected.erase(it);
      op->state.store(detail::zmq_taken, std::memory_order_relaxed);
      lock.unlock();
      e.deliver(*op, payload);
      return request_type(std::move(op));
    }
    if (source != e.rank && e.peers[static_cast<std::size_t>(source)].said_bye) {
      e.finish_locked(*op, detail::zmq_failed, errc::peer_failure,
                      e.who + ": rank " + std::to_string(e.rank) + " receives from " +
                          e.peer_name(source) + " (tag " + std::to_string(tag) +
                          "), which has closed its transport");
      return request_type(std::move(op));
    }
    e.posted.push_back(op);
    return request_type(std::move(op));
  }

  void shutdown() noexcept {
    if (!engine_) return;
    detail::zmq_engine& e = *engine_;
    {
      std::lock_guard lock(e.mutex);
      if (!e.failed && !e.teardown) {
        try {
          for (int p = 0; p < e.size; ++p) {
            if (p != e.rank) e.post_control(p, detail::frame_kind::bye);
          }
        } catch (...) {
        }
      }
      e.stop = true;
    }
    e.wake();
    if (e.io.joinable()) e.io.join();
    engine_.reset();
  }

  std::unique_ptr<detail::zmq_engine> engine_;
};

static_assert(transport_request<zmq_request>);
static_assert(message_transport<zmq_transport>);

}  // namespace stellatrain
