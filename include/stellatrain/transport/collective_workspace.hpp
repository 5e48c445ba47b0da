// SPDX-License-Identifier: Apache-2.0
// Caller-owned scratch state of the collectives (request lists, length slots, reduction
// buffers), so that a collective run every step allocates nothing once warm.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace stellatrain {

/// Scratch state of the collectives for one transport type: keep one per thread that runs
/// collectives and pass it to every call; its vectors and buffers keep their capacity.
/// A collective leaves it empty of requests when it returns or throws.
template <transport Transport>
struct collective_workspace {
  using request_type = typename Transport::request_type;
  std::vector<request_type> sends;                ///< sends in flight, in posting order
  std::vector<request_type> recvs;                ///< receives in flight
  std::vector<std::array<std::byte, 8>> lengths;  ///< little-endian u64 length messages
  std::vector<std::size_t> marks;                 ///< positions in `sends` (per step)
  message_buffer scratch;                         ///< reduction buffers

  /// Drops every request; pending ones are cancelled (see `transport_request`).
  void release_requests() noexcept {
    recvs.clear();
    sends.clear();
  }
};

namespace detail {

// What a collective tells in its errors: "<name> (<algorithm>, tag T) on rank R of P".
struct collective_context {
  const char* name = "";
  const char* algorithm = "";
  tag_type tag = 0;
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  transport_clock::time_point deadline{};

  [[nodiscard]] std::string where() const {
    return std::string(name) + " (" + algorithm + ", tag " + std::to_string(tag) + ") on rank " +
           std::to_string(rank) + " of " + std::to_string(size);
  }
};

template <class Transport>
collective_context make_context(const Transport& t, const char* name, const char* algorithm,
                                tag_type tag, std::chrono::milliseconds timeout) {
  collective_context c;
  c.name = name;
  c.algorithm = algorithm;
  c.tag = tag;
  c.rank = t.rank();
  c.size = t.size();
  c.timeout = timeout;
  c.deadline = deadline_after(timeout);
  return c;
}

// Waits for `request` until the collective's deadline. A timeout becomes errc::timeout, a
// failure of the request keeps its code; both messages say where and what was awaited
// (`what()` is only called on failure).
template <class Request, class What>
void await(Request& request, const collective_context& ctx, What&& what) {
  bool done = false;
  try {
    done = request.wait_until(ctx.deadline);
  } catch (const error& e) {
    throw error(static_cast<errc>(e.code().value()),
                ctx.where() + ": failed while waiting for " + what() + ": " + e.what());
  }
  if (!done) {
    throw error(errc::timeout, ctx.where() + ": timed out after " +
                                   std::to_string(ctx.timeout.count()) + " ms waiting for " +
                                   what());
  }
}

template <class Transport>
void await_sends(collective_workspace<Transport>& ws, const collective_context& ctx,
                 std::size_t begin = 0, std::size_t end = static_cast<std::size_t>(-1)) {
  end = std::min(end, ws.sends.size());
  for (std::size_t i = begin; i < end; ++i) {
    await(ws.sends[i], ctx, [&] {
      return "send " + std::to_string(i + 1) + " of " + std::to_string(ws.sends.size()) +
             " to complete";
    });
  }
}

inline std::array<std::byte, 8> encode_length(std::uint64_t n) noexcept {
  std::array<std::byte, 8> b{};
  frame_store_u64(b.data(), n);
  return b;
}

inline std::uint64_t decode_length(const std::array<std::byte, 8>& b, std::uint64_t max,
                                   const collective_context& ctx, int origin) {
  const std::uint64_t n = frame_load_u64(b.data());
  if (n > max) {
    throw_error(errc::malformed_message, ctx.where() + ": rank " + std::to_string(origin) +
                                             "'s message announces " + std::to_string(n) +
                                             " bytes, above the limit of " + std::to_string(max));
  }
  return n;
}

// Number of chunk messages of an n-byte message (0 for an empty one).
inline std::uint64_t message_chunk_count(std::uint64_t n, std::uint64_t chunk) noexcept {
  if (n == 0) return 0;
  if (chunk == 0) return 1;
  return (n - 1) / chunk + 1;
}

// Chunk c of message m cut into `chunk`-byte pieces (the whole message when `chunk` is 0).
template <class Byte>
std::span<Byte> message_chunk(std::span<Byte> m, std::uint64_t chunk, std::uint64_t c) noexcept {
  if (chunk == 0) return m;
  const std::uint64_t b = c * chunk;
  return m.subspan(static_cast<std::size_t>(b),
                   static_cast<std::size_t>(std::min<std::uint64_t>(chunk, m.size() - b)));
}

// Runs a collective's body; on failure cancels its requests, aborts the transport when asked
// (so that every rank fails now instead of at its timeout) and rethrows.
template <class Transport, class Body>
void run_collective(Transport& t, collective_workspace<Transport>& ws, bool abort_on_failure,
                    Body&& body) {
  ws.release_requests();
  try {
    body();
  } catch (const std::exception& e) {
    if (abort_on_failure) abort_transport(t, e.what());
    ws.release_requests();
    throw;
  } catch (...) {
    if (abort_on_failure) abort_transport(t, "a collective failed with an unknown exception");
    ws.release_requests();
    throw;
  }
  ws.release_requests();
}

inline int ring_index(long long i, int p) noexcept {
  const long long m = i % p;
  return static_cast<int>(m < 0 ? m + p : m);
}

}  // namespace detail

}  // namespace stellatrain
