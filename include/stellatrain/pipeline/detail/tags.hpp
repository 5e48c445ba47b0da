// SPDX-License-Identifier: Apache-2.0
// The pipeline's tags, from `pipeline_options::tag_base` on: one block for the buckets'
// exchanges, then the start's broadcast and topology check. Every tag of a pipeline is
// computed here.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/transport/concept.hpp>

#include <cstddef>
#include <cstdint>

namespace stellatrain::detail {

class pipeline_tags {
 public:
  // Exchanges cycle through this many tags: a tag returns only after 16384 bucket exchanges,
  // long after its previous messages were received.
  static constexpr tag_type exchange_tags = 16384;
  static_assert(exchange_tags + 2 == pipeline_tag_count);

  pipeline_tags(tag_type base, std::size_t buckets) noexcept : base_(base), buckets_(buckets) {}

  // The exchange of bucket b at `step` over the link of every rank (flat) or between clusters.
  [[nodiscard]] tag_type exchange(std::int64_t step, std::size_t b) const noexcept {
    return base_ + static_cast<tag_type>(serial(step, b) % exchange_tags);
  }
  // Inside a cluster the reduce-scatter and the gather of the same exchange split the block.
  [[nodiscard]] tag_type cluster_reduce(std::int64_t step, std::size_t b) const noexcept {
    return base_ + static_cast<tag_type>(serial(step, b) % (exchange_tags / 2));
  }
  [[nodiscard]] tag_type cluster_gather(std::int64_t step, std::size_t b) const noexcept {
    return cluster_reduce(step, b) + exchange_tags / 2;
  }
  // Start: rank 0's tensors and initial parameters, then (hierarchical) the topology check.
  [[nodiscard]] tag_type broadcast() const noexcept { return base_ + exchange_tags; }
  [[nodiscard]] tag_type topology() const noexcept { return base_ + exchange_tags + 1; }

 private:
  [[nodiscard]] std::uint64_t serial(std::int64_t step, std::size_t b) const noexcept {
    return static_cast<std::uint64_t>(step) * buckets_ + b;
  }

  tag_type base_;
  std::size_t buckets_;
};

}  // namespace stellatrain::detail
