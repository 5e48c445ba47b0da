// SPDX-License-Identifier: Apache-2.0
// A decorator that makes any transport behave like a slow link: every send waits for a
// token bucket (bandwidth) and then a fixed delay (latency) before it reaches the inner
// transport. Lets the in-process backend emulate a 100 Mbit/s WAN inside one process, and,
// with `cluster_links`, clusters whose ranks share one uplink each.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace stellatrain {

/// Which sends share one token bucket.
enum class shaping_scope {
  per_rank,  ///< one bucket for everything this rank sends: an access link (as wan-emu shapes)
  per_peer,  ///< one bucket per destination: a full mesh of independent links
};

class cluster_links;

/// Options of `shaped_transport`.
struct shaping_options {
  double bits_per_second = 100e6;        ///< link rate in payload bits/s; 0 = unlimited
  std::chrono::microseconds latency{0};  ///< one-way delay added to every message
  std::size_t burst_bytes = 16 * 1024;   ///< token bucket depth (bytes sent at once from idle)
  shaping_scope scope = shaping_scope::per_rank;
  /// The clusters' shared uplinks (see `cluster_links`), or none. With them, a message to
  /// another cluster is shaped by this rank's own rate first (its access link, 0: none) and
  /// then by the uplinks; `latency` then applies inside the cluster only.
  std::shared_ptr<cluster_links> clusters = nullptr;
};

namespace detail {

// A token bucket with debt: `level` bytes of credit at time `at`, refilled at `rate` up to
// `burst`; a send takes its size and may drive the level negative, and leaves the link when
// the debt is paid. Departure times of successive sends therefore never decrease, and over
// a long transfer the rate is exactly `rate` (plus at most `burst` bytes once).
struct token_bucket {
  double level = 0;
  transport_clock::time_point at{};
  transport_clock::time_point last_delivery{};
  bool started = false;

  transport_clock::time_point take(std::size_t bytes, double bytes_per_s, double burst,
                                   transport_clock::time_point now) {
    if (!started) {
      level = burst;
      at = now;
      started = true;
    }
    if (now > at) {
      level =
          std::min(burst, level + bytes_per_s * std::chrono::duration<double>(now - at).count());
      at = now;
    }
    level -= static_cast<double>(bytes);
    if (level >= 0) return now;
    return now + std::chrono::duration_cast<transport_clock::duration>(
                     std::chrono::duration<double>(-level / bytes_per_s));
  }
};

}  // namespace detail

/// The WAN of several clusters, shared by the shaped transports of all their ranks: every
/// cluster has one uplink (a rate, each direction, and a one-way delay to the WAN router),
/// and a message from a rank of cluster a to one of cluster b leaves through a's uplink and
/// enters through b's downlink (each a token bucket shared by all ranks of the cluster), then
/// waits (delay_a + delay_b) / 2, as `wan-emu -c` builds it. Messages inside a cluster are
/// not shaped by it (shape the LAN with the transport's own rate). Thread-safe; rates can
/// change while it runs. Pass it to every rank's `shaped_transport` (`shaping_options::
/// clusters`), whose ranks must be the topology's global ranks.
class cluster_links {
 public:
  /// Every uplink at `bits_per_second` (0 = unlimited) and `one_way_delay`.
  cluster_links(cluster_topology topology, double bits_per_second,
                std::chrono::microseconds one_way_delay, std::size_t burst_bytes = 16 * 1024)
      : topology_(std::move(topology)), burst_(static_cast<double>(burst_bytes)) {
    check(bits_per_second);
    links_.resize(static_cast<std::size_t>(topology_.clusters()));
    for (auto& l : links_) {
      l.bits_per_second = bits_per_second;
      l.delay = one_way_delay;
    }
  }

  [[nodiscard]] const cluster_topology& topology() const noexcept { return topology_; }

