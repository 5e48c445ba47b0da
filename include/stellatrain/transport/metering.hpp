// SPDX-License-Identifier: Apache-2.0
// A decorator that counts the bytes and messages a transport moves per peer and measures the
// throughput it achieves: the input of the pipeline's bandwidth controller.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

/// Traffic with one peer.
struct peer_traffic {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
};

/// One completed message, as the metering decorator saw it.
struct transfer_record {
  int peer = 0;
  tag_type tag = 0;
  bool sent = true;  ///< true for a send, false for a receive
  std::uint64_t bytes = 0;
  transport_clock::time_point posted{};     ///< when isend/irecv was called
  transport_clock::time_point completed{};  ///< when completion was first observed
};

/// Counters of a `metered_transport` since its construction or last `reset`.
///
/// Busy times are the union of the intervals during which at least one send (receive) was
/// in flight, from its posting to the first `test`/`wait_until` that saw it complete; so the
/// rates below are what the link achieved while it was in use, not averaged over idle time.
/// They are good link estimates when messages are large and the caller waits promptly.
/// A send completes when the backend is done with the caller's buffer: on the in-process
/// backend when the receiver has its copy, on socket backends when the bytes are in the
/// kernel (for messages well above the socket buffer, the link rate). A receive posted long
/// before its sender sends counts the wait as busy: prefer the send rate for estimates.
struct traffic_snapshot {
  std::vector<peer_traffic> peers;  ///< indexed by rank
  peer_traffic total;
  std::chrono::nanoseconds send_busy{0};
  std::chrono::nanoseconds recv_busy{0};
  std::chrono::nanoseconds elapsed{0};  ///< since construction or reset

  /// Bits sent per second of send-busy time (0 when nothing was sent).
  [[nodiscard]] double send_bits_per_second() const noexcept {
    const double s = std::chrono::duration<double>(send_busy).count();
    return s > 0 ? static_cast<double>(total.bytes_sent) * 8.0 / s : 0.0;
  }
  /// Bits received per second of receive-busy time (0 when nothing was received).
  [[nodiscard]] double recv_bits_per_second() const noexcept {
    const double s = std::chrono::duration<double>(recv_busy).count();
    return s > 0 ? static_cast<double>(total.bytes_received) * 8.0 / s : 0.0;
  }
};

/// Options of `metered_transport`.
struct metering_options {
  /// Called once per completed message (on the thread that observed the completion); empty
  /// for none. Must not call back into the transport.
  std::function<void(const transfer_record&)> on_transfer{};
};

namespace detail {

struct metering_state {
  explicit metering_state(int size, metering_options o)
      : peers(static_cast<std::size_t>(size > 0 ? size : 0)),
        options(std::move(o)),
        since(transport_clock::now()) {}

  void begin(bool send, transport_clock::time_point now) {
    std::lock_guard lock(mutex);
    int& n = send ? sends_in_flight : recvs_in_flight;
    if (n++ == 0) (send ? send_busy_since : recv_busy_since) = now;
  }

  void end(bool send, int peer, std::uint64_t bytes, bool counted,
           transport_clock::time_point now) {
    std::lock_guard lock(mutex);
    int& n = send ? sends_in_flight : recvs_in_flight;
    if (--n == 0)
      (send ? send_busy : recv_busy) += now - (send ? send_busy_since : recv_busy_since);
    if (!counted) return;
    peer_traffic& p = peers[static_cast<std::size_t>(peer)];
    if (send) {
      p.bytes_sent += bytes;
      ++p.messages_sent;
    } else {
      p.bytes_received += bytes;
      ++p.messages_received;
    }
  }

  std::mutex mutex;
  std::vector<peer_traffic> peers;
  metering_options options;
  int sends_in_flight = 0;
  int recvs_in_flight = 0;
  transport_clock::time_point send_busy_since{};
  transport_clock::time_point recv_busy_since{};
  transport_clock::duration send_busy{0};
  transport_clock::duration recv_busy{0};
  transport_clock::time_point since;
};

// The operation of a metered_request: the inner request and what is counted when it
// completes. Never empty to the request base: the inner request keeps the answer, and a
// failed one throws again on every later call.
template <class Inner>
struct metered_handle {
  typename Inner::request_type inner{};
  metering_state* state = nullptr;
  message_buffer* buffer = nullptr;
  transfer_record record{};

  bool empty() const noexcept { return false; }

  bool test() {
    return observe([&] { return inner.test(); });
  }
  bool wait_until(transport_clock::time_point d) {
    return observe([&] { return inner.wait_until(d); });
  }

  template <class F>
  bool observe(F&& f) {
    bool done = false;
    try {
      done = f();
    } catch (...) {
      finish(false);
      throw;
    }
    if (done) finish(true);
    return done;
  }

  void cancel() noexcept { finish(false); }

