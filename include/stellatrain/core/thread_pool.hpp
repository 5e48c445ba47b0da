// SPDX-License-Identifier: Apache-2.0
// A small fixed-size thread pool (std::jthread) that models `executor` and also runs
// independent tasks with a future for their result.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/detail/cpu_relax.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <stop_token>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

namespace detail {

// Polls `ready()` until it holds or `spin` has passed (reading the clock once per 64 polls);
// returns whether it held.
template <class Ready>
bool poll_for(std::chrono::microseconds spin, Ready&& ready) noexcept {
  const auto until = std::chrono::steady_clock::now() + spin;
  do {
    for (int k = 0; k < 64; ++k) {
      if (ready()) return true;
      cpu_relax();
    }
  } while (std::chrono::steady_clock::now() < until);
  return false;
}

// Polls `ready()` for up to `spin`, and on while `awake` is not 0; returns whether it held.
template <class Ready>
bool poll_while_awake(std::chrono::microseconds spin, const std::atomic<std::size_t>& awake,
                      Ready&& ready) noexcept {
  while (!poll_for(spin, ready)) {
    if (awake.load(std::memory_order_relaxed) == 0) return false;
  }
  return true;
}

// Shared between the caller of bulk() and the helper tasks it posts. Helpers that start after
// every index was claimed see `next >= count` and return without touching `fn`, so a late
// helper never calls into the caller's (by then destroyed) callable.
struct bulk_state {
  std::size_t count = 0;
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  void (*invoke)(void*, std::size_t) = nullptr;
  void* fn = nullptr;

  void run() noexcept {
    for (;;) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) return;
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          invoke(fn, i);
        } catch (...) {
          std::lock_guard lock(error_mutex);
          if (!error) error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == count) done.notify_all();
    }
  }

  // Polls for up to `spin`, and on while `awake` is not 0, then sleeps until the last call
  // has returned.
  void wait(std::chrono::microseconds spin, const std::atomic<std::size_t>& awake) noexcept {
    auto finished = [this] { return done.load(std::memory_order_acquire) == count; };
    if ((spin.count() > 0 || awake.load(std::memory_order_relaxed) > 0) &&
        poll_while_awake(spin, awake, finished)) {
      return;
    }
    for (std::size_t d = done.load(std::memory_order_acquire); d != count;
         d = done.load(std::memory_order_acquire)) {
      done.wait(d, std::memory_order_acquire);
    }
  }
};

}  // namespace detail

/// The number of hardware threads, or 1 where it is unknown.
[[nodiscard]] inline std::size_t hardware_threads() noexcept {
  return std::max(1u, std::thread::hardware_concurrency());
}

/// A fixed set of worker threads.
///
/// - As an `executor`: `bulk(n, f)` runs on the calling thread plus up to `threads() - 1`
///   workers, so at most `threads()` calls run at once; it may be called from several threads
///   at once and from inside a task or a bulk call (the caller always makes progress itself).
/// - As a task queue: `submit(f)` runs `f()` on a worker, first in first out, and returns a
///   `std::future` of its result (an exception thrown by `f` is stored in the future).
///
/// Polling (`spin`, off by default): waking a sleeping thread costs tens of microseconds, as
/// much as a whole small bulk call. With `spin` > 0 a worker that has finished a task polls for
/// the next one for that long before it sleeps, and `bulk` polls as long for its helpers, so
/// calls that follow each other closely (a kernel's phases, one tensor after another) find the
/// workers awake; a worker polls only after a task, never while the pool is idle. At most
/// `threads() - 1` workers poll at once (a bulk call takes no more helpers: its caller is the
/// last of `threads()`); the others sleep. Use it when the pool's threads have cores to
/// themselves (on 2 cores, 50 us made 2-thread packing of 250K pairs 1.85x faster); where more
/// threads than cores have work, a polling thread takes time from one of them.
///
/// Staying awake for a while (`stay_awake`): a kernel that makes several bulk calls in a row,
/// with short serial steps between them, holds a `stay_awake()` guard for its duration. While
/// any guard lives, workers that finish a task poll for the next one (up to `threads() - 1` of
/// them, as above) and `bulk` polls for its helpers, however short `spin` is, so only the
/// kernel's first bulk call pays for waking the workers. On a pool with more workers than the
/// machine has hardware threads the guard does nothing (polling workers would take time from
/// the working ones).
///
/// The destructor stops the workers after their current task; tasks still queued are dropped
/// (their futures report `std::future_errc::broken_promise`). Destroy the pool only when no
/// `bulk` call on it is in progress.
///
/// \code
///   stellatrain::thread_pool pool{2};
///   std::vector<float> x(1 << 20, 1.0f);
///   stellatrain::for_each_chunk(pool, x.size(), 1 << 16, [&](std::uint64_t b, std::uint64_t e) {
///     for (auto i = b; i < e; ++i) x[i] *= 2.0f;
///   });
///   auto answer = pool.submit([] { return 42; }).get();
/// \endcode
class thread_pool {
 public:
  /// How long an awake thread polls for work before it sleeps, unless the pool says otherwise.
  static constexpr std::chrono::microseconds default_spin{0};

