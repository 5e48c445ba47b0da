// SPDX-License-Identifier: Apache-2.0
// The `transport` concept: ranks exchanging tagged byte messages asynchronously, with bounded
// waits. Collectives, decorators and the pipeline are written against it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace stellatrain {

namespace detail {

// Calls t.abort(reason) where the transport has it; a no-op otherwise.
template <class T>
void abort_transport(T& t, std::string_view reason) noexcept {
  if constexpr (requires { t.abort(reason); }) t.abort(reason);
}

}  // namespace detail

/// Tags separate independent streams of messages between the same two ranks (for example two
/// collectives in flight at once). Tags below 2^15 work on every backend (MPI guarantees no
/// more); the in-process and ZeroMQ backends accept every value.
using tag_type = std::uint32_t;

/// The clock of every deadline in the transport layer.
using transport_clock = std::chrono::steady_clock;

/// The completion handle of one asynchronous send or receive.
///
/// Requirements, for `R& r` and a `transport_clock::time_point d`:
/// - `r.test()`: never blocks; `true` once the operation has completed (and from then on).
///   Throws `stellatrain::error` when the operation failed (a peer failed or closed:
///   `errc::peer_failure`; a message of the wrong length: `errc::size_mismatch`; bytes that do
///   not parse: `errc::malformed_message` / `errc::checksum_mismatch`), and again on every
///   later call.
/// - `r.wait_until(d)`: blocks until the operation completed (`true`) or `d` passed
///   (`false`: still pending, the request stays valid); throws as `test()` does.
/// - Default construction gives an empty request that counts as complete; requests are
///   movable, not copyable, and used by one thread at a time.
/// - Destroying a request whose operation has not completed cancels it where the backend can
///   (a receive is withdrawn; a send not yet matched is withdrawn); when a backend cannot
///   take a send back, it marks the transport failed instead (see the backend). After the
///   destructor returns the backend never touches the request's buffer again.
template <class R>
concept transport_request = std::movable<R> && std::default_initializable<R> &&
    requires(R& r, transport_clock::time_point deadline) {
  { r.test() } -> std::same_as<bool>;
  { r.wait_until(deadline) } -> std::same_as<bool>;
};

/// P ranks that send each other tagged messages of bytes.
///
/// Requirements, for `T& t`, `const T& ct`, a peer rank `p` in `[0, size())`, a `tag_type
/// tag`, `std::span<const std::byte> out` and `std::span<std::byte> in`:
/// - `T::request_type` models `transport_request`.
/// - `ct.rank()`, `ct.size()` (noexcept, `int`): this rank, and the number of ranks (>= 1).
/// - `t.isend(p, tag, out)`: starts sending the bytes of `out` to `p`; `out` must stay valid
///   and unchanged until the request completes.
/// - `t.irecv(p, tag, in)`: starts receiving one message from `p` with this tag into `in`;
///   the message must have exactly `in.size()` bytes (otherwise the request fails with
///   `errc::size_mismatch` and `in` holds unspecified bytes); `in` must stay valid until the
///   request completes.
/// - Ordering: messages from one source with one tag are received in the order they were
///   sent, by receives in the order they were posted (MPI's non-overtaking rule). Messages
///   with different tags or from different sources are independent.
/// - Sends never wait for the matching receive to be posted before they can make progress
///   (receives may be posted after the send; every backend buffers or defers). A program that
///   posts its receives before waiting for its sends cannot deadlock.
/// - Thread safety: every member function may be called from several threads at once.
/// - A transport may also provide `t.preferred_chunk_bytes()`: the pipelining chunk the
///   collectives use on it by default (see `auto_chunk_bytes`).
/// - A transport may also provide `t.abort(reason)` (noexcept): it marks the transport
///   failed and tells the other ranks, whose pending and later operations then fail with
///   `errc::peer_failure` instead of waiting for their timeouts. Collectives call it when
///   they fail, so that no rank takes a partial exchange for a complete one.
///
/// Backends: `in_process_transport` (threads of one process), `mpi_transport`,
/// `zmq_transport`, and `nccl_transport` (device memory, stream-ordered; see nccl.cuh).
/// Decorators: `shaped_transport`, `metered_transport`; type erasure: `any_transport`.
///
/// A minimal conforming transport (one rank that talks only to itself; a complete, tested
/// version of it is in tests/transport/test_concept.cpp):
/// \code
///   struct loopback {
///     struct request_type {
///       bool test() { return true; }
///       bool wait_until(stellatrain::transport_clock::time_point) { return true; }
///     };
///     int rank() const noexcept { return 0; }
///     int size() const noexcept { return 1; }
///     request_type isend(int, stellatrain::tag_type, std::span<const std::byte> b) {
///       queue.emplace_back(b.begin(), b.end());  // a real one matches on tag, see the test
///       return {};
///     }
///     request_type irecv(int, stellatrain::tag_type, std::span<std::byte> b) {
///       if (queue.front().size() != b.size())
///         throw stellatrain::error(stellatrain::errc::size_mismatch, "loopback: wrong size");
///       std::copy(queue.front().begin(), queue.front().end(), b.begin());
///       queue.pop_front();
///       return {};
///     }
///     std::deque<std::vector<std::byte>> queue;
///   };
///   static_assert(stellatrain::transport<loopback>);
/// \endcode
template <class T>
concept transport = requires(T& t, const T& ct, int peer, tag_type tag,
                             std::span<const std::byte> out, std::span<std::byte> in) {
  typename T::request_type;
  requires transport_request<typename T::request_type>;
  { ct.rank() }
  noexcept->std::same_as<int>;
  { ct.size() }
  noexcept->std::same_as<int>;
  { t.isend(peer, tag, out) } -> std::same_as<typename T::request_type>;
  { t.irecv(peer, tag, in) } -> std::same_as<typename T::request_type>;
};

