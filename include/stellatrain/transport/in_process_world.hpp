// SPDX-License-Identifier: Apache-2.0
// P ranks of the in-process backend in one process: the world that hands each rank's thread
// its transport.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/detail/in_process_mailboxes.hpp>
#include <stellatrain/transport/in_process_transport.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace stellatrain {

/// P ranks in one process. Make it, hand `transport(r)` to the thread of each rank.
///
/// \code
///   stellatrain::in_process_world world(4);
///   std::vector<std::jthread> threads;
///   for (int r = 0; r < 4; ++r)
///     threads.emplace_back([&world, t = world.transport(r)]() mutable { /* use t */ });
/// \endcode
/// Or let `run_in_process` do it. The world's state lives as long as the world or any of its
/// transports.
class in_process_world {
 public:
  /// \pre ranks >= 1
  explicit in_process_world(int ranks) {
    if (ranks < 1) {
      throw_error(errc::invalid_argument,
                  "in_process_world: " + std::to_string(ranks) + " ranks, need at least 1");
    }
    world_ = std::make_shared<detail::inproc_world>(ranks);
  }

  [[nodiscard]] int size() const noexcept { return world_->size; }

  /// The transport of `rank`; each rank's transport can be taken once.
  [[nodiscard]] in_process_transport transport(int rank) {
    if (rank < 0 || rank >= world_->size) {
      throw_error(errc::invalid_argument, "in_process_world::transport: rank " +
                                              std::to_string(rank) + " of " +
                                              std::to_string(world_->size));
    }
    detail::inproc_rank& r = world_->ranks[static_cast<std::size_t>(rank)];
    std::lock_guard lock(r.mutex);
    if (r.attached) {
      throw_error(errc::invalid_argument, "in_process_world::transport: rank " +
                                              std::to_string(rank) + " was already taken");
    }
    r.attached = true;
    return {world_, rank};
  }

  /// Fails every rank, as `in_process_transport::abort` of `rank` does.
  void abort(int rank, std::string_view reason) noexcept { world_->abort(rank, reason); }

  /// True after an abort.
  [[nodiscard]] bool failed() const noexcept {
    return world_->failed.load(std::memory_order_acquire);
  }

  /// The rank whose abort failed the world, or -1.
  [[nodiscard]] int abort_rank() const noexcept {
    std::lock_guard lock(world_->fail_mutex);
    return world_->failed.load(std::memory_order_acquire) ? world_->fail_rank : -1;
  }

 private:
  std::shared_ptr<detail::inproc_world> world_;
};

}  // namespace stellatrain
