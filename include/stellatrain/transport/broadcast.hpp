// SPDX-License-Identifier: Apache-2.0
// Broadcast of one rank's bytes to every rank: a chain from the root, pipelined in chunks,
// on any `transport`.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

namespace stellatrain {

namespace detail {

// The chain root, root+1, ..., root-1: each rank receives the length and the chunks from its
// predecessor and forwards each chunk to its successor as soon as it has arrived.
// `prepare(n)` gives the span of n bytes to receive into (on non-roots).
template <transport Transport, class Prepare>
void broadcast_chain(Transport& t, int root, std::span<const std::byte> root_data,
                     Prepare&& prepare, const broadcast_options& opt,
                     collective_workspace<Transport>& ws, const collective_context& ctx) {
  const int p = t.size();
  const int r = t.rank();
  const int pos = ring_index(r - root, p);
  const int prev = ring_index(r - 1, p);
  const int next = ring_index(r + 1, p);
  const bool has_next = pos + 1 < p;
  const std::uint64_t chunk = chunk_bytes_for(t, opt.chunk_bytes);
  ws.lengths.resize(1);
  if (pos == 0) {
    ws.lengths[0] = encode_length(root_data.size());
    ws.sends.push_back(t.isend(next, opt.tag, ws.lengths[0]));
    for (std::uint64_t c = 0; c < message_chunk_count(root_data.size(), chunk); ++c) {
      ws.sends.push_back(t.isend(next, opt.tag, message_chunk(root_data, chunk, c)));
    }
    await_sends(ws, ctx);
    return;
  }
  {
    auto length_recv = t.irecv(prev, opt.tag, ws.lengths[0]);
    await(length_recv, ctx, [&] {
      return "the length of rank " + std::to_string(root) + "'s message from rank " +
             std::to_string(prev);
    });
  }
  const std::uint64_t n = decode_length(ws.lengths[0], opt.max_message_bytes, ctx, root);
  std::span<std::byte> dst = prepare(n);
  if (has_next) ws.sends.push_back(t.isend(next, opt.tag, ws.lengths[0]));
  const std::uint64_t chunks = message_chunk_count(n, chunk);
  for (std::uint64_t c = 0; c < chunks; ++c)
    ws.recvs.push_back(t.irecv(prev, opt.tag, message_chunk(dst, chunk, c)));
  for (std::uint64_t c = 0; c < chunks; ++c) {
    await(ws.recvs[static_cast<std::size_t>(c)], ctx, [&] {
      return "chunk " + std::to_string(c + 1) + " of " + std::to_string(chunks) + " from rank " +
             std::to_string(prev);
    });
    if (has_next)
      ws.sends.push_back(
          t.isend(next, opt.tag, message_chunk(std::span<const std::byte>(dst), chunk, c)));
  }
  await_sends(ws, ctx);
}

inline void check_root(int root, int size, const char* name) {
  if (root < 0 || root >= size) {
    throw_error(errc::invalid_argument, std::string(name) + ": root " + std::to_string(root) +
                                            " outside 0.." + std::to_string(size - 1));
  }
}

}  // namespace detail

/// Sends the root's `data` to every rank; on the others `data` is resized to it and filled.
///
/// - Every rank passes the same `root`. Chain algorithm: root -> root+1 -> ... -> root-1,
///   the length first (8 bytes), then `chunk_bytes` chunks, each forwarded as soon as it has
///   arrived: time ~ n / bandwidth + (P-1) x (chunk time + latency). Bytes sent per non-last
///   rank: n.
/// - Failure: as `sparse_allgather`.
///
/// \code
///   stellatrain::message_buffer params;   // filled on rank 0
///   stellatrain::broadcast(t, 0, params, {.tag = 2});
/// \endcode
template <transport Transport>
void broadcast(Transport& t, int root, message_buffer& data, const broadcast_options& opt,
               collective_workspace<Transport>& ws) {
  static_assert(
      !device_memory_transport<Transport>,
      "a message_buffer is host memory; broadcast device memory through the span overload");
  detail::check_root(root, t.size(), "broadcast");
  if (t.size() == 1) return;
  const auto ctx = detail::make_context(t, "broadcast", "chain", opt.tag, opt.timeout);
  detail::run_collective(t, ws, opt.abort_on_failure, [&] {
    detail::broadcast_chain(
        t, root, std::as_const(data).span(),
        [&](std::uint64_t n) {
          data.resize_for_overwrite(static_cast<std::size_t>(n));
          return data.span();
        },
        opt, ws, ctx);
  });
}

/// Broadcast into a span of known size: every rank passes `data` of the root's size (a rank
/// whose size differs fails with `errc::size_mismatch`, and with `abort_on_failure` so do
/// the others). For example rank 0's initial parameters, as bytes.
template <transport Transport>
void broadcast(Transport& t, int root, std::span<std::byte> data, const broadcast_options& opt,
               collective_workspace<Transport>& ws) {
  detail::check_root(root, t.size(), "broadcast");
  if constexpr (requires {
                  { t.native_broadcast(root, data, opt) } -> std::same_as<bool>;
                }) {
    if (t.native_broadcast(root, data, opt)) return;
  }
  if (t.size() == 1) return;
  const auto ctx = detail::make_context(t, "broadcast", "chain", opt.tag, opt.timeout);
  detail::run_collective(t, ws, opt.abort_on_failure, [&] {
    detail::broadcast_chain(
        t, root, std::span<const std::byte>(data),
        [&](std::uint64_t n) {
          if (n != data.size()) {
            throw_error(errc::size_mismatch, ctx.where() + ": the root sends " + std::to_string(n) +
                                                 " bytes, this rank expects " +
                                                 std::to_string(data.size()));
          }
          return data;
        },
        opt, ws, ctx);
  });
}

/// As above with a temporary workspace (allocates per call).
template <transport Transport>
void broadcast(Transport& t, int root, message_buffer& data, const broadcast_options& opt = {}) {
  collective_workspace<Transport> ws;
  broadcast(t, root, data, opt, ws);
}

/// As above with a temporary workspace (allocates per call).
template <transport Transport>
void broadcast(Transport& t, int root, std::span<std::byte> data,
               const broadcast_options& opt = {}) {
  collective_workspace<Transport> ws;
  broadcast(t, root, data, opt, ws);
}

}  // namespace stellatrain
