// SPDX-License-Identifier: Apache-2.0
#include "mlp.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

namespace fashion_mnist {
namespace {
using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using matrix_map = Eigen::Map<matrix>;
using const_matrix_map = Eigen::Map<const matrix>;
using row_vector = Eigen::Matrix<float, 1, Eigen::Dynamic>;
}  // namespace

struct mlp::buffers {
  std::vector<matrix> activations;  // per layer boundary: batch x width
  std::vector<matrix> deltas;
};

mlp::mlp(std::vector<int> widths, int max_batch)
    : widths_(std::move(widths)), max_batch_(max_batch), work_(std::make_unique<buffers>()) {
  std::size_t offset = 0;
  std::uint32_t id = 0;
  for (std::size_t l = 0; l + 1 < widths_.size(); ++l) {
    const auto w = static_cast<std::size_t>(widths_[l]) * static_cast<std::size_t>(widths_[l + 1]);
    tensors_.push_back({id++, offset, w});
    offset += w;
    tensors_.push_back({id++, offset, static_cast<std::size_t>(widths_[l + 1])});
    offset += static_cast<std::size_t>(widths_[l + 1]);
  }
  parameters_ = offset;
  for (std::size_t l = 0; l < widths_.size(); ++l) {
    work_->activations.emplace_back(max_batch_, widths_[l]);
    work_->deltas.emplace_back(max_batch_, widths_[l]);
  }
}

mlp::~mlp() = default;
mlp::mlp(mlp&&) noexcept = default;
mlp& mlp::operator=(mlp&&) noexcept = default;

void mlp::initialize(std::span<float> params, std::uint64_t seed) const {
  std::mt19937_64 rng(seed);
  for (int l = 0; l < layers(); ++l) {
    std::normal_distribution<float> dist(0.0f, std::sqrt(2.0f / static_cast<float>(widths_[l])));
    const auto& w = tensors_[2 * l];
    for (std::size_t i = 0; i < w.size; ++i) params[w.offset + i] = dist(rng);
    const auto& b = tensors_[2 * l + 1];
    for (std::size_t i = 0; i < b.size; ++i) params[b.offset + i] = 0.0f;
  }
}

float mlp::forward_backward(std::span<const float> params, const float* x, const std::uint8_t* y,
                            int batch, std::span<float> grad) {
  const float loss = forward(params, x, y, batch);
  // d loss / d logits = (softmax - onehot) / batch, left in the last delta by forward().
  for (int l = layers() - 1; l >= 0; --l) {
    auto delta = work_->deltas[l + 1].topRows(batch);
    const auto& a_in = work_->activations[l].topRows(batch);
    matrix_map dw(grad.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
    Eigen::Map<row_vector> db(grad.data() + tensors_[2 * l + 1].offset, widths_[l + 1]);
    dw.noalias() = a_in.transpose() * delta;
    db = delta.colwise().sum();
    if (l > 0) {
      const_matrix_map w(params.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
      auto prev = work_->deltas[l].topRows(batch);
      prev.noalias() = delta * w.transpose();
      prev = (work_->activations[l].topRows(batch).array() > 0.0f).select(prev, 0.0f);
    }
  }
  return loss;
}

std::size_t mlp::correct(std::span<const float> params, const float* x, const std::uint8_t* y,
                         std::size_t count) {
  std::size_t right = 0;
  for (std::size_t b = 0; b < count; b += static_cast<std::size_t>(max_batch_)) {
    const int n =
        static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(max_batch_), count - b));
    forward(params, x + b * static_cast<std::size_t>(widths_[0]), nullptr, n);
    const auto& logits = work_->activations.back();
    for (int i = 0; i < n; ++i) {
      Eigen::Index best = 0;
      logits.row(i).maxCoeff(&best);
      right += static_cast<std::size_t>(best) == y[b + static_cast<std::size_t>(i)] ? 1 : 0;
    }
  }
  return right;
}

float mlp::forward(std::span<const float> params, const float* x, const std::uint8_t* y,
                   int batch) {
  work_->activations[0].topRows(batch) = const_matrix_map(x, batch, widths_[0]);
  for (int l = 0; l < layers(); ++l) {
    const_matrix_map w(params.data() + tensors_[2 * l].offset, widths_[l], widths_[l + 1]);
    Eigen::Map<const row_vector> b(params.data() + tensors_[2 * l + 1].offset, widths_[l + 1]);
    auto out = work_->activations[l + 1].topRows(batch);
    out.noalias() = work_->activations[l].topRows(batch) * w;
    out.rowwise() += b;
    if (l + 1 < layers()) out = out.cwiseMax(0.0f);
  }
  if (y == nullptr) return 0.0f;
  auto logits = work_->activations.back().topRows(batch);
  auto delta = work_->deltas.back().topRows(batch);
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

}  // namespace fashion_mnist