  /// Starts `threads` workers (0 is taken as 1) that poll for `spin` after each task.
  explicit thread_pool(std::size_t threads = hardware_threads(),
                       std::chrono::microseconds spin = default_spin)
      : spin_(std::max(spin, std::chrono::microseconds{0})),
        may_stay_awake_(std::max<std::size_t>(threads, 1) <= hardware_threads()),
        max_pollers_(std::max<std::size_t>(threads, 2) - 1) {
    threads = std::max<std::size_t>(threads, 1);
    workers_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i) {
      workers_.emplace_back([this](std::stop_token stop) { work(stop); });
    }
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    for (auto& w : workers_) w.request_stop();
    ready_.notify_all();
    workers_.clear();  // joins
  }

  /// Number of worker threads.
  [[nodiscard]] std::size_t threads() const noexcept { return workers_.size(); }

  /// At most this many calls of one `bulk` run at once: `threads()`.
  [[nodiscard]] std::size_t concurrency() const noexcept { return workers_.size(); }

  /// How long a thread polls for work before it sleeps (see the class comment).
  [[nodiscard]] std::chrono::microseconds spin() const noexcept { return spin_; }

  /// While a guard of `stay_awake` lives, the pool's threads poll for work instead of sleeping.
  class awake_guard {
   public:
    awake_guard() = default;
    awake_guard(awake_guard&& other) noexcept : pool_(std::exchange(other.pool_, nullptr)) {}
    awake_guard& operator=(awake_guard&& other) noexcept {
      if (this != &other) {
        release();
        pool_ = std::exchange(other.pool_, nullptr);
      }
      return *this;
    }
    awake_guard(const awake_guard&) = delete;
    awake_guard& operator=(const awake_guard&) = delete;
    ~awake_guard() { release(); }

    /// Whether this guard keeps a pool awake (false on an oversubscribed pool).
    [[nodiscard]] bool active() const noexcept { return pool_ != nullptr; }

   private:
    friend class thread_pool;
    explicit awake_guard(thread_pool* pool) noexcept : pool_(pool) {
      if (pool_ != nullptr) pool_->awake_.fetch_add(1, std::memory_order_relaxed);
    }
    void release() noexcept {
      if (pool_ != nullptr) pool_->awake_.fetch_sub(1, std::memory_order_relaxed);
      pool_ = nullptr;
    }
    thread_pool* pool_ = nullptr;
  };

  /// Keeps the workers polling for work until the guard is destroyed (see the class comment);
  /// guards may overlap, from any threads. Destroy every guard before the pool.
  [[nodiscard]] awake_guard stay_awake() noexcept {
    return awake_guard(may_stay_awake_ ? this : nullptr);
  }

  /// Number of guards of `stay_awake` that keep the pool awake now.
  [[nodiscard]] std::size_t awake_guards() const noexcept {
    return awake_.load(std::memory_order_relaxed);
  }

  /// Number of workers polling for work now: at most `threads() - 1` (1 in a pool of one).
  [[nodiscard]] std::size_t polling_workers() const noexcept {
    return pollers_.load(std::memory_order_relaxed);
  }

  /// Calls `f(i)` for every `i` in `[0, n)` and returns when all calls returned; rethrows the
  /// first exception (calls not yet started when it was thrown are skipped).
  template <class F>
  void bulk(std::size_t n, F&& f) {
    using fn_type = std::remove_reference_t<F>;
    // Only this call is made per callable type; the rest is one function for all of them.
    run_bulk(n, const_cast<void*>(static_cast<const void*>(std::addressof(f))),
             [](void* p, std::size_t i) { (*static_cast<fn_type*>(p))(i); });
  }

  /// Runs `f()` on a worker; the future holds its result or its exception.
  template <class F>
  [[nodiscard]] auto submit(F&& f) -> std::future<std::invoke_result_t<std::decay_t<F>>> {
    using result = std::invoke_result_t<std::decay_t<F>>;
    auto task = std::make_shared<std::packaged_task<result()>>(std::forward<F>(f));
    auto future = task->get_future();
    {
      std::lock_guard lock(mutex_);
      queue_.emplace_back([task] { (*task)(); });
      queued_.store(queue_.size(), std::memory_order_release);
    }
    wake(1);
    return future;
  }

 private:
  void run_bulk(std::size_t n, void* fn, void (*invoke)(void*, std::size_t)) {
    if (n == 0) return;
    auto state = std::make_shared<detail::bulk_state>();
    state->count = n;
    state->fn = fn;
    state->invoke = invoke;
    const std::size_t helpers = std::min(n, concurrency()) - 1;
    if (helpers > 0) {
      {
        std::lock_guard lock(mutex_);
        for (std::size_t h = 0; h < helpers; ++h) {
          queue_.emplace_back([state] { state->run(); });
        }
        queued_.store(queue_.size(), std::memory_order_release);
      }
      wake(helpers);
    }
    state->run();
    state->wait(spin_, awake_);
    if (state->error) std::rethrow_exception(state->error);
  }

  // Wakes sleeping workers for `tasks` new tasks (queued under the mutex before this call),
  // less the polling workers it claims: a claim takes one off `polling_`, and every polling
  // worker, claimed or not, locks the mutex when it stops polling and takes a queued task if
  // there is one. So each task either wakes a sleeper or has a polling worker on its way to
  // it, and no task waits in the queue for a worker that is busy elsewhere.
  void wake(std::size_t tasks) {
    std::size_t polling = polling_.load();
    std::size_t claimed = 0;
    do {
      claimed = std::min(polling, tasks);
    } while (claimed > 0 && !polling_.compare_exchange_weak(polling, polling - claimed));
    if (tasks - claimed == 1) {
      ready_.notify_one();
    } else if (tasks - claimed > 1) {
      ready_.notify_all();
    }
  }

  void work(std::stop_token stop) {
    bool after_task = false;
    for (;;) {
      if (after_task && (spin_.count() > 0 || awake_.load(std::memory_order_relaxed) > 0))
        poll(stop);
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        if (!ready_.wait(lock, stop, [this] { return !queue_.empty(); })) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        queued_.store(queue_.size(), std::memory_order_release);
      }
      task();  // bulk helpers and packaged tasks do not throw
      after_task = true;
    }
  }

  // Polls `queued_` for up to spin_, and on while a guard of `stay_awake` lives; returns when a
  // task may be queued or the time is up, after taking itself off `polling_` unless a `wake`
  // has claimed it (then the count is already off).
  void poll(const std::stop_token& stop) {
    std::size_t pollers = pollers_.load(std::memory_order_relaxed);
    do {
      if (pollers >= max_pollers_) return;
    } while (!pollers_.compare_exchange_weak(pollers, pollers + 1, std::memory_order_relaxed));
    polling_.fetch_add(1);
    const auto ready = [&] {
      return queued_.load(std::memory_order_acquire) != 0 || stop.stop_requested();
    };
    detail::poll_while_awake(spin_, awake_, ready);
    std::size_t polling = polling_.load();
    while (polling > 0 && !polling_.compare_exchange_weak(polling, polling - 1)) {
    }
    pollers_.fetch_sub(1, std::memory_order_relaxed);
  }

  std::chrono::microseconds spin_;
  bool may_stay_awake_;  // the workers fit the hardware threads
  // The bound on polling workers (see the class comment): threads() - 1, or 1 in a pool of one
  // (for `submit`). Kept apart from workers_.size(), which changes while workers run.
  std::size_t max_pollers_;
  std::mutex mutex_;
  std::condition_variable_any ready_;
  std::deque<std::function<void()>> queue_;
  std::atomic<std::size_t> queued_{0};   // queue_.size(), readable without the mutex
  std::atomic<std::size_t> polling_{0};  // workers polling `queued_`; every access seq_cst
  std::atomic<std::size_t> awake_{0};    // live guards of stay_awake
  std::atomic<std::size_t> pollers_{0};  // workers inside poll(), at most max_pollers_
  std::vector<std::jthread> workers_;    // last: joined before the queue is destroyed
};

static_assert(task_executor<thread_pool>);

}  // namespace stellatrain
