// SPDX-License-Identifier: Apache-2.0
// Grouping of a model's parameter tensors into gradient buckets of a target byte size.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// One bucket: the consecutive tensors `[first_tensor, first_tensor + tensor_count)` of the
/// registration order, and their total number of elements.
struct bucket_range {
  std::size_t first_tensor = 0;
  std::size_t tensor_count = 0;
  std::uint64_t elements = 0;
};

/// Groups tensors (given by their element counts, in registration order) into buckets: each
/// bucket takes consecutive tensors until it holds at least `bucket_bytes` of fp32 gradient,
/// so a bucket is never split inside a tensor and only the last bucket may be smaller than the
/// target. `bucket_bytes` 0 puts every tensor in its own bucket.
///
/// Register tensors in forward order (front layers first): backward then completes buckets from
/// the last one to the first, which is the order the pipeline exchanges them in.
///
/// \code
///   auto plan = stellatrain::plan_buckets(std::vector<std::uint64_t>{1000, 10, 5000, 10}, 4 *
///   1024);
///   // {0, 2 tensors, 1010 elements}, {2, 2 tensors, 5010 elements}
/// \endcode
[[nodiscard]] inline std::vector<bucket_range> plan_buckets(
    std::span<const std::uint64_t> tensor_elements, std::uint64_t bucket_bytes) {
  std::vector<bucket_range> buckets;
  bucket_range current;
  for (std::size_t t = 0; t < tensor_elements.size(); ++t) {
    if (current.tensor_count == 0) current.first_tensor = t;
    ++current.tensor_count;
    current.elements += tensor_elements[t];
    if (current.elements * sizeof(float) >= bucket_bytes) {
      buckets.push_back(current);
      current = {};
    }
  }
  if (current.tensor_count > 0) buckets.push_back(current);
  return buckets;
}

}  // namespace stellatrain
