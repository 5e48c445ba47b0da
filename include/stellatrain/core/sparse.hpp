// SPDX-License-Identifier: Apache-2.0
// Sparse gradients: a non-owning view (indices + values into a dense tensor of a given size)
// and an owning buffer, with a validation that says what is wrong and where.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace stellatrain {

/// A sparse tensor that it does not own: `size()` pairs (`indices()[j]`, `values()[j]`) into a
/// dense tensor of `dense_size()` elements.
///
/// `Value` is `float`, `fp16` or `bf16` and `Index` is `std::uint32_t` or `std::uint64_t`,
/// either optionally `const` (a read-only view). Sizes are 64-bit. The view itself promises
/// nothing about the indices (order, uniqueness, range); producers document what they
/// guarantee, and `validate_sparse` checks it. A view of mutable elements converts
/// implicitly to the matching read-only view.
///
/// \code
///   std::vector<std::uint32_t> idx{3, 17};
///   std::vector<float> val{0.5f, -2.0f};
///   stellatrain::sparse_view<const float, const std::uint32_t> g{idx, val, 100};
/// \endcode
template <class Value, class Index = std::uint32_t>
class sparse_view {
  static_assert(value_type<std::remove_const_t<Value>>, "Value must be float, fp16 or bf16");
  static_assert(index_type<std::remove_const_t<Index>>,
                "Index must be std::uint32_t or std::uint64_t");

 public:
  using value_type = Value;
  using index_type = Index;
  using size_type = std::uint64_t;

  constexpr sparse_view() = default;

  /// Precondition: `indices.size() == values.size()`.
  constexpr sparse_view(std::span<Index> indices, std::span<Value> values, size_type dense_size)
      : indices_(indices.data()),
        values_(values.data()),
        size_(indices.size()),
        dense_size_(dense_size) {
    STELLATRAIN_ASSERT(indices.size() == values.size(),
                       "sparse_view: indices and values differ in length");
  }

  /// A read-only view of a mutable one.
  template <class V, class I>
  requires(
      std::is_same_v<const V, Value>&& std::is_same_v<const I, Index> &&
      !(std::is_same_v<V, Value> &&
        std::is_same_v<
            I,
            Index>)) constexpr sparse_view(const sparse_view<V, I>&
                                               other) noexcept  // NOLINT(google-explicit-constructor)
      : indices_(other.indices().data()),
        values_(other.values().data()),
        size_(other.size()),
        dense_size_(other.dense_size()) {}

  /// Number of stored (index, value) pairs.
  [[nodiscard]] constexpr size_type size() const noexcept { return size_; }
  [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
  /// Number of elements of the dense tensor the indices point into.
  [[nodiscard]] constexpr size_type dense_size() const noexcept { return dense_size_; }
  /// `size() / dense_size()`, or 0 for an empty dense tensor.
  [[nodiscard]] constexpr double density() const noexcept {
    return dense_size_ == 0 ? 0.0 : static_cast<double>(size_) / static_cast<double>(dense_size_);
  }

  [[nodiscard]] constexpr std::span<Index> indices() const noexcept {
    return {indices_, static_cast<std::size_t>(size_)};
  }
  [[nodiscard]] constexpr std::span<Value> values() const noexcept {
    return {values_, static_cast<std::size_t>(size_)};
  }

  /// The pairs `[offset, offset + count)` as a view of the same dense tensor.
  [[nodiscard]] constexpr sparse_view subview(size_type offset, size_type count) const noexcept {
    STELLATRAIN_ASSERT(offset <= size_ && count <= size_ - offset,
                       "sparse_view::subview out of range");
    sparse_view v;
    v.indices_ = indices_ + offset;
    v.values_ = values_ + offset;
    v.size_ = count;
    v.dense_size_ = dense_size_;
    return v;
  }

 private:
  Index* indices_ = nullptr;
  Value* values_ = nullptr;
  size_type size_ = 0;
  size_type dense_size_ = 0;
};

/// What `validate_sparse` requires of the indices besides being in range.
enum class index_order : std::uint8_t {
  any,                ///< no order required
  strictly_ascending  ///< sorted ascending without duplicates
};

/// Checks that every index is below `dense_size()` and, if asked, that indices ascend
/// strictly. Throws `error` (`errc::out_of_range` or `errc::invalid_argument`) naming the
/// first offending position and its value; `what` prefixes the message (say, the tensor).
/// Linear time, no allocation.
template <class Value, class Index>
void validate_sparse(const sparse_view<Value, Index>& s, index_order order = index_order::any,
                     std::string_view what = "sparse tensor") {
  const auto idx = s.indices();
  const std::uint64_t n = s.dense_size();
  for (std::size_t j = 0; j < idx.size(); ++j) {
    const std::uint64_t i = idx[j];
    if (i >= n) [[unlikely]] {
      throw_error(errc::out_of_range, std::string(what) + ": index " + std::to_string(i) +
                                          " at position " + std::to_string(j) +
                                          " is not below the dense size " + std::to_string(n));
    }
    if (order == index_order::strictly_ascending && j > 0 && idx[j - 1] >= i) [[unlikely]] {
      throw_error(errc::invalid_argument,
                  std::string(what) + ": indices not strictly ascending at position " +
                      std::to_string(j) + " (" + std::to_string(idx[j - 1]) + " then " +
                      std::to_string(i) + ")");
    }
  }
}

/// An owning sparse tensor: aligned storage for up to `capacity()` pairs, of which the first
/// `size()` are in use. Storage is allocated once (on construction or `reserve`); `resize`
/// within the capacity never allocates, so a buffer reused across steps costs no page faults.
///
/// \code
///   stellatrain::sparse_buffer<stellatrain::bf16> sel(/*dense_size=*/1 << 20,
///   /*capacity=*/10'000); sel.resize(2); sel.indices()[0] = 5;  sel.values()[0] =
///   stellatrain::bf16{1.5f}; auto view = sel.view();  // sparse_view<const bf16, const
///   std::uint32_t>
/// \endcode
template <class Value, class Index = std::uint32_t>
class sparse_buffer {
  static_assert(value_type<Value>, "Value must be float, fp16 or bf16 (not const)");
  static_assert(index_type<Index>, "Index must be std::uint32_t or std::uint64_t (not const)");

