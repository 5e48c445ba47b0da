// SPDX-License-Identifier: Apache-2.0
// The one-way latency of a transport's links, measured with round trips of tiny messages and
// agreed across the ranks: what an exchange costs beyond its bytes, for the density controller.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <limits>
#include <span>
#include <string>

namespace stellatrain {

/// Options of `measure_latency`. Every rank must pass the same values (except `timeout`).
struct latency_probe_options {
  /// Round trips timed per peer; the least is the measurement (the first ones also pay for
  /// connections that a transport opens lazily).
  int round_trips = 5;
  tag_type tag = 0;                           ///< tag of every message of the call
  std::chrono::milliseconds timeout{60'000};  ///< bound on the whole call
  bool abort_on_failure = true;  ///< on failure, abort the transport (every rank fails now)
};

/// The one-way latency, in seconds, of the slowest link between rank 0 and the other ranks:
/// half the least of `round_trips` round trips of an 8-byte message, the largest over the
/// peers; the same value on every rank (rank 0 measures and sends it), so that decisions based
/// on it agree on every rank (the density controller's must). 0 with one rank.
///
/// A round trip is timed on one rank's clock, so the ranks' clocks and the moments they enter
/// do not matter; the messages' bytes take no noticeable time (16 bytes with framing: 1.3 us at
/// 100 Mbit/s), so what remains is the propagation delay plus the transport's cost per
/// message, which every exchange pays too. Rank 0 probes its peers one after the other:
/// (size() - 1) x round_trips round trips in all. In a cluster topology every rank's links
/// to the other clusters are assumed alike, so rank 0's slowest peer gives the WAN's latency.
///
/// Give the result to `density_controller_options::latency_seconds` when the network's delay
/// is not known: fitted from the steps' wall times instead, a latency that dwarfs the
/// transfer (a 10 ms delay, a 1 ms transfer) cannot be told from it.
///
/// Failure: throws `errc::invalid_argument` for `round_trips` < 1; otherwise as `barrier`
/// (`errc::timeout` when `timeout` passes, or the backend's error), and
/// `errc::malformed_message` where rank 0's value is no latency (negative, NaN, above an hour).
///
/// \code
///   const double latency = stellatrain::measure_latency(t, {.tag = 11});
///   stellatrain::adaptive_density_controller controller({.latency_seconds = latency});
/// \endcode
template <transport Transport>
[[nodiscard]] double measure_latency(Transport& t, const latency_probe_options& opt = {}) {
  if (opt.round_trips < 1) {
    throw_error(errc::invalid_argument, "measure_latency: round_trips is " +
                                            std::to_string(opt.round_trips) + ", at least 1");
  }
  const int p = t.size();
  if (p == 1) return 0.0;
  using clock = std::chrono::steady_clock;
  collective_workspace<Transport> ws;
  const auto ctx = detail::make_context(t, "measure_latency", "round trips", opt.tag, opt.timeout);
  // Sends read `probe` and `answer` until they complete; replies land in `reply`.
  const std::array<std::byte, 8> probe{};
  std::array<std::byte, 8> reply{};
  std::array<std::byte, 8> answer{};
  double result = 0;
  detail::run_collective(t, ws, opt.abort_on_failure, [&] {
    if (t.rank() == 0) {
      double slowest = 0;
      for (int peer = 1; peer < p; ++peer) {
        double least = std::numeric_limits<double>::max();
        for (int i = 0; i < opt.round_trips; ++i) {
          const auto t0 = clock::now();
          ws.sends.push_back(t.isend(peer, opt.tag, std::span<const std::byte>(probe)));
          auto back = t.irecv(peer, opt.tag, std::span<std::byte>(reply));
          detail::await(back, ctx, [&] { return "the reply of rank " + std::to_string(peer); });
          least = std::min(least, std::chrono::duration<double>(clock::now() - t0).count());
        }
        slowest = std::max(slowest, least / 2);
      }
      result = slowest;
      answer = std::bit_cast<std::array<std::byte, 8>>(result);
      for (int peer = 1; peer < p; ++peer) {
        ws.sends.push_back(t.isend(peer, opt.tag, std::span<const std::byte>(answer)));
      }
    } else {
      for (int i = 0; i < opt.round_trips; ++i) {
        auto got = t.irecv(0, opt.tag, std::span<std::byte>(reply));
        detail::await(got, ctx, [] { return std::string("rank 0's probe"); });
        ws.sends.push_back(t.isend(0, opt.tag, std::span<const std::byte>(probe)));
      }
      auto got = t.irecv(0, opt.tag, std::span<std::byte>(answer));
      detail::await(got, ctx, [] { return std::string("rank 0's measurement"); });
      result = std::bit_cast<double>(answer);
      if (!(result >= 0) || result > 3600) {
        throw_error(errc::malformed_message,
                    ctx.where() + ": rank 0 sent a latency of " + std::to_string(result) + " s");
      }
    }
    detail::await_sends(ws, ctx);
  });
  return result;
}

}  // namespace stellatrain
