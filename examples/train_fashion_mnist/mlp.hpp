// SPDX-License-Identifier: Apache-2.0
// A multi-layer perceptron (ReLU hidden layers, softmax cross-entropy) whose parameters and
// gradients live in one flat float array, so that a data-parallel trainer can hand each
// layer's gradient to the exchange as one tensor. The math goes through Eigen, in mlp.cpp: a
// translation unit that uses the model does not compile Eigen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace fashion_mnist {

/// One parameter tensor of the model: where it lives in the flat array.
struct tensor_slice {
  std::uint32_t id;
  std::size_t offset;
  std::size_t size;
};

class mlp {
 public:
  /// widths = {inputs, hidden..., classes}; activations are sized for batches up to max_batch.
  mlp(std::vector<int> widths, int max_batch);
  ~mlp();
  mlp(mlp&&) noexcept;
  mlp& operator=(mlp&&) noexcept;

  [[nodiscard]] std::size_t parameter_count() const { return parameters_; }
  /// Weight (in x out, row-major) and bias tensors, layer by layer, front first.
  [[nodiscard]] const std::vector<tensor_slice>& tensors() const { return tensors_; }
  [[nodiscard]] int layers() const { return static_cast<int>(widths_.size()) - 1; }

  /// He-normal weights, zero biases.
  void initialize(std::span<float> params, std::uint64_t seed) const;

  /// Forward and backward pass over a batch: writes d(mean loss)/d(params) to `grad` and
  /// returns the mean cross-entropy loss. x: batch x inputs, row-major.
  float forward_backward(std::span<const float> params, const float* x, const std::uint8_t* y,
                         int batch, std::span<float> grad);

  /// Number of correct predictions over `count` examples (evaluated in batches).
  std::size_t correct(std::span<const float> params, const float* x, const std::uint8_t* y,
                      std::size_t count);

 private:
  struct buffers;  // activations and deltas per layer boundary (Eigen matrices)

  // Fills the activations (the last one holds the logits); with labels, also the loss
  // gradient at the logits in the last delta, and returns the mean loss.
  float forward(std::span<const float> params, const float* x, const std::uint8_t* y, int batch);

  std::vector<int> widths_;
  int max_batch_;
  std::vector<tensor_slice> tensors_;
  std::size_t parameters_ = 0;
  std::unique_ptr<buffers> work_;
};

}  // namespace fashion_mnist
