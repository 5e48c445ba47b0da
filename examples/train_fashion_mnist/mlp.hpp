// SPDX-License-Identifier: Apache-2.0
// A multi-layer perceptron (ReLU hidden layers, softmax cross-entropy) whose parameters and
// gradients live in one flat float array, so that a data-parallel trainer can hand each
// layer's gradient to the exchange as one tensor. The math goes through Eigen.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <random>
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
  using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using matrix_map = Eigen::Map<matrix>;
  using const_matrix_map = Eigen::Map<const matrix>;
  using row_vector = Eigen::Matrix<float, 1, Eigen::Dynamic>;

  /// widths = {inputs, hidden..., classes}; activations are sized for batches up to max_batch.
  mlp(std::vector<int> widths, int max_batch) : widths_(std::move(widths)), max_batch_(max_batch) {
    std::size_t offset = 0;
    std::uint32_t id = 0;
    for (std::size_t l = 0; l + 1 < widths_.size(); ++l) {
      const auto w =
          static_cast<std::size_t>(widths_[l]) * static_cast<std::size_t>(widths_[l + 1]);
      tensors_.push_back({id++, offset, w});
      offset += w;
      tensors_.push_back({id++, offset, static_cast<std::size_t>(widths_[l + 1])});
      offset += static_cast<std::size_t>(widths_[l + 1]);
    }
    parameters_ = offset;
    for (std::size_t l = 0; l < widths_.size(); ++l) {
      activations_.emplace_back(max_batch_, widths_[l]);
      deltas_.emplace_back(max_batch_, widths_[l]);
    }
  }

  [[nodiscard]] std::size_t parameter_count() const { return parameters_; }
  /// Weight (in x out, row-major) and bias tensors, layer by layer, front first.
  [[nodiscard]] const std::vector<tensor_slice>& tensors() const { return tensors_; }
  [[nodiscard]] int layers() const { return static_cast<int>(widths_.size()) - 1; }

  /// He-normal weights, zero biases.
  void initialize(std::span<float> params, std::uint64_t seed) const {
    std::mt19937_64 rng(seed);
    for (int l = 0; l < layers(); ++l) {
      std::normal_distribution<float> dist(0.0f, std::sqrt(2.0f / static_cast<float>(widths_[l])));
      const auto& w = tensors_[2 * l];
      for (std::size_t i = 0; i < w.size; ++i) params[w.offset + i] = dist(rng);
      const auto& b = tensors_[2 * l + 1];
      for (std::size_t i = 0; i < b.size; ++i) params[b.offset + i] = 0.0f;
    }
  }

  /// Forward and backward pass over a batch: writes d(mean loss)/d(params) to `grad` and
  /// returns the mean cross-entropy loss. x: batch x inputs, row-major.
  float forward_backward(std::span<const float> params, const float* x, const std::uint8_t* y,
                         int batch, std::span<float> grad) {
    const float loss = forward(params, x, y, batch);
    // d loss / d logits = (softmax - onehot) / batch, already in deltas_.back() from forward().
    for (int l = layers() - 1; l >= 0; --l) {
      auto delta = deltas_[l + 1].topRows(batch);
      const auto& a_in = activations_[l].topRows(batch);
      matrix_map dw(grad.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
      Eigen::Map<row_vector> db(grad.data() + tensors_[2 * l + 1].offset, widths_[l + 1]);
      dw.noalias() = a_in.transpose() * delta;
      db = delta.colwise().sum();
      if (l > 0) {
        const_matrix_map w(params.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
        auto prev = deltas_[l].topRows(batch);
        prev.noalias() = delta * w.transpose();
        prev = (activations_[l].topRows(batch).array() > 0.0f).select(prev, 0.0f);
      }
    }
    return loss;
  }

  /// Number of correct predictions over `count` examples (evaluated in batches).
  std::size_t correct(std::span<const float> params, const float* x, const std::uint8_t* y,
                      std::size_t count) {
    std::size_t right = 0;
    for (std::size_t b = 0; b < count; b += static_cast<std::size_t>(max_batch_)) {
      const int n =
          static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(max_batch_), count - b));
      forward(params, x + b * static_cast<std::size_t>(widths_[0]), nullptr, n);
      const auto& logits = activations_.back();
      for (int i = 0; i < n; ++i) {
        Eigen::Index best = 0;
        logits.row(i).maxCoeff(&best);
        right += static_cast<std::size_t>(best) == y[b + static_cast<std::size_t>(i)] ? 1 : 0;
      }
    }
    return right;
  }

 private:
  // Fills activations_ (the last one holds the logits); with labels, also the loss gradient
  // at the logits in deltas_.back(), and returns the mean loss.
  float forward(std::span<const float> params, const float* x, const std::uint8_t* y, int batch) {
    activations_[0].topRows(batch) = const_matrix_map(x, batch, widths_[0]);
    for (int l = 0; l < layers(); ++l) {
      const_matrix_map w(params.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
      Eigen::Map<const row_vector> b(params.data() + tensors_[2 * l + 1].offset, widths_[l + 1]);
      auto out = activations_[l + 1].topRows(batch);
      out.noalias() = activations_[l].topRows(batch) * w;
      out.rowwise() += b;
      if (l + 1 < layers()) out = out.cwiseMax(0.0f);
    }
    if (y == nullptr) return 0.0f;
    auto logits = activations_.back().topRows(batch);
    auto delta = deltas_.back().topRows(batch);
    double loss = 0;
    for (int i = 0; i < batch; ++i) {
      const float m = logits.row(i).maxCoeff();
      delta.row(i) = (logits.row(i).array() - m).exp().matrix();
      const float sum = delta.row(i).sum();
      loss += std::log(sum) - (logits(i, y[i]) - m);
      delta.row(i) /= sum;
      delta(i, y[i]) -= 1.0f;
    }
    delta /= static_cast<float>(batch);
    return static_cast<float>(loss / batch);
  }

  std::vector<int> widths_;
  int max_batch_;
  std::vector<tensor_slice> tensors_;
  std::size_t parameters_ = 0;
  std::vector<matrix> activations_;  // per layer boundary: batch x width
  std::vector<matrix> deltas_;
};

}  // namespace fashion_mnist
