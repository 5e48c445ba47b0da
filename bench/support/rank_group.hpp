// SPDX-License-Identifier: Apache-2.0
// Runs one job per rank on persistent threads (rank 0 on the calling thread), in lock step:
// what the transport benchmarks time, with thread start-up kept out of the timed loop.
#pragma once

#include <barrier>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace stellatrain::bench {

class rank_group {
 public:
  explicit rank_group(int ranks) : ranks_(ranks), start_(ranks), done_(ranks) {
    for (int r = 1; r < ranks; ++r) {
      threads_.emplace_back([this, r] {
        for (;;) {
          start_.arrive_and_wait();
          if (stop_) return;
          call(r);
          done_.arrive_and_wait();
        }
      });
    }
  }
  rank_group(const rank_group&) = delete;
  rank_group& operator=(const rank_group&) = delete;
  ~rank_group() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }

  /// Runs job(rank) on every rank and returns when all have returned; rethrows the first
  /// exception.
  void run(const std::function<void(int)>& job) {
    job_ = &job;
    start_.arrive_and_wait();
    call(0);
    done_.arrive_and_wait();
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  [[nodiscard]] int size() const noexcept { return ranks_; }

 private:
  void call(int r) {
    try {
      (*job_)(r);
    } catch (...) {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }

  int ranks_;
  std::barrier<> start_;
  std::barrier<> done_;
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::mutex mutex_;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
};

}  // namespace stellatrain::bench