  /// Changes every uplink's rate (bits/s, 0 = unlimited) for sends from now on.
  void set_rate(double bits_per_second) {
    check(bits_per_second);
    std::lock_guard lock(mutex_);
    for (auto& l : links_) l.bits_per_second = bits_per_second;
  }
  /// Changes cluster `c`'s uplink rate.
  void set_rate(int c, double bits_per_second) {
    check(bits_per_second);
    std::lock_guard lock(mutex_);
    links_[static_cast<std::size_t>(cluster_index(c))].bits_per_second = bits_per_second;
  }
  /// Changes cluster `c`'s one-way delay to the WAN router.
  void set_delay(int c, std::chrono::microseconds one_way_delay) {
    std::lock_guard lock(mutex_);
    links_[static_cast<std::size_t>(cluster_index(c))].delay = one_way_delay;
  }
  [[nodiscard]] double rate(int c) const {
    std::lock_guard lock(mutex_);
    return links_[static_cast<std::size_t>(cluster_index(c))].bits_per_second;
  }

  /// Bytes that crossed cluster `c`'s uplink out of the cluster so far.
  [[nodiscard]] std::uint64_t bytes_out(int c) const {
    std::lock_guard lock(mutex_);
    return links_[static_cast<std::size_t>(cluster_index(c))].bytes_out;
  }

  /// When a message of `bytes` sent now from global rank `from` to `to` arrives at `to`'s
  /// cluster (nullopt: the two share a cluster).
  [[nodiscard]] std::optional<transport_clock::time_point> arrival(
      int from, int to, std::size_t bytes, transport_clock::time_point now) {
    const int a = topology_.cluster_of(from);
    const int b = topology_.cluster_of(to);
    if (a == b) return std::nullopt;
    std::lock_guard lock(mutex_);
    link& up = links_[static_cast<std::size_t>(a)];
    link& down = links_[static_cast<std::size_t>(b)];
    up.bytes_out += bytes;
    auto t = now;
    if (up.bits_per_second > 0) t = up.out.take(bytes, up.bits_per_second / 8.0, burst_, t);
    if (down.bits_per_second > 0)
      t = std::max(t, down.in.take(bytes, down.bits_per_second / 8.0, burst_, t));
    return t + std::chrono::duration_cast<transport_clock::duration>((up.delay + down.delay) / 2);
  }

 private:
  struct link {
    double bits_per_second = 0;
    std::chrono::microseconds delay{0};
    detail::token_bucket out;  // leaving the cluster
    detail::token_bucket in;   // entering it
    std::uint64_t bytes_out = 0;
  };
  static void check(double bits_per_second) {
    if (!(bits_per_second >= 0)) {
      throw_error(errc::invalid_argument,
                  "cluster_links: rate " + std::to_string(bits_per_second) + " bits/s");
    }
  }
  int cluster_index(int c) const {
    (void)topology_.size_of(c);  // throws errc::out_of_range for no such cluster
    return c;
  }

  cluster_topology topology_;
  double burst_;
  mutable std::mutex mutex_;
  std::vector<link> links_;
};

namespace detail {

template <class Request>
struct shaped_send {
  int dest = 0;
  tag_type tag = 0;
  std::span<const std::byte> bytes;
  bool released = false;   // handed to the inner transport (guarded by the state's mutex)
  bool cancelled = false;  // the request was dropped before release
  std::optional<Request> inner;
  std::exception_ptr error;  // the inner isend threw
};

template <class Inner>
struct shaping_state {
  using inner_request = typename Inner::request_type;
  using op_ptr = std::shared_ptr<shaped_send<inner_request>>;

  struct entry {
    transport_clock::time_point due;
    std::uint64_t seq;
    op_ptr op;
    bool operator>(const entry& o) const { return due != o.due ? due > o.due : seq > o.seq; }
  };

  shaping_state(Inner&& t, shaping_options o) : inner(std::move(t)), options(o) {
    buckets.resize(options.scope == shaping_scope::per_peer
                       ? static_cast<std::size_t>(std::max(1, inner.size()))
                       : 1);
    worker = std::thread([this] { run(); });
  }

  ~shaping_state() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    worker.join();
  }