/// A `transport` that also receives messages of unknown length.
///
/// Requirement, for `message_buffer& m`: `t.irecv(p, tag, m)` starts receiving one message
/// from `p` with this tag, of any length; on completion `m.size()` is its length and `m`
/// holds its bytes. `m` must stay alive, and must not be used, until the request completes.
/// Ordering with the span form is shared (one queue of receives per source and tag).
template <class T>
concept message_transport = transport<T> &&
    requires(T& t, int peer, tag_type tag, message_buffer& m) {
  { t.irecv(peer, tag, m) } -> std::same_as<typename T::request_type>;
};

/// The chunk size the collectives use when their options say `auto_chunk_bytes`: the
/// transport's `preferred_chunk_bytes()` where it has one (MPI: below the eager limit, so that
/// no chunk waits for a rendezvous round trip), else 256 KiB. Every rank must get the same
/// value (same backend, same options).
inline constexpr std::size_t auto_chunk_bytes = static_cast<std::size_t>(-1);

/// The chunk size for `requested` on `t` (see `auto_chunk_bytes`; 0 means whole messages).
template <class T>
[[nodiscard]] std::size_t chunk_bytes_for(const T& t, std::size_t requested) noexcept {
  if (requested != auto_chunk_bytes) return requested;
  if constexpr (requires {
                  { t.preferred_chunk_bytes() } -> std::convertible_to<std::size_t>;
                }) {
    return t.preferred_chunk_bytes();
  } else {
    return std::size_t{256} << 10;
  }
}

/// True for transports whose spans are device memory (`nccl_transport`): the generic
/// point-to-point collectives cannot run on them (they read lengths on the host), only the
/// transport's native ones.
template <class T>
inline constexpr bool device_memory_transport = requires {
  requires T::device_memory;
};

/// Views an object's bytes, for sending trivially copyable values (lengths, flags).
template <class T>
requires std::is_trivially_copyable_v<T>
[[nodiscard]] std::span<const std::byte> object_bytes(const T& value) noexcept {
  return {reinterpret_cast<const std::byte*>(&value), sizeof(T)};
}

/// Writable view of an object's bytes, for receiving trivially copyable values.
template <class T>
requires std::is_trivially_copyable_v<T>
[[nodiscard]] std::span<std::byte> object_bytes(T& value) noexcept {
  return {reinterpret_cast<std::byte*>(&value), sizeof(T)};
}

/// `transport_clock::now() + timeout`, saturating instead of overflowing for huge timeouts.
template <class Rep, class Period>
[[nodiscard]] transport_clock::time_point deadline_after(
    std::chrono::duration<Rep, Period> timeout) noexcept {
  const auto now = transport_clock::now();
  const auto left = transport_clock::time_point::max() - now;
  // Compared in the caller's unit: converting hours::max() to nanoseconds would overflow.
  if (timeout >= std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(left)) {
    return transport_clock::time_point::max();
  }
  return now + std::chrono::duration_cast<transport_clock::duration>(timeout);
}

/// Waits for `request` until `deadline`; throws `error(errc::timeout, what)` when the
/// deadline passes first, and whatever the request throws when its operation failed.
template <transport_request Request>
void wait_or_throw(Request& request, transport_clock::time_point deadline, std::string_view what) {
  if (!request.wait_until(deadline)) throw_error(errc::timeout, what);
}

/// Waits for `request` at most `timeout`; see the deadline overload.
template <transport_request Request, class Rep, class Period>
void wait_or_throw(Request& request, std::chrono::duration<Rep, Period> timeout,
                   std::string_view what) {
  wait_or_throw(request, deadline_after(timeout), what);
}

}  // namespace stellatrain
