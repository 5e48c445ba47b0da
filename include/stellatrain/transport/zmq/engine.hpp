// SPDX-License-Identifier: Apache-2.0
// Internals of the ZeroMQ backend: the state of one transport, shared by user threads, and
// the I/O thread that alone touches its sockets.
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>
#include <stellatrain/transport/zmq/options.hpp>

#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

namespace stellatrain {

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
      // A teardown releases the zero-copy buffers of abandoned sends soon, but gives the
      // queued aborts a moment to leave.
      if (teardown) linger = static_cast<int>(std::min<long long>(options.linger.count(), 200));
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
        // On teardown only control frames still leave (the aborts that tell the peers why);
        // data stays queued and is failed when the thread ends.
        auto next = outbox.begin();
        if (teardown) {
          next = std::find_if(outbox.begin(), outbox.end(),
                              [](const op_ptr& o) { return o->kind == zmq_op_kind::control; });
        }
        if (next == outbox.end()) return;
        op = std::move(*next);
        outbox.erase(next);
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
        if (h.tag != static_cast<std::uint32_t>(size) && !failed) {
          // Every peer learns why, instead of seeing this rank vanish as if it had crashed.
          const std::string why = who + ": " + peer_name(from) + " belongs to a world of " +
                                  std::to_string(h.tag) + " ranks, this rank to one of " +
                                  std::to_string(size);
          for (int p = 0; p < size; ++p)
            if (p != rank) post_control(p, frame_kind::abort, why);
          fail_locked(errc::invalid_argument, why);
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
      if (parts.size() != 2) {
        throw error(errc::malformed_message,
                    who + ": rank " + std::to_string(rank) + " received a message of " +
                        std::to_string(parts.size() + 1) + " frames instead of 3");
      }
      int from = -1;
      std::uint32_t sender = ~std::uint32_t{0};
      if (id.size() == 5 && static_cast<const char*>(id.data())[0] == 'r') {
        sender = frame_load_u32(static_cast<const std::byte*>(id.data()) + 1);
        if (sender < static_cast<std::uint32_t>(size) && static_cast<int>(sender) != rank)
          from = static_cast<int>(sender);
      }
      if (from < 0) {
        if (sender != ~std::uint32_t{0} && sender >= static_cast<std::uint32_t>(size) &&
            refuse_larger_world(sender, parts[0]))
          continue;
        throw error(errc::malformed_message, who + ": rank " + std::to_string(rank) +
                                                 " received a message from an unknown sender");
      }
      on_frame(from, parts[0], parts[1]);
    }
  }

  // A greeting from rank `sender`, a number beyond this world's ranks: the ranks were told of
  // worlds of different sizes. Fails the transport with that reason and tells every peer, as
  // on_frame does for a greeting of another size. False when the frame is no valid greeting.
  bool refuse_larger_world(std::uint32_t sender, const zmq::message_t& header) {
    frame_header h;
    try {
      h = decode_frame(
          std::span<const std::byte>(static_cast<const std::byte*>(header.data()), header.size()),
          sender, options.max_message_bytes, who);
    } catch (const error&) {
      return false;
    }
    if (h.kind != frame_kind::hello) return false;
    std::lock_guard lock(mutex);
    if (!failed) {
      const std::string why = who + ": rank " + std::to_string(sender) + " belongs to a world of " +
                              std::to_string(h.tag) + " ranks, this rank to one of " +
                              std::to_string(size);
      for (int p = 0; p < size; ++p)
        if (p != rank) post_control(p, frame_kind::abort, why);
      fail_locked(errc::invalid_argument, why);
    }
    return true;
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

}  // namespace stellatrain
