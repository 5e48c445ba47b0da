// SPDX-License-Identifier: Apache-2.0
// The tensors registered with a pipeline: their place in the buckets and the optimizer, their
// hand-overs, the last step applied to each and its update record, and the initial values
// until the start.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pipeline/detail/update_record.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::detail {

// A tensor as the start and the checkpoints compare it between ranks and runs.
struct tensor_shape {
  std::uint32_t id = 0;
  std::uint64_t size = 0;
};

template <class Index, class RecordValue>
struct pipeline_tensor {
  std::uint32_t id = 0;
  std::uint64_t size = 0;
  std::size_t bucket = 0;
  std::size_t index_in_bucket = 0;
  std::uint64_t offset_in_bucket = 0;
  std::size_t optimizer_index = 0;
  std::uint64_t pushes = 0;  // hand-overs so far (micro-batches included)
  // Guarded by the bucket's params_mutex:
  std::int64_t applied = -1;                 // the last step applied to the parameters
  update_record<Index, RecordValue> record;  // with an update record

  // Throws `errc::size_mismatch` unless `n`, what `call` was given as `what`, is the size.
  void require_size(std::uint64_t n, const char* call, const char* what) const {
    if (n != size) {
      throw_error(errc::size_mismatch, std::string(call) + ": tensor " + std::to_string(id) +
                                           " has " + std::to_string(size) + " elements, " + what +
                                           " " + std::to_string(n));
    }
  }
};

template <class Index, class RecordValue>
class tensor_table {
 public:
  using tensor = pipeline_tensor<Index, RecordValue>;

  // Registers tensor `id` with its initial values (copied); returns its index.
  std::size_t add(std::uint32_t id, std::span<const float> initial) {
    for (const auto& t : tensors_) {
      if (t.id == id)
        throw_error(errc::invalid_argument, "pipeline::add_tensor: tensor id " +
                                                std::to_string(id) + " is already registered");
    }
    tensor t;
    t.id = id;
    t.size = initial.size();
    initial_.insert(initial_.end(), initial.begin(), initial.end());
    tensors_.push_back(std::move(t));
    return tensors_.size() - 1;
  }

  // Tensor `t`, or `errc::out_of_range`.
  tensor& at(std::size_t t) {
    if (t >= tensors_.size()) {
      throw_error(errc::out_of_range, "pipeline: tensor " + std::to_string(t) +
                                          " is not registered (" + std::to_string(tensors_.size()) +
                                          " tensors)");
    }
    return tensors_[t];
  }
  const tensor& at(std::size_t t) const { return const_cast<tensor_table*>(this)->at(t); }
  tensor& operator[](std::size_t t) noexcept { return tensors_[t]; }
  const tensor& operator[](std::size_t t) const noexcept { return tensors_[t]; }

  [[nodiscard]] std::size_t size() const noexcept { return tensors_.size(); }
  [[nodiscard]] bool empty() const noexcept { return tensors_.empty(); }
  auto begin() noexcept { return tensors_.begin(); }
  auto end() noexcept { return tensors_.end(); }
  auto begin() const noexcept { return tensors_.begin(); }
  auto end() const noexcept { return tensors_.end(); }

  // Throws `errc::invalid_argument`, starting with `what`, unless every tensor was handed over
  // `pushes` times.
  void require_pushes(std::uint64_t pushes, const char* what) const {
    for (const auto& t : tensors_) {
      if (t.pushes != pushes) {
        throw_error(errc::invalid_argument, std::string(what) + " (tensor " + std::to_string(t.id) +
                                                " has " + std::to_string(t.pushes) +
                                                " hand-overs, " + std::to_string(pushes) +
                                                " complete the last step)");
      }
    }
  }

  [[nodiscard]] std::vector<tensor_shape> shapes() const {
    std::vector<tensor_shape> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back({t.id, t.size});
    return out;
  }

  [[nodiscard]] std::uint64_t elements() const noexcept {
    std::uint64_t n = 0;
    for (const auto& t : tensors_) n += t.size;
    return n;
  }

  // The tensors' initial values, concatenated, until `release_initial`.
  [[nodiscard]] std::span<float> initial() noexcept { return initial_; }
  void release_initial() {
    initial_.clear();
    initial_.shrink_to_fit();
  }

 private:
  std::vector<tensor> tensors_;
  std::vector<float> initial_;
};

}  // namespace stellatrain::detail
