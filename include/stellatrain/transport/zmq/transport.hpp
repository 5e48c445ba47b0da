// SPDX-License-Identifier: Apache-2.0
// The ZeroMQ transport (`zmq_transport`): connection set-up, sends, receives, abort and
// shutdown over the engine of zmq/engine.hpp.
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>
#include <stellatrain/transport/zmq/engine.hpp>
#include <stellatrain/transport/zmq/options.hpp>
#include <stellatrain/transport/zmq/peers.hpp>
#include <stellatrain/transport/zmq/request.hpp>

#include <zmq.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace stellatrain {

/// A rank of a ZeroMQ world (models `message_transport`).
///
/// Each rank binds one ROUTER socket and connects one DEALER to every other rank (a full
/// mesh of TCP connections); one I/O thread per transport moves the messages. Every message
/// is a 32-byte header (length, tag, source, CRC32C of the header; see detail/frame.hpp)
/// and the payload, sent without copying; the receiver verifies the header and the payload
/// length (and CRC32C with `payload_checksum`) before it trusts or copies anything.
///
/// - Construction blocks until every rank has connected and greeted (each greeting carries
///   the world size: a rank that finds a peer of another world size tells every peer why, so
///   that every rank's construction fails with that reason), or `connect_timeout` passes.
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
      // After a failure (a mismatched world), what is queued still leaves: the aborts that
      // tell the peers why. After a timeout nothing is owed to anyone.
      (raw->failed ? raw->stop : raw->teardown) = true;
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

static_assert(message_transport<zmq_transport>);

}  // namespace stellatrain
