// SPDX-License-Identifier: Apache-2.0
// Streaming local steps (Streaming DiLoCo, arXiv 2501.18512): the parameters in F fragments,
// each with its own outer pipeline, synchronised in turn and merged tau inner steps after they
// were sent, so that the link carries a steady stream instead of a burst every H steps.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pipeline/detail/pseudo_gradient.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// Settings of `streaming_local_steps`. Every rank must use the same values (the weight
/// excepted).
struct streaming_options {
  /// H: inner steps between two outer steps of the same fragment, >= 1.
  std::uint32_t inner_steps = 25;
  /// tau: inner steps between sending a fragment and merging its outer step, 0 <= tau < H.
  /// With tau > 0 the exchange runs during those inner steps.
  std::uint32_t delay = 0;
  /// alpha of the merge: replica = (1 - alpha) outer + alpha replica, in [0, 1). 0 replaces
  /// the fragment by the outer parameters (DiLoCo); Streaming DiLoCo mixes (0.5) what the
  /// replica learnt during the tau inner steps back in.
  float mix = 0.0f;
  /// As `local_steps_options::weight`.
  double weight = 0;
};

/// Local steps with the parameters in F fragments (Streaming DiLoCo), over F started outer
/// pipelines, one per fragment (each holding that fragment's tensors, with its own
/// `tag_base`), of type `P`. Fragment f's outer step runs every H inner steps, offset by
/// f floor(H / F) inner steps from fragment 0's, so that the fragments' exchanges take turns:
///
///   inner step t with t = f floor(H / F) (mod H), t >= 1: fragment f hands its
///     pseudo-gradient (outer - replica) to its pipeline, which exchanges it in the background
///   tau inner steps later: waits for that outer step, then merges:
///     replica_f = (1 - mix) outer_f + mix replica_f   (elementwise, in fp32)
///
/// The outer parameters of every fragment are the same bits on every rank after each of its
/// outer steps (the pipelines' guarantee). With mix 0 a merged fragment of the replica is its
/// outer parameters, the same bits on every rank; with mix > 0 it keeps part of what this
/// rank learnt since it was sent. With F = 1, tau = 0 and mix 0 it is `local_steps` (tested:
/// the same bits). The replica is every fragment's
/// tensors in order: fragment 0's (its pipeline's tensors 0, 1, ...), then fragment 1's, ...
/// Errors: `errc::invalid_argument` for no fragments, H = 0, tau >= H, F > H, a mix outside
/// [0, 1), pipelines that are not started or accumulate micro-batches, a weight with a
/// pipeline that averages, and a replica of the wrong shape; failures of an exchange are the
/// pipelines' (every rank fails). Not thread-safe: one thread drives it.
template <class Pipeline>
class streaming_local_steps {
 public:
  streaming_local_steps(std::span<Pipeline* const> fragments, streaming_options options)
      : fragments_(fragments.begin(), fragments.end()), options_(options) {
    auto bad = [](const std::string& what) {
      throw_error(errc::invalid_argument, "streaming_local_steps: " + what);
    };
    if (fragments_.empty()) bad("no fragments");
    if (options_.inner_steps == 0) bad("inner_steps must be at least 1");
    if (options_.delay >= options_.inner_steps) bad("the delay must be below inner_steps");
    if (fragments_.size() > options_.inner_steps) bad("more fragments than inner steps");
    if (!(options_.mix >= 0.0f && options_.mix < 1.0f))
      bad("mix must be in [0, 1), got " + std::to_string(options_.mix));
    if (options_.weight != 0 &&
        !(std::isfinite(options_.weight) && options_.weight > 0 && options_.weight <= 1)) {
      bad("weight must be in (0, 1], got " + std::to_string(options_.weight));
    }
    std::size_t first = 0;
    for (Pipeline* p : fragments_) {
      if (p == nullptr || p->tensor_count() == 0 || p->bucket_count() == 0)
        bad("start every fragment's pipeline first");
      if (p->options().micro_batches != 1)
        bad("the pipelines must take one hand-over per step (micro_batches 1)");
      if (options_.weight != 0 && p->options().op != reduction::sum)
        bad("a weight needs pipelines that sum the pseudo-gradients (reduction::sum)");
      first_.push_back(first);
      first += p->tensor_count();
    }
    tensors_ = first;
    sent_at_.assign(fragments_.size(), -1);
  }

