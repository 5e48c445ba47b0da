// SPDX-License-Identifier: Apache-2.0
// Dense ring all-reduce (reduce-scatter, then all-gather), pipelined in chunks: the baseline
// that sparse exchange is measured against (what PyTorch DDP does), on any `transport`; and
// its first half on its own, the reduce-scatter.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

namespace stellatrain {

namespace detail {

// dst += src; integers wrap (signed ones are added as unsigned: no overflow UB).
template <class V>
void add_into(V* STELLATRAIN_RESTRICT dst, const V* STELLATRAIN_RESTRICT src,
              std::size_t n) noexcept {
  if constexpr (std::is_integral_v<V> && std::is_signed_v<V>) {
    using U = std::make_unsigned_t<V>;
    for (std::size_t i = 0; i < n; ++i)
      dst[i] = static_cast<V>(static_cast<U>(static_cast<U>(dst[i]) + static_cast<U>(src[i])));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<V>(dst[i] + src[i]);
  }
}

// Segment i of P over n elements: the first n % P segments hold one element more.
inline std::uint64_t segment_begin(std::uint64_t n, int p, int i) noexcept {
  const auto up = static_cast<std::uint64_t>(p);
  const auto ui = static_cast<std::uint64_t>(i);
  return ui * (n / up) + std::min(ui, n % up);
}

// The segments and chunks of a ring over `data`. Ring position s (the segment a rank passes
// on at a given step) is data segment s + shift: with shift 0 the reduce-scatter leaves rank r
// with segment r + 1 (what the all-reduce continues from), with shift -1 with segment r.
template <class V>
struct ring_layout {
  std::uint64_t n = 0;
  int p = 1;
  int shift = 0;
  std::uint64_t chunk = 0;  // elements per chunk, 0: whole segments