  void finish(bool completed) noexcept {
    if (state == nullptr) return;
    metering_state* s = std::exchange(state, nullptr);
    record.completed = transport_clock::now();
    if (completed && buffer != nullptr) record.bytes = buffer->size();
    s->end(record.sent, record.peer, record.bytes, completed, record.completed);
    if (completed && s->options.on_transfer) {
      try {
        s->options.on_transfer(record);
      } catch (...) {
      }
    }
  }
};

}  // namespace detail

template <transport Inner>
class metered_transport;

/// The completion handle of `metered_transport`: the inner request, counted on completion.
template <transport Inner>
class metered_request : public detail::request_base<detail::metered_handle<Inner>> {
 public:
  metered_request() = default;

 private:
  friend class metered_transport<Inner>;
  using handle = detail::metered_handle<Inner>;

  metered_request(typename Inner::request_type r, detail::metering_state* s, message_buffer* buffer,
                  transfer_record rec)
      : metered_request::request_base(started(std::move(r), s, buffer, rec)) {}

  // Counts the operation in flight before the base owns the handle: when begin() throws, no
  // request exists whose destructor would end an operation that never began.
  static handle started(typename Inner::request_type r, detail::metering_state* s,
                        message_buffer* buffer, transfer_record rec) {
    s->begin(rec.sent, rec.posted);
    return handle{std::move(r), s, buffer, rec};
  }
};

/// Wraps a transport (owned) and meters it: bytes and messages per peer (counted when a
/// message completes, so failed or cancelled ones are not counted), busy times and the
/// achieved send / receive rates (see `traffic_snapshot`). Thread safe; one mutex per call.
/// Native collectives of the inner transport are not used through it (they would bypass
/// the counters).
///
/// \code
///   stellatrain::metered_transport t(std::move(raw));
///   stellatrain::sparse_allgather(t, mine, got);
///   auto s = t.snapshot();          // s.total.bytes_sent, s.send_bits_per_second(), ...
///   t.reset();                      // start a new measurement window
/// \endcode
template <transport Inner>
class metered_transport {
 public:
  using request_type = metered_request<Inner>;

  explicit metered_transport(Inner inner, metering_options options = {})
      : inner_(std::move(inner)),
        state_(std::make_unique<detail::metering_state>(inner_.size(), std::move(options))) {}

  [[nodiscard]] int rank() const noexcept { return inner_.rank(); }
  [[nodiscard]] int size() const noexcept { return inner_.size(); }
  [[nodiscard]] Inner& inner() noexcept { return inner_; }

  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    const auto now = transport_clock::now();
    return request_type(inner_.isend(dest, tag, bytes), state_.get(), nullptr,
                        transfer_record{dest, tag, true, bytes.size(), now, {}});
  }

  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    const auto now = transport_clock::now();
    return request_type(inner_.irecv(source, tag, into), state_.get(), nullptr,
                        transfer_record{source, tag, false, into.size(), now, {}});
  }

  request_type irecv(int source, tag_type tag,
                     message_buffer& into) requires message_transport<Inner> {
    const auto now = transport_clock::now();
    return request_type(inner_.irecv(source, tag, into), state_.get(), &into,
                        transfer_record{source, tag, false, 0, now, {}});
  }

  /// The inner transport's chunk preference (see `auto_chunk_bytes`).
  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept {
    return chunk_bytes_for(inner_, auto_chunk_bytes);
  }

  void abort(std::string_view reason) noexcept { detail::abort_transport(inner_, reason); }

  /// The counters now (a consistent copy).
  [[nodiscard]] traffic_snapshot snapshot() const {
    detail::metering_state& s = *state_;
    std::lock_guard lock(s.mutex);
    const auto now = transport_clock::now();
    traffic_snapshot out;
    out.peers = s.peers;
    for (const peer_traffic& p : s.peers) {
      out.total.bytes_sent += p.bytes_sent;
      out.total.bytes_received += p.bytes_received;
      out.total.messages_sent += p.messages_sent;
      out.total.messages_received += p.messages_received;
    }
    out.send_busy = s.send_busy + (s.sends_in_flight > 0 ? now - s.send_busy_since
                                                         : transport_clock::duration{0});
    out.recv_busy = s.recv_busy + (s.recvs_in_flight > 0 ? now - s.recv_busy_since
                                                         : transport_clock::duration{0});
    out.elapsed = now - s.since;
    return out;
  }

  /// Zeroes the counters; operations in flight count toward the new window from now.
  void reset() {
    detail::metering_state& s = *state_;
    std::lock_guard lock(s.mutex);
    const auto now = transport_clock::now();
    for (peer_traffic& p : s.peers) p = {};
    s.send_busy = s.recv_busy = transport_clock::duration{0};
    s.send_busy_since = s.recv_busy_since = now;
    s.since = now;
  }

 private:
  Inner inner_;
  std::unique_ptr<detail::metering_state> state_;
};

}  // namespace stellatrain
