// SPDX-License-Identifier: Apache-2.0
// Faults injected into a real backend by the multi-process tests: a rank that dies (SIGKILL)
// at a chosen send of a chosen collective, so that it dies in the middle of that exchange
// with part of its messages out.
#pragma once

#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <memory>
#include <span>
#include <string_view>
#include <utility>

namespace stellatrain::test {

/// Forwards to `Inner` (not owned); once armed with `die_at_send(tag, n)`, the n-th send on
/// `tag` (on any tag with `any_tag`) from then on kills the process (SIGKILL, no cleanup, no
/// goodbye) before it is started. Copies share the trigger.
template <transport Inner>
class dies_on_send {
 public:
  using request_type = typename Inner::request_type;
  static constexpr tag_type any_tag = ~tag_type{0};

  explicit dies_on_send(Inner& inner) : inner_(&inner), trigger_(std::make_shared<trigger>()) {}

  void die_at_send(tag_type tag, int n) {
    trigger_->tag.store(tag);
    trigger_->left.store(n);
  }

  [[nodiscard]] int rank() const noexcept { return inner_->rank(); }
  [[nodiscard]] int size() const noexcept { return inner_->size(); }

  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    trigger& k = *trigger_;
    const tag_type armed = k.tag.load();
    if ((armed == any_tag || tag == armed) && k.left.load() > 0 && k.left.fetch_sub(1) == 1) {
      std::printf("rank %d: killing itself at a send to rank %d on tag %u\n", rank(), dest,
                  static_cast<unsigned>(tag));
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    return inner_->isend(dest, tag, bytes);
  }
  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    return inner_->irecv(source, tag, into);
  }
  request_type irecv(int source, tag_type tag,
                     message_buffer& into) requires message_transport<Inner> {
    return inner_->irecv(source, tag, into);
  }
  void abort(std::string_view reason) noexcept { detail::abort_transport(*inner_, reason); }

 private:
  struct trigger {
    std::atomic<tag_type> tag{0};
    std::atomic<int> left{0};
  };
  Inner* inner_;
  std::shared_ptr<trigger> trigger_;
};

}  // namespace stellatrain::test
