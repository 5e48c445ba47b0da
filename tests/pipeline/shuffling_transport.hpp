// SPDX-License-Identifier: Apache-2.0
// Test decorator: delays every send by a random time (0 to max_delay) before it reaches the
// inner transport, so that messages from different sources and tags arrive in shuffled order.
// Messages from one source with one tag keep their order (the transport concept's rule).
#pragma once

#include <stellatrain/transport/concept.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <random>
#include <span>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace stellatrain::test {

template <transport Inner>
class shuffling_transport {
  using inner_request = typename Inner::request_type;

  struct send_state {
    std::mutex m;
    std::optional<inner_request> inner;  // set once released to the inner transport
    std::exception_ptr error;
  };

  struct pending {
    transport_clock::time_point at;
    std::uint64_t order;
    int dest;
    tag_type tag;
    std::span<const std::byte> bytes;
    std::shared_ptr<send_state> state;
    bool operator>(const pending& o) const { return at != o.at ? at > o.at : order > o.order; }
  };

 public:
  class request_type {
   public:
    request_type() = default;
    explicit request_type(inner_request r) : direct_(std::move(r)) {}
    explicit request_type(std::shared_ptr<send_state> s) : state_(std::move(s)) {}
    bool test() {
      if (!state_) return direct_.test();
      std::lock_guard lock(state_->m);
      if (state_->error) std::rethrow_exception(state_->error);
      return state_->inner && state_->inner->test();
    }
    bool wait_until(transport_clock::time_point deadline) {
      if (!state_) return direct_.wait_until(deadline);
      for (;;) {
        {
          std::lock_guard lock(state_->m);
          if (state_->error) std::rethrow_exception(state_->error);
          if (state_->inner) break;
        }
        if (transport_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      return state_->inner->wait_until(deadline);
    }

   private:
    inner_request direct_;
    std::shared_ptr<send_state> state_;
  };

  // `chunk_bytes`: what the collectives (and the hierarchical exchange) cut messages into on
  // this transport (`preferred_chunk_bytes`; 0: whole messages).
  shuffling_transport(Inner inner, std::uint64_t seed, std::chrono::microseconds max_delay,
                      std::size_t chunk_bytes = std::size_t{256} << 10)
      : inner_(std::move(inner)),
        rng_(seed),
        max_delay_(max_delay),
        chunk_bytes_(chunk_bytes),
        releaser_([this](std::stop_token st) { run(st); }) {}

  ~shuffling_transport() {
    releaser_.request_stop();
    cv_.notify_all();
    releaser_.join();
  }

  [[nodiscard]] int rank() const noexcept { return inner_.rank(); }
  [[nodiscard]] int size() const noexcept { return inner_.size(); }
  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept { return chunk_bytes_; }

  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    auto state = std::make_shared<send_state>();
    {
      std::lock_guard lock(m_);
      auto at = transport_clock::now() +
                std::chrono::microseconds(
                    std::uniform_int_distribution<std::int64_t>(0, max_delay_.count())(rng_));
      auto& last = last_[{dest, tag}];
      if (at < last) at = last;  // keep the order of one (destination, tag) stream
      last = at;
      queue_.push(pending{at, order_++, dest, tag, bytes, state});
    }
    cv_.notify_all();
    return request_type(std::move(state));
  }

  request_type irecv(int source, tag_type tag, std::span<std::byte> bytes) {
    return request_type(inner_.irecv(source, tag, bytes));
  }

  template <class Buffer>
  requires requires(Inner& i, int s, tag_type t, Buffer& b) {
    i.irecv(s, t, b);
  } &&(!std::is_convertible_v<Buffer&, std::span<std::byte>>)request_type
      irecv(int source, tag_type tag, Buffer& buffer) {
    return request_type(inner_.irecv(source, tag, buffer));
  }

  void abort(std::string_view reason) noexcept { detail::abort_transport(inner_, reason); }

 private:
  void run(std::stop_token st) {
    std::unique_lock lock(m_);
    while (!st.stop_requested()) {
      if (queue_.empty()) {
        cv_.wait(lock, st, [&] { return !queue_.empty(); });
        continue;
      }
      const auto at = queue_.top().at;
      if (transport_clock::now() < at) {
        cv_.wait_until(lock, st, at, [&] { return !queue_.empty() && queue_.top().at < at; });
        continue;
      }
      pending p = queue_.top();
      queue_.pop();
      lock.unlock();
      try {
        auto r = inner_.isend(p.dest, p.tag, p.bytes);
        std::lock_guard sl(p.state->m);
        p.state->inner.emplace(std::move(r));
      } catch (...) {
        std::lock_guard sl(p.state->m);
        p.state->error = std::current_exception();
      }
      lock.lock();
    }
  }

  Inner inner_;
  std::mutex m_;
  std::condition_variable_any cv_;
  std::priority_queue<pending, std::vector<pending>, std::greater<>> queue_;
  std::map<std::pair<int, tag_type>, transport_clock::time_point> last_;
  std::uint64_t order_ = 0;
  std::mt19937_64 rng_;
  std::chrono::microseconds max_delay_;
  std::size_t chunk_bytes_;
  std::jthread releaser_;
};

}  // namespace stellatrain::test
