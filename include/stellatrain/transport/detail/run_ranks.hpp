// SPDX-License-Identifier: Apache-2.0
// Runs the ranks of in-process worlds on threads and collects their errors: the thread and
// error handling that `run_in_process` and `run_in_process_clusters` share.
#pragma once

#include <stellatrain/config.hpp>

#include <cstddef>
#include <exception>
#include <mutex>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

namespace stellatrain::detail {

/// Runs rank r of [0, ranks) as `std::apply(fn, worlds.open(r))`: ranks 1.. on threads of
/// their own, rank 0 on the calling thread; joins them all, then rethrows the cause of a
/// failure. `Worlds` holds the worlds of a run and provides:
/// - `open(r)`: rank r's transports, as a tuple (they close when `fn` returns);
/// - `abort(r, reason) noexcept`: fails every world of rank r, as rank r;
/// - `abort_all(reason) noexcept`: fails every world (a thread could not start);
/// - `first_abort() noexcept`: the rank whose abort failed its worlds first, or -1.
///
/// A rank whose `fn` throws records its exception and aborts its worlds at once, while its
/// transports are still open, so that the other ranks fail with that reason instead of
/// waiting for a timeout (an exception that is not a `std::exception` aborts them after the
/// transports closed, with "unknown exception"). The exception rethrown is that of the rank
/// that aborted first (collectives abort before their exception reaches here), else the first
/// one recorded. When a thread cannot start, every world is aborted, the threads started are
/// joined and the error of the start is rethrown.
template <class Worlds, class Fn>
void run_ranks(int ranks, Worlds& worlds, Fn& fn) {
  std::mutex error_mutex;
  std::exception_ptr first;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  auto record = [&](int r) {
    std::lock_guard lock(error_mutex);
    errors[static_cast<std::size_t>(r)] = std::current_exception();
    if (!first) first = errors[static_cast<std::size_t>(r)];
  };
  auto body = [&](int r) {
    try {
      auto links = worlds.open(r);
      try {
        std::apply(fn, links);
      } catch (const std::exception& e) {
        record(r);
        worlds.abort(r, e.what());
      }
    } catch (...) {
      record(r);
      worlds.abort(r, "unknown exception");
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  try {
    for (int r = 1; r < ranks; ++r) threads.emplace_back(body, r);
  } catch (...) {
    worlds.abort_all("could not start a thread");
    for (auto& th : threads) th.join();
    throw;
  }
  body(0);
  for (auto& th : threads) th.join();
  const int cause = worlds.first_abort();
  if (cause >= 0 && errors[static_cast<std::size_t>(cause)])
    std::rethrow_exception(errors[static_cast<std::size_t>(cause)]);
  if (first) std::rethrow_exception(first);
}

}  // namespace stellatrain::detail