 public:
  using value_type = Value;
  using index_type = Index;
  using size_type = std::uint64_t;

  sparse_buffer() = default;

  /// Storage for `capacity` pairs into a dense tensor of `dense_size` elements; size 0.
  sparse_buffer(size_type dense_size, size_type capacity, buffer_options options = {})
      : indices_(checked_capacity(capacity), options),
        values_(static_cast<std::size_t>(capacity), options),
        dense_size_(dense_size) {}

  [[nodiscard]] size_type size() const noexcept { return size_; }
  [[nodiscard]] size_type capacity() const noexcept { return indices_.size(); }
  [[nodiscard]] size_type dense_size() const noexcept { return dense_size_; }
  void set_dense_size(size_type n) noexcept { dense_size_ = n; }

  /// Sets the number of pairs in use; throws `errc::out_of_range` past the capacity.
  void resize(size_type n) {
    if (n > capacity()) {
      throw_error(errc::out_of_range, "sparse_buffer::resize: " + std::to_string(n) +
                                          " pairs exceed the capacity " +
                                          std::to_string(capacity()));
    }
    size_ = n;
  }

  /// Makes room for at least `n` pairs, keeping the pairs in use.
  void reserve(size_type n, buffer_options options = {}) {
    if (n <= capacity()) return;
    sparse_buffer bigger(dense_size_, n, options);
    std::copy_n(indices_.data(), size_, bigger.indices_.data());
    std::copy_n(values_.data(), size_, bigger.values_.data());
    bigger.size_ = size_;
    *this = std::move(bigger);
  }

  [[nodiscard]] std::span<Index> indices() noexcept {
    return {indices_.data(), static_cast<std::size_t>(size_)};
  }
  [[nodiscard]] std::span<Value> values() noexcept {
    return {values_.data(), static_cast<std::size_t>(size_)};
  }
  [[nodiscard]] std::span<const Index> indices() const noexcept {
    return {indices_.data(), static_cast<std::size_t>(size_)};
  }
  [[nodiscard]] std::span<const Value> values() const noexcept {
    return {values_.data(), static_cast<std::size_t>(size_)};
  }

  [[nodiscard]] sparse_view<Value, Index> view() noexcept {
    return {indices(), values(), dense_size_};
  }
  [[nodiscard]] sparse_view<const Value, const Index> view() const noexcept {
    return {indices(), values(), dense_size_};
  }

 private:
  static std::size_t checked_capacity(size_type capacity) {
    if (capacity > static_cast<size_type>(SIZE_MAX / sizeof(std::uint64_t))) {
      throw_error(errc::resource_exhausted,
                  "sparse_buffer: capacity " + std::to_string(capacity) + " is too large");
    }
    return static_cast<std::size_t>(capacity);
  }

  aligned_buffer<Index> indices_;
  aligned_buffer<Value> values_;
  size_type size_ = 0;
  size_type dense_size_ = 0;
};

}  // namespace stellatrain