  void run() {
    std::unique_lock lock(mutex);
    for (;;) {
      if (stopping) return;
      if (queue.empty()) {
        cv.wait(lock);
        continue;
      }
      const auto due = queue.top().due;
      if (transport_clock::now() < due) {
        cv.wait_until(lock, due);
        continue;
      }
      op_ptr op = queue.top().op;
      queue.pop();
      if (op->cancelled) continue;
      // Hand over without the lock: the inner transport may copy the bytes right away.
      lock.unlock();
      std::optional<inner_request> r;
      std::exception_ptr failure;
      try {
        r.emplace(inner.isend(op->dest, op->tag, op->bytes));
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (r) op->inner.emplace(std::move(*r));
      op->error = failure;
      op->released = true;
      released_cv.notify_all();
    }
  }

  Inner inner;
  shaping_options options;
  std::mutex mutex;
  std::condition_variable cv;           // wakes the worker
  std::condition_variable released_cv;  // wakes requests waiting for their release
  std::priority_queue<entry, std::vector<entry>, std::greater<>> queue;
  std::vector<token_bucket> buckets;
  std::uint64_t seq = 0;
  bool stopping = false;
  std::thread worker;
};

// The operation of a shaped_request: a send waiting for its release (`op`), then the inner
// request (`direct`, also the whole of a receive). Empty when it has neither.
template <class Inner>
struct shaped_handle {
  using inner_request = typename Inner::request_type;
  using op_ptr = typename shaping_state<Inner>::op_ptr;

  shaping_state<Inner>* state = nullptr;
  op_ptr op;
  std::optional<inner_request> direct;

  bool empty() const noexcept { return !op && !direct; }

  bool test() {
    if (op) {
      std::unique_lock lock(state->mutex);
      if (!op->released) return false;
      adopt(lock);
    }
    return direct ? direct->test() : true;
  }

  bool wait_until(transport_clock::time_point deadline) {
    if (op) {
      std::unique_lock lock(state->mutex);
      if (!state->released_cv.wait_until(lock, deadline, [&] { return op->released; }))
        return false;
      adopt(lock);
    }
    return direct ? direct->wait_until(deadline) : true;
  }

  // Takes over the inner request once released (under the state's mutex).
  void adopt(std::unique_lock<std::mutex>& lock) {
    op_ptr released = std::move(op);
    if (released->inner) direct.emplace(std::move(*released->inner));
    std::exception_ptr failure = released->error;
    lock.unlock();
    if (failure) {
      op = std::move(released);  // keep failing on later calls
      std::rethrow_exception(failure);
    }
  }

  void cancel() noexcept {
    if (op && state != nullptr) {
      std::lock_guard lock(state->mutex);
      if (!op->released) op->cancelled = true;
    }
    op.reset();
  }
};

}  // namespace detail

template <transport Inner>
class shaped_transport;

/// The completion handle of `shaped_transport`: a send completes once it has been released
/// to the inner transport and the inner send completed; a receive is the inner receive.
/// Dropping a send before its release withdraws it.
template <transport Inner>
class shaped_request : public detail::request_base<detail::shaped_handle<Inner>> {
 public:
  using inner_request = typename Inner::request_type;

  shaped_request() = default;

 private:
  friend class shaped_transport<Inner>;
  using op_ptr = typename detail::shaping_state<Inner>::op_ptr;

  explicit shaped_request(inner_request r)
      : shaped_request::request_base({nullptr, nullptr, std::move(r)}) {}
  shaped_request(detail::shaping_state<Inner>* s, op_ptr op)
      : shaped_request::request_base({s, std::move(op), std::nullopt}) {}
};