  [[nodiscard]] const streaming_options& options() const noexcept { return options_; }
  /// Inner steps counted so far.
  [[nodiscard]] std::int64_t inner_steps_done() const noexcept { return t_; }
  /// Outer steps merged so far, all fragments together.
  [[nodiscard]] std::int64_t merges() const noexcept { return merges_; }
  /// The inner step (from 1) after which fragment f is sent, modulo H.
  [[nodiscard]] std::uint32_t offset(std::size_t f) const noexcept {
    return static_cast<std::uint32_t>(f * (options_.inner_steps / fragments_.size()));
  }

  /// Counts one inner step of `replica`; merges the fragments whose outer step is due (sent
  /// tau inner steps ago) and sends those whose turn it is (collective: every rank calls it
  /// after every inner step). Returns the number of fragments merged.
  std::size_t step(std::span<const std::span<float>> replica) {
    check(replica);
    ++t_;
    std::size_t merged = 0;
    const std::uint32_t h = options_.inner_steps;
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      if (sent_at_[f] >= 0 && t_ - sent_at_[f] == options_.delay) {
        merge(f, replica);
        ++merged;
      }
      if (static_cast<std::uint32_t>(t_ % h) == offset(f)) {  // offset(f) < h: F <= H
        send(f, replica);
        if (options_.delay == 0) {
          merge(f, replica);
          ++merged;
        }
      }
    }
    return merged;
  }

 private:
  void send(std::size_t f, std::span<const std::span<float>> replica) {
    detail::hand_over_pseudo_gradients(*fragments_[f],
                                       replica.subspan(first_[f], fragments_[f]->tensor_count()),
                                       static_cast<float>(options_.weight));
    sent_at_[f] = t_;
  }

  void merge(std::size_t f, std::span<const std::span<float>> replica) {
    Pipeline& p = *fragments_[f];
    p.flush();
    const float a = options_.mix;
    for (std::size_t t = 0; t < p.tensor_count(); ++t) {
      const std::span<float> mine = replica[first_[f] + t];
      if (a == 0.0f) {
        p.copy_params(t, mine);
        continue;
      }
      const std::span<float> outer = p.gradient_buffer(t);  // free after the flush: scratch
      p.copy_params(t, outer);
      for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = (1.0f - a) * outer[i] + a * mine[i];
    }
    sent_at_[f] = -1;
    ++merges_;
  }

  void check(std::span<const std::span<float>> replica) const {
    if (replica.size() != tensors_) {
      throw_error(errc::invalid_argument,
                  "streaming_local_steps: the replica has " + std::to_string(replica.size()) +
                      " tensors, the fragments " + std::to_string(tensors_));
    }
    for (std::size_t f = 0; f < fragments_.size(); ++f) {
      for (std::size_t t = 0; t < fragments_[f]->tensor_count(); ++t) {
        const std::uint64_t want = fragments_[f]->tensor_size(t);
        if (replica[first_[f] + t].size() != want) {
          throw_error(errc::invalid_argument,
                      "streaming_local_steps: tensor " + std::to_string(first_[f] + t) +
                          " of the replica has " + std::to_string(replica[first_[f] + t].size()) +
                          " elements, fragment " + std::to_string(f) + "'s " +
                          std::to_string(want));
        }
      }
    }
  }

  std::vector<Pipeline*> fragments_;
  streaming_options options_;
  std::vector<std::size_t> first_;  // each fragment's first tensor in the replica
  std::size_t tensors_ = 0;
  std::vector<std::int64_t> sent_at_;  // the inner step it was sent after (-1: none pending)
  std::int64_t t_ = 0;
  std::int64_t merges_ = 0;
};

}  // namespace stellatrain
