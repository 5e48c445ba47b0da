// SPDX-License-Identifier: Apache-2.0
// Barrier over any `transport`: a dissemination barrier of empty messages.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

namespace stellatrain {

/// Returns on every rank only after every rank has entered it.
///
/// Dissemination algorithm: ceil(log2 P) rounds; in round k each rank sends an empty message
/// to rank + 2^k and waits for one from rank - 2^k. Failure: as `sparse_allgather`.
///
/// \code
///   stellatrain::barrier(t, {.tag = 9, .timeout = std::chrono::seconds(10)});
/// \endcode
template <transport Transport>
void barrier(Transport& t, const barrier_options& opt, collective_workspace<Transport>& ws) {
  if constexpr (requires {
                  { t.native_barrier(opt) } -> std::same_as<bool>;
                }) {
    if (t.native_barrier(opt)) return;
  }
  const int p = t.size();
  if (p == 1) return;
  const int r = t.rank();
  const auto ctx = detail::make_context(t, "barrier", "dissemination", opt.tag, opt.timeout);
  detail::run_collective(t, ws, opt.abort_on_failure, [&] {
    for (int step = 1; step < p; step *= 2) {
      const int to = detail::ring_index(r + step, p);
      const int from = detail::ring_index(r - step, p);
      ws.sends.push_back(t.isend(to, opt.tag, std::span<const std::byte>{}));
      auto got = t.irecv(from, opt.tag, std::span<std::byte>{});
      detail::await(got, ctx, [&] {
        return "round " + std::to_string(step) + " from rank " + std::to_string(from);
      });
    }
    detail::await_sends(ws, ctx);
  });
}

/// As above with a temporary workspace.
template <transport Transport>
void barrier(Transport& t, const barrier_options& opt = {}) {
  collective_workspace<Transport> ws;
  barrier(t, opt, ws);
}

}  // namespace stellatrain
