// SPDX-License-Identifier: Apache-2.0
// A pipeline's master parameters as the application sees them: the registered tensors, the
// optimizer that holds them, one lock per bucket between the optimizer's steps and the copies,
// and the update record from which a copy catches up with the changed elements only.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/bucket_plan.hpp>
#include <stellatrain/pipeline/detail/tensor_table.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/update_record.hpp>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain::detail {

template <class Optimizer, class Index, class Record>
class parameter_store {
  // The value type of the update record (unused without one).
  using record_value = std::conditional_t<std::is_void_v<Record>, float, Record>;
  static constexpr bool records = !std::is_void_v<Record>;

 public:
  using table = tensor_table<Index, record_value>;

  explicit parameter_store(Optimizer optimizer) : optimizer_(std::move(optimizer)) {}

  [[nodiscard]] Optimizer& optimizer() noexcept { return optimizer_; }
  [[nodiscard]] table& tensors() noexcept { return tensors_; }
  [[nodiscard]] const table& tensors() const noexcept { return tensors_; }

  // Places the tensors in the buckets of `plan` and hands them to the optimizer with their
  // initial values (rank 0's, after the start's broadcast); returns each bucket's tensors.
  template <class Executor>
  std::vector<std::vector<bucket_tensor>> place(std::span<const bucket_range> plan, Executor& ex) {
    std::vector<std::vector<bucket_tensor>> out(plan.size());
    std::uint64_t offset = 0;
    for (std::size_t b = 0; b < plan.size(); ++b) {
      std::uint64_t in_bucket = 0;
      for (std::size_t t = plan[b].first_tensor; t < plan[b].first_tensor + plan[b].tensor_count;
           ++t) {
        auto& ts = tensors_[t];
        ts.bucket = b;
        ts.index_in_bucket = out[b].size();
        ts.offset_in_bucket = in_bucket;
        ts.optimizer_index = optimizer_.add_tensor(tensors_.initial().subspan(offset, ts.size), ex);
        out[b].push_back({.id = ts.id, .size = ts.size, .offset = in_bucket});
        in_bucket += ts.size;
        offset += ts.size;
      }
      locks_.push_back(std::make_unique<std::mutex>());
    }
    return out;
  }

  // The optimizer's step of tensor `t` with its merged update of `step` (recorded, in a
  // pipeline that records its updates), as one change for the copies.
  template <class Executor>
  void apply(std::size_t t, std::int64_t step, const merged_update<Index>& u, Executor& ex) {
    auto& ts = tensors_[t];
    std::lock_guard lock(*locks_[ts.bucket]);
    if (u.kind == aggregate_kind::dense) {
      optimizer_.step(ts.optimizer_index, u.dense, ex);
      ts.record.finish(step, /*whole=*/true);
    } else if constexpr (records) {
      ts.record.step(optimizer_, ts.optimizer_index, step, u.sparse, ex);
    } else {
      optimizer_.step(ts.optimizer_index, u.sparse, ex);
    }
    ts.applied = step;
  }

  // See `pipeline::copy_params`.
  template <class T>
  param_version copy(std::size_t t, std::span<T> out) {
    const auto& ts = tensors_.at(t);
    if (out.size() != ts.size) {
      throw_error(errc::size_mismatch, "pipeline::copy_params: tensor " + std::to_string(ts.id) +
                                           " has " + std::to_string(ts.size) +
                                           " elements, the output " + std::to_string(out.size()));
    }
    std::lock_guard lock(*locks_[ts.bucket]);
    const auto p = std::as_const(optimizer_).params(ts.optimizer_index);
    // Same bytes as the little-endian wire encoding of T on every host this library builds for.
    static_assert(std::endian::native == std::endian::little);
    encode_values(p.data(), out.size(), value_encoding_of<T>,
                  reinterpret_cast<std::byte*>(out.data()));
    return version_of(ts);
  }

  // See `pipeline::copy_changes`.
  param_changes changes(std::size_t t, param_version held, std::span<Index> indices,
                        std::span<record_value> values) {
    const auto& ts = tensors_.at(t);
    std::lock_guard lock(*locks_[ts.bucket]);
    return ts.record.changes_since(held, version_of(ts), indices, values);
  }

  // After a restore: every tensor holds the parameters through `applied` in a new history
  // (copies made before must be replaced whole).
  void restart(std::int64_t applied) {
    for (auto& t : tensors_) {
      t.applied = applied;
      t.record.forget();
    }
    generation_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  param_version version_of(const typename table::tensor& ts) const {
    return {.step = ts.applied, .generation = generation_.load(std::memory_order_relaxed)};
  }

  Optimizer optimizer_;
  table tensors_;
  std::vector<std::unique_ptr<std::mutex>> locks_;  // per bucket: optimizer step vs copies
  std::atomic<std::uint64_t> generation_{0};        // restores so far (param_version::generation)
};

}  // namespace stellatrain::detail
