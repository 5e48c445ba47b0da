// SPDX-License-Identifier: Apache-2.0
// The data side of an uneven batch split: which examples each rank computes in a step when the
// ranks' batches differ and change, so that an epoch still uses every example exactly once.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// Every rank holds a sampler made with the same `count` and `seed` and calls `next` once per
/// step with the step's split (the same on every rank, e.g. `batch_split_agreement::split()`).
/// The examples form one sequence: epoch 0's order, then epoch 1's, ...; each epoch a new
/// random permutation of [0, count). A step takes the next sum(split) positions of that
/// sequence, rank 0 the first split[0] of them, rank 1 the next split[1], and so on. So within
/// an epoch no example repeats and none is skipped, whatever the splits (a step that crosses
/// the end of an epoch finishes it and begins the next).
///
/// The permutations are a fixed function of (seed, epoch): Fisher-Yates over a 64-bit Mersenne
/// Twister with unbiased bounded draws, the same on every platform. Memory: two orders of
/// `count` indices (the current epoch's and the next one's).
class split_sampler {
 public:
  /// Throws stellatrain::error(invalid_argument) for count 0.
  split_sampler(std::uint64_t count, std::uint64_t seed) : count_(count), seed_(seed) {
    if (count == 0) throw error(errc::invalid_argument, "split_sampler: no examples");
    current_ = order_of(0);
  }

  /// Writes the example indices of rank `rank` for the next step into `out` (resized to
  /// split[rank]) and advances to the following step.
  ///
  /// Throws stellatrain::error(invalid_argument) if `rank` is outside the split or the step's
  /// global batch exceeds the examples (one step would repeat an example).
  void next(std::span<const std::uint64_t> split, std::size_t rank,
            std::vector<std::uint64_t>& out) {
    if (rank >= split.size()) {
      throw error(errc::invalid_argument, "split_sampler: rank " + std::to_string(rank) +
                                              " of a split for " + std::to_string(split.size()));
    }
    std::uint64_t total = 0;
    std::uint64_t first = 0;
    for (std::size_t r = 0; r < split.size(); ++r) {
      if (split[r] > count_ - total) {
        throw error(errc::invalid_argument, "split_sampler: a global batch above the " +
                                                std::to_string(count_) + " examples");
      }
      if (r == rank) first = total;
      total += split[r];
    }
    out.resize(static_cast<std::size_t>(split[rank]));
    for (std::uint64_t i = 0; i < split[rank]; ++i) out[i] = at(position_ + first + i);
    advance(total);
  }

  [[nodiscard]] std::uint64_t epoch() const noexcept { return epoch_; }
  /// Examples of the current epoch used so far.
  [[nodiscard]] std::uint64_t position() const noexcept { return position_; }
  [[nodiscard]] std::uint64_t count() const noexcept { return count_; }

 private:
  // Position p counts from the start of the current epoch; p >= count is in the next one.
  std::uint64_t at(std::uint64_t p) {
    if (p < count_) return current_[p];
    if (next_.empty()) next_ = order_of(epoch_ + 1);
    return next_[p - count_];
  }

  void advance(std::uint64_t n) {
    position_ += n;
    if (position_ >= count_) {
      position_ -= count_;
      ++epoch_;
      current_ = next_.empty() ? order_of(epoch_) : std::move(next_);
      next_.clear();
    }
  }

  [[nodiscard]] std::vector<std::uint64_t> order_of(std::uint64_t epoch) const {
    std::vector<std::uint64_t> order(count_);
    for (std::uint64_t i = 0; i < count_; ++i) order[i] = i;
    std::mt19937_64 rng(seed_ ^ (0x9E3779B97F4A7C15ull * (epoch + 1)));
    for (std::uint64_t i = count_ - 1; i > 0; --i) std::swap(order[i], order[below(rng, i + 1)]);
    return order;
  }

  // Uniform in [0, n) by rejection (std::uniform_int_distribution differs between libraries).
  static std::uint64_t below(std::mt19937_64& rng, std::uint64_t n) {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % n);
    std::uint64_t x = rng();
    while (x >= limit) x = rng();
    return x % n;
  }

  std::uint64_t count_;
  std::uint64_t seed_;
  std::uint64_t epoch_ = 0;
  std::uint64_t position_ = 0;
  std::vector<std::uint64_t> current_;
  std::vector<std::uint64_t> next_;
};

}  // namespace stellatrain