  std::uint64_t seg_begin(int s) const noexcept {
    return segment_begin(n, p, ring_index(s + shift, p));
  }
  std::uint64_t seg_size(int s) const noexcept {
    const int d = ring_index(s + shift, p);
    return segment_begin(n, p, d + 1) - segment_begin(n, p, d);
  }
  std::uint64_t chunks_of(int s) const noexcept { return message_chunk_count(seg_size(s), chunk); }
  // Chunk c of segment s of a span laid out like `data` (or of a segment-sized buffer).
  template <class T>
  std::span<T> part(T* base, int s, std::uint64_t c, bool segment_local) const noexcept {
    const std::uint64_t size = seg_size(s);
    const std::uint64_t b = chunk == 0 ? 0 : c * chunk;
    const std::uint64_t len = chunk == 0 ? size : std::min(chunk, size - b);
    T* at = base + (segment_local ? 0 : seg_begin(s)) + b;
    return std::span<T>(at, static_cast<std::size_t>(len));
  }
};

template <class V, class Transport>
ring_layout<V> make_ring_layout(const Transport& t, std::uint64_t n, std::size_t requested_chunk,
                                int shift) {
  const std::size_t chunk_bytes = chunk_bytes_for(t, requested_chunk);
  return {.n = n,
          .p = t.size(),
          .shift = shift,
          .chunk = chunk_bytes == 0 ? 0 : std::max<std::uint64_t>(1, chunk_bytes / sizeof(V))};
}

// The reduce-scatter half of the ring: step s sends ring segment r-s, receives ring segment
// r-s-1 and adds it; afterwards this rank holds the sum of ring segment r+1. Returns where the
// sends of each step begin in ws.sends (marks) and leaves them in flight: the all-gather
// must not overwrite a segment before the send that read it completed.
template <transport Transport, class V>
std::size_t reduce_scatter_phase(Transport& t, std::span<V> data, const ring_layout<V>& L,
                                 tag_type tag, collective_workspace<Transport>& ws,
                                 const collective_context& ctx) {
  const int p = L.p;
  const int r = t.rank();
  const int right = ring_index(r + 1, p);
  const int left = ring_index(r - 1, p);
  auto bytes = [](auto s) { return std::as_writable_bytes(s); };
  auto cbytes = [](auto s) { return std::as_bytes(s); };

  std::uint64_t max_seg = 0;
  for (int s = 0; s < p; ++s) max_seg = std::max(max_seg, L.seg_size(s));
  // Two segment-sized receive buffers: step s receives into half s % 2 while the next
  // step's receives are already posted into the other half.
  ws.scratch.resize_for_overwrite(static_cast<std::size_t>(2 * max_seg * sizeof(V)));
  V* half[2] = {reinterpret_cast<V*>(ws.scratch.data()),
                reinterpret_cast<V*>(ws.scratch.data()) + max_seg};

  ws.marks.assign(static_cast<std::size_t>(p), 0);  // marks[s]: first send of RS step s
  auto post_rs_recvs = [&](int s) {
    const int seg = ring_index(r - s - 1, p);
    for (std::uint64_t c = 0; c < L.chunks_of(seg); ++c) {
      ws.recvs.push_back(t.irecv(left, tag, bytes(L.part(half[s % 2], seg, c, true))));
    }
  };
  // First message: this rank's element count and element size, so that ranks that disagree
  // fail before any data is combined (the failing rank stops forwarding, so no rank can
  // complete the ring with mixed-up segments).
  ws.lengths.resize(2);
  const std::uint64_t n = L.n;
  const std::uint64_t kind = std::is_floating_point_v<V> ? 2 : (std::is_signed_v<V> ? 1 : 0);
  const std::uint64_t shape = (n << 8) | (kind << 4) | sizeof(V);
  ws.lengths[0] = encode_length(shape);
  ws.sends.push_back(t.isend(right, tag, ws.lengths[0]));
  ws.marks[0] = ws.sends.size();
  {
    const int seg = r;
    for (std::uint64_t c = 0; c < L.chunks_of(seg); ++c) {
      ws.sends.push_back(t.isend(right, tag, cbytes(L.part(data.data(), seg, c, false))));
    }
  }
  {
    auto theirs_recv = t.irecv(left, tag, ws.lengths[1]);
    await(theirs_recv, ctx, [&] { return "the element count of rank " + std::to_string(left); });
    const std::uint64_t theirs = frame_load_u64(ws.lengths[1].data());
    if (theirs != shape) {
      auto describe = [](std::uint64_t s) {
        static constexpr const char* kinds[] = {"unsigned", "signed", "floating-point", "?"};
        return std::to_string(s >> 8) + " " + kinds[std::min<std::uint64_t>((s >> 4) & 15u, 3)] +
               " elements of " + std::to_string(s & 15u) + " bytes";
      };
      throw_error(errc::size_mismatch, ctx.where() + ": rank " + std::to_string(left) +
                                           " reduces " + describe(theirs) + ", this rank " +
                                           describe(shape));
    }
  }
  std::size_t recv_at = 0;
  post_rs_recvs(0);
  for (int s = 0; s < p - 1; ++s) {
    const int seg = ring_index(r - s - 1, p);
    const std::uint64_t chunks = L.chunks_of(seg);
    const std::size_t mine_at = recv_at;
    recv_at += static_cast<std::size_t>(chunks);
    if (s + 1 < p - 1) post_rs_recvs(s + 1);
    if (s + 1 < p - 1) ws.marks[static_cast<std::size_t>(s + 1)] = ws.sends.size();
    for (std::uint64_t c = 0; c < chunks; ++c) {
      await(ws.recvs[mine_at + static_cast<std::size_t>(c)], ctx, [&] {
        return "reduce-scatter step " + std::to_string(s + 1) + ": chunk " + std::to_string(c + 1) +
               " of " + std::to_string(chunks) + " of segment " +
               std::to_string(ring_index(seg + L.shift, p)) + " from rank " + std::to_string(left);
      });
      auto dst = L.part(data.data(), seg, c, false);
      auto src = L.part(static_cast<const V*>(half[s % 2]), seg, c, true);
      add_into(dst.data(), src.data(), dst.size());
      if (s + 1 < p - 1) ws.sends.push_back(t.isend(right, tag, cbytes(std::span<const V>(dst))));
    }
  }
  ws.recvs.clear();
  return ws.sends.size();
}

template <class V>
void scale_by_ranks(std::span<V> segment, int p) noexcept {
  if constexpr (std::is_floating_point_v<V>) {
    const V inv = static_cast<V>(1) / static_cast<V>(p);
    for (auto& x : segment) x *= inv;
  }
}

template <transport Transport, class V>
void allreduce_ring(Transport& t, std::span<V> data, const allreduce_options& opt,
                    collective_workspace<Transport>& ws, const collective_context& ctx) {
  const auto L = make_ring_layout<V>(t, data.size(), opt.chunk_bytes, 0);
  const int p = L.p;
  const int r = t.rank();
  const int right = ring_index(r + 1, p);
  const int left = ring_index(r - 1, p);
  auto bytes = [](auto s) { return std::as_writable_bytes(s); };
  auto cbytes = [](auto s) { return std::as_bytes(s); };

  const std::size_t rs_sends_end = reduce_scatter_phase(t, data, L, opt.tag, ws, ctx);

  // This rank now owns the full sum of segment r+1.
  const int owned = ring_index(r + 1, p);
  if (opt.average) {
    scale_by_ranks(data.subspan(static_cast<std::size_t>(L.seg_begin(owned)),
                                static_cast<std::size_t>(L.seg_size(owned))),
                   p);
  }

  // ---- all-gather: step s sends segment r+1-s, receives segment r-s into place. Before a
  // segment is overwritten, the reduce-scatter send that read it (RS step s) must be done.
  auto rs_step_sends = [&](int s) {
    const std::size_t b = ws.marks[static_cast<std::size_t>(s)];
    const std::size_t e = s + 1 < p - 1 ? ws.marks[static_cast<std::size_t>(s + 1)] : rs_sends_end;
    await_sends(ws, ctx, b, e);
  };
  auto post_ag_recvs = [&](int s) {
    const int seg = ring_index(r - s, p);
    rs_step_sends(s);
    for (std::uint64_t c = 0; c < L.chunks_of(seg); ++c) {
      ws.recvs.push_back(t.irecv(left, opt.tag, bytes(L.part(data.data(), seg, c, false))));
    }
  };
  for (std::uint64_t c = 0; c < L.chunks_of(owned); ++c) {
    ws.sends.push_back(t.isend(
        right, opt.tag, cbytes(L.part(static_cast<const V*>(data.data()), owned, c, false))));
  }
  std::size_t recv_at = 0;
  post_ag_recvs(0);
  for (int s = 0; s < p - 1; ++s) {
    const int seg = ring_index(r - s, p);
    const std::uint64_t chunks = L.chunks_of(seg);
    const std::size_t mine_at = recv_at;
    recv_at += static_cast<std::size_t>(chunks);
    if (s + 1 < p - 1) post_ag_recvs(s + 1);
    for (std::uint64_t c = 0; c < chunks; ++c) {
      await(ws.recvs[mine_at + static_cast<std::size_t>(c)], ctx, [&] {
        return "all-gather step " + std::to_string(s + 1) + ": chunk " + std::to_string(c + 1) +
               " of " + std::to_string(chunks) + " of segment " + std::to_string(seg) +
               " from rank " + std::to_string(left);
      });
      if (s + 1 < p - 1) {
        ws.sends.push_back(t.isend(
            right, opt.tag, cbytes(L.part(static_cast<const V*>(data.data()), seg, c, false))));
      }
    }
  }
  await_sends(ws, ctx);
}

}  // namespace detail

/// Sums `data` element-wise across all ranks, in place: on return every rank holds the same
/// sum (bit-identical on every rank: each segment is reduced on one rank, in ring order, and
/// then copied to the others), divided by the number of ranks with `average`.
///
/// - `V` is an arithmetic type; every rank passes the same `data.size()` and `V`: each rank
///   checks its left neighbour's count first, and a mismatch fails with
///   `errc::size_mismatch` before any data is combined. Sums of integers wrap as the type does.
/// - Ring algorithm: reduce-scatter (P-1 steps, each rank sends one segment of n/P
///   elements per step and adds the one it receives) then all-gather (P-1 steps); every
///   segment is cut into `chunk_bytes` chunks that are forwarded as soon as they are
///   reduced, so the latency of the ring is paid about once. Bytes sent per rank:
///   2 (P-1)/P x n x sizeof(V). Workspace: two segments of scratch.
/// - Failure: as `sparse_allgather` (timeouts and peer failures throw, the transport is
///   aborted with `abort_on_failure`, `data` is unspecified after a throw).
///
/// \code
///   std::vector<float> grad(n);
///   stellatrain::dense_allreduce(t, std::span<float>(grad), {.tag = 1, .average = true});
/// \endcode
template <transport Transport, class V>
requires(std::is_arithmetic_v<V> &&
         !std::is_same_v<V, bool>) void dense_allreduce(Transport& t, std::span<V> data,
                                                        const allreduce_options& opt,
                                                        collective_workspace<Transport>& ws) {
  if (opt.average && !std::is_floating_point_v<V>) {
    throw_error(errc::invalid_argument,
                "dense_allreduce: average needs a floating-point element type");
  }
  if (opt.algorithm == allreduce_algorithm::automatic ||
      opt.algorithm == allreduce_algorithm::native) {
    if constexpr (requires {
                    { t.native_allreduce(data, opt) } -> std::same_as<bool>;
                  }) {
      if (t.native_allreduce(data, opt)) return;
    }
    if (opt.algorithm == allreduce_algorithm::native) {
      throw_error(errc::unsupported, "dense_allreduce: this transport has no native all-reduce");
    }
  }
  if (t.size() == 1) return;
  const auto ctx = detail::make_context(t, "dense_allreduce", "ring", opt.tag, opt.timeout);
  detail::run_collective(t, ws, opt.abort_on_failure,
                         [&] { detail::allreduce_ring(t, data, opt, ws, ctx); });
}

/// As above with a temporary workspace (allocates per call).
template <transport Transport, class V>
requires(std::is_arithmetic_v<V> &&
         !std::is_same_v<V, bool>) void dense_allreduce(Transport& t, std::span<V> data,
                                                        const allreduce_options& opt = {}) {
  collective_workspace<Transport> ws;
  dense_allreduce(t, data, opt, ws);
}

/// The segment of `data` that rank `rank` of `ranks` owns after `dense_reduce_scatter` (and
/// the shards of the hierarchical exchange): [begin, end) with the first n % ranks segments
/// one element longer.
struct segment_range {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  [[nodiscard]] std::uint64_t size() const noexcept { return end - begin; }
};

[[nodiscard]] inline segment_range segment_of(std::uint64_t n, int ranks, int rank) noexcept {
  return {detail::segment_begin(n, ranks, rank), detail::segment_begin(n, ranks, rank + 1)};
}

/// Sums `data` element-wise across all ranks, leaving each rank with the sum of its own
/// segment only: on return `data[segment_of(n, P, rank)]` holds the sum over every rank
/// (divided by P with `average`); the rest of `data` is unspecified. Half of
/// `dense_allreduce` (its reduce-scatter), with the same checks, chunking and failure
/// behaviour; bytes sent per rank: (P-1)/P x n x sizeof(V). `opt.algorithm` other than
/// `automatic` or `ring` is `errc::unsupported`.
///
/// \code
///   stellatrain::dense_reduce_scatter(lan, std::span<float>(grad), {.tag = 2});
///   const auto mine = stellatrain::segment_of(grad.size(), lan.size(), lan.rank());
/// \endcode
template <transport Transport, class V>
requires(std::is_arithmetic_v<V> &&
         !std::is_same_v<V, bool>) void dense_reduce_scatter(Transport& t, std::span<V> data,
                                                             const allreduce_options& opt,
                                                             collective_workspace<Transport>& ws) {
  if (opt.average && !std::is_floating_point_v<V>) {
    throw_error(errc::invalid_argument,
                "dense_reduce_scatter: average needs a floating-point element type");
  }
  if (opt.algorithm == allreduce_algorithm::native) {
    throw_error(errc::unsupported, "dense_reduce_scatter: no native reduce-scatter");
  }
  if (t.size() == 1) return;
  const auto ctx = detail::make_context(t, "dense_reduce_scatter", "ring", opt.tag, opt.timeout);
  detail::run_collective(t, ws, opt.abort_on_failure, [&] {
    const auto L = detail::make_ring_layout<V>(t, data.size(), opt.chunk_bytes, -1);
    (void)detail::reduce_scatter_phase(t, data, L, opt.tag, ws, ctx);
    detail::await_sends(ws, ctx);
    if (opt.average) {
      const auto mine = segment_of(data.size(), t.size(), t.rank());
      detail::scale_by_ranks(
          data.subspan(static_cast<std::size_t>(mine.begin), static_cast<std::size_t>(mine.size())),
          t.size());
    }
  });
}

/// As above with a temporary workspace (allocates per call).
template <transport Transport, class V>
requires(std::is_arithmetic_v<V> &&
         !std::is_same_v<V, bool>) void dense_reduce_scatter(Transport& t, std::span<V> data,
                                                             const allreduce_options& opt = {}) {
  collective_workspace<Transport> ws;
  dense_reduce_scatter(t, data, opt, ws);
}

}  // namespace stellatrain