/// Wraps a transport (owned) and shapes its sends: each message takes its size from a token
/// bucket of `bits_per_second` (depth `burst_bytes`), then waits `latency` more, and only
/// then is sent on the inner transport. Receives pass through. Messages to this rank itself
/// are not shaped.
///
/// - Accuracy: over transfers above 1 MB the achieved rate is within a few percent of the
///   configured one (tests check 5%); the delay of each message is exact to the scheduling
///   precision of one background thread per shaped transport (its timing uses the ideal
///   departure times, so oversleeping never accumulates). Rates count payload bytes.
/// - `per_rank` scope shares one bucket among all destinations (an access link, as
///   `wan-emu` emulates); `per_peer` gives each destination its own.
/// - `set_rate` / `set_latency` change the link while it runs (for bandwidth schedules).
/// - Native collectives of the inner transport are not used through the decorator (they
///   would bypass the shaping); the generic ones are.
/// - Costs one small heap allocation per send (it is an emulation tool).
///
/// \code
///   stellatrain::run_in_process(4, [](stellatrain::in_process_transport& raw) {
///     stellatrain::shaped_transport t(std::move(raw), {.bits_per_second = 100e6,
///                                                      .latency = std::chrono::milliseconds(10)});
///     std::vector<stellatrain::message_buffer> got(t.size());
///     stellatrain::sparse_allgather(t, my_bytes, got);
///   });
/// \endcode
template <transport Inner>
class shaped_transport {
 public:
  using request_type = shaped_request<Inner>;

  shaped_transport(Inner inner, shaping_options options)
      : state_(std::make_unique<detail::shaping_state<Inner>>(std::move(inner), options)) {
    check(options.bits_per_second);
    if (options.clusters) options.clusters->topology().check_world(size(), "shaped_transport");
  }

  [[nodiscard]] int rank() const noexcept { return state_->inner.rank(); }
  [[nodiscard]] int size() const noexcept { return state_->inner.size(); }

  /// The wrapped transport.
  [[nodiscard]] Inner& inner() noexcept { return state_->inner; }

  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    if (dest == rank()) return request_type(state_->inner.isend(dest, tag, bytes));
    auto op = std::make_shared<detail::shaped_send<typename Inner::request_type>>();
    op->dest = dest;
    op->tag = tag;
    op->bytes = bytes;
    {
      std::lock_guard lock(state_->mutex);
      const shaping_options& o = state_->options;
      const auto now = transport_clock::now();
      auto& bucket = state_->buckets[o.scope == shaping_scope::per_peer
                                         ? static_cast<std::size_t>(dest) % state_->buckets.size()
                                         : 0];
      auto departure = now;
      if (o.bits_per_second > 0) {
        departure = bucket.take(bytes.size(), o.bits_per_second / 8.0,
                                static_cast<double>(o.burst_bytes), now);
      }
      auto due = departure + std::chrono::duration_cast<transport_clock::duration>(o.latency);
      if (o.clusters) {
        if (auto wan = o.clusters->arrival(rank(), dest, bytes.size(), departure)) due = *wan;
      }
      due = std::max(due, bucket.last_delivery);  // a shorter latency never reorders a link
      bucket.last_delivery = due;
      state_->queue.push({due, state_->seq++, op});
    }
    state_->cv.notify_all();
    return request_type(state_.get(), std::move(op));
  }

  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    return request_type(state_->inner.irecv(source, tag, into));
  }

  request_type irecv(int source, tag_type tag,
                     message_buffer& into) requires message_transport<Inner> {
    return request_type(state_->inner.irecv(source, tag, into));
  }

  /// The inner transport's chunk preference (see `auto_chunk_bytes`).
  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept {
    return chunk_bytes_for(state_->inner, auto_chunk_bytes);
  }

  void abort(std::string_view reason) noexcept { detail::abort_transport(state_->inner, reason); }

  /// Changes the link rate (bits/s, 0 = unlimited) for sends from now on.
  void set_rate(double bits_per_second) {
    check(bits_per_second);
    std::lock_guard lock(state_->mutex);
    state_->options.bits_per_second = bits_per_second;
  }

  /// Changes the one-way latency for sends from now on.
  void set_latency(std::chrono::microseconds latency) {
    std::lock_guard lock(state_->mutex);
    state_->options.latency = latency;
  }

  [[nodiscard]] shaping_options options() const {
    std::lock_guard lock(state_->mutex);
    return state_->options;
  }

 private:
  static void check(double bits_per_second) {
    if (!(bits_per_second >= 0)) {
      throw_error(errc::invalid_argument,
                  "shaped_transport: rate " + std::to_string(bits_per_second) + " bits/s");
    }
  }

  std::unique_ptr<detail::shaping_state<Inner>> state_;
};

}  // namespace stellatrain
