// SPDX-License-Identifier: Apache-2.0
// How a pipeline runs its stages: the encode and apply stages of its buckets as tasks on the
// application's executor, the most urgent first; the exchanges on threads of their own, each
// thread its buckets back to front, step after step (the same order on every rank, so that
// ranks never wait on each other's different buckets); and the failure of any of them, which
// is kept, aborts the links and wakes every waiter. When a stage may run is the pipeline's
// rule: the runner asks its owner, with the lock held.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pipeline/detail/step_book.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <queue>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stellatrain::detail {

// `Owner` (the pipeline) provides:
//   owner.encode_stage(b, step), owner.apply_stage(b, step), owner.exchange_stage(b, step)
//   owner.exchange_ready(b, step) -> bool          lock held
//   owner.task_done(b, apply, cpu_seconds)         lock held, after each executor task
//   owner.abort_links(reason) noexcept
// `who` starts the reason every rank's links are aborted with.
template <class Owner, class Executor>
class stage_runner {
 public:
  stage_runner(Owner& owner, Executor& ex, std::string who)
      : owner_(owner), ex_(ex), who_(std::move(who)) {}
  stage_runner(const stage_runner&) = delete;
  stage_runner& operator=(const stage_runner&) = delete;

  [[nodiscard]] std::mutex& mutex() const noexcept { return mutex_; }
  void notify() noexcept { changed_.notify_all(); }

  // ---- with the lock held

  // Runs the encode (apply = false) or the apply stage of bucket b at `step` on the executor.
  void schedule(std::int64_t step, std::size_t bucket, bool apply) {
    ready_.push({step, bucket, apply});
    ++active_tasks_;
    (void)ex_.submit([this] { run_one(); });
  }

  [[nodiscard]] bool failed() const noexcept { return failed_; }
  void rethrow_if_failed() const {
    if (failed_) std::rethrow_exception(failure_);
  }

  // ---- without the lock

  // Waits until `ready()` (evaluated under the lock) holds or some stage failed, for at most
  // `timeout`; returns the seconds it waited. Throws the failure, or `errc::timeout` naming
  // `what`.
  template <class Pred>
  double wait(const std::string& what, std::chrono::milliseconds timeout, Pred&& ready) {
    const auto t0 = transport_clock::now();
    std::unique_lock lock(mutex_);
    const bool ok =
        changed_.wait_until(lock, deadline_after(timeout), [&] { return failed_ || ready(); });
    rethrow_if_failed();
    if (!ok) throw_error(errc::timeout, "pipeline: timed out in " + what);
    return std::chrono::duration<double>(transport_clock::now() - t0).count();
  }

  // Keeps the first failure, aborts the links (so that every rank fails) and wakes everyone.
  void fail(std::exception_ptr e) noexcept {
    {
      std::lock_guard lock(mutex_);
      if (failed_) return;
      failed_ = true;
      failure_ = e;
    }
    std::string reason = who_;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      reason += ": ";
      reason += x.what();
    } catch (...) {
    }
    owner_.abort_links(reason);
    changed_.notify_all();
  }

  // Starts the exchange threads (at most one per bucket): bucket b's exchanges run on thread
  // b mod `threads`, each thread its buckets back to front (the order backward completes
  // them), from `first_step`.
  void start_exchanges(std::size_t buckets, int threads, std::int64_t first_step) {
    buckets_ = buckets;
    threads_ = std::min(threads, static_cast<int>(buckets));
    threads = threads_;
    for (int c = 0; c < threads; ++c) {
      std::vector<std::size_t> mine;
      for (std::size_t b = buckets; b-- > 0;) {
        if (static_cast<int>(b % static_cast<std::size_t>(threads)) == c) mine.push_back(b);
      }
      exchangers_.emplace_back([this, mine = std::move(mine), first_step](std::stop_token) {
        exchange_loop(mine, first_step);
      });
    }
  }

  // Stops and joins the exchange threads.
  void stop_exchanges() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    exchangers_.clear();
    std::lock_guard lock(mutex_);
    stopping_ = false;
  }

  // Stops the exchange threads until the result is destroyed, then starts them from the step
  // `first_step()` gives.
  template <class FirstStep>
  [[nodiscard]] auto pause_exchanges(FirstStep&& first_step) {
    stop_exchanges();
    struct paused {
      stage_runner* self;
      FirstStep first_step;
      ~paused() { self->start_exchanges(self->buckets_, self->threads_, first_step()); }
    };
    return paused{this, std::forward<FirstStep>(first_step)};
  }

  // Stops everything and waits for the tasks in flight; where `abandons()` (evaluated under
  // the lock) says that steps are still in flight, the links are aborted so that the other
  // ranks fail instead of waiting.
  template <class Abandons>
  void shut_down(Abandons&& abandons) {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      if (!failed_ && abandons()) {
        failed_ = true;
        failure_ = std::make_exception_ptr(
            error(errc::peer_failure, "pipeline destroyed with steps in flight"));
        owner_.abort_links("stellatrain pipeline destroyed with steps in flight");
      }
    }
    changed_.notify_all();
    exchangers_.clear();  // joins
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return active_tasks_ == 0; });
  }

 private:
  struct task {
    std::int64_t step;
    std::size_t bucket;
    bool apply;  // else encode
    bool operator<(const task& o) const noexcept {
      // priority_queue pops the largest: the oldest step, then the front bucket (the next
      // forward needs the front layers first), then apply.
      if (step != o.step) return step > o.step;
      if (bucket != o.bucket) return bucket > o.bucket;
      return !apply && o.apply;
    }
  };

  // Runs the most urgent ready task (one per submitted job).
  void run_one() noexcept {
    task t{};
    {
      std::lock_guard lock(mutex_);
      t = ready_.top();
      ready_.pop();
    }
    const double cpu0 = thread_cpu_seconds();
    try {
      bool skip;
      {
        std::lock_guard lock(mutex_);
        skip = failed_;
      }
      if (!skip) {
        if (t.apply) {
          owner_.apply_stage(t.bucket, t.step);
        } else {
          owner_.encode_stage(t.bucket, t.step);
        }
      }
    } catch (...) {
      fail(std::current_exception());
    }
    const double cpu = thread_cpu_seconds() - cpu0;
    {
      std::lock_guard lock(mutex_);
      owner_.task_done(t.bucket, t.apply, cpu);
      --active_tasks_;
    }
    changed_.notify_all();
  }

  void exchange_loop(const std::vector<std::size_t>& mine, std::int64_t first_step) noexcept {
    for (std::int64_t step = first_step;; ++step) {
      for (std::size_t b : mine) {
        {
          std::unique_lock lock(mutex_);
          changed_.wait(lock,
                        [&] { return stopping_ || failed_ || owner_.exchange_ready(b, step); });
          if (stopping_ || failed_) return;
        }
        try {
          owner_.exchange_stage(b, step);
        } catch (...) {
          fail(std::current_exception());
          return;
        }
      }
    }
  }

  Owner& owner_;
  Executor& ex_;
  std::string who_;
  std::size_t buckets_ = 0;
  int threads_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::priority_queue<task> ready_;
  std::size_t active_tasks_ = 0;
  bool stopping_ = false;
  bool failed_ = false;
  std::exception_ptr failure_;
  std::vector<std::jthread> exchangers_;  // last: joined first
};

}  // namespace stellatrain::detail
