// SPDX-License-Identifier: Apache-2.0
// A growable byte buffer that keeps its capacity: what a variable-length receive writes into.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>

namespace stellatrain {

/// Owned bytes of one message: a size, and a capacity that only grows.
///
/// Receives of unknown length (`message_transport::irecv(src, tag, message_buffer&)`) and the
/// collectives resize it to what arrived. Once its capacity covers the largest message of a
/// training step, no later step allocates: keep one per peer across steps. Memory is
/// cache-line aligned (large buffers on transparent huge pages, see `aligned_buffer`); bytes
/// past `size()` are unspecified. Move-only.
///
/// \code
///   stellatrain::message_buffer m;
///   m.reserve(1 << 20, true);           // 1 MiB, every page touched now
///   m.resize_for_overwrite(1000);       // no copy, no allocation: capacity suffices
///   std::memset(m.data(), 0, m.size());
/// \endcode
class message_buffer {
 public:
  message_buffer() = default;

  /// An empty buffer with `capacity` bytes allocated (pre-faulted when `prefault`).
  explicit message_buffer(std::size_t capacity, bool prefault = false) {
    reserve(capacity, prefault);
  }

  message_buffer(message_buffer&&) noexcept = default;
  message_buffer& operator=(message_buffer&&) noexcept = default;
  message_buffer(const message_buffer&) = delete;
  message_buffer& operator=(const message_buffer&) = delete;
  ~message_buffer() = default;

  [[nodiscard]] std::byte* data() noexcept { return storage_.data(); }
  [[nodiscard]] const std::byte* data() const noexcept { return storage_.data(); }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return storage_.size(); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  [[nodiscard]] std::span<std::byte> span() noexcept { return {data(), size_}; }
  [[nodiscard]] std::span<const std::byte> span() const noexcept { return {data(), size_}; }
  operator std::span<const std::byte>() const noexcept { return span(); }  // NOLINT

  /// Makes the capacity at least `bytes`, keeping the contents. O(size) when it reallocates.
  /// Throws `errc::resource_exhausted` when the memory cannot be allocated.
  void reserve(std::size_t bytes, bool prefault = false) {
    if (bytes <= capacity()) return;
    aligned_buffer<std::byte> grown(bytes, {.prefault = prefault});
    if (size_ != 0) std::memcpy(grown.data(), storage_.data(), size_);
    storage_ = std::move(grown);
  }

  /// Sets the size to `bytes`, keeping the first `min(size(), bytes)` bytes; new bytes are
  /// unspecified. Grows the capacity geometrically when needed.
  void resize(std::size_t bytes) {
    if (bytes > capacity()) reserve(std::max(bytes, grown_capacity()));
    size_ = bytes;
  }

  /// Sets the size to `bytes` with unspecified contents (nothing is copied, even when the
  /// capacity grows): for a receive that overwrites every byte.
  void resize_for_overwrite(std::size_t bytes) {
    if (bytes > capacity()) {
      size_ = 0;
      reserve(std::max(bytes, grown_capacity()));
    }
    size_ = bytes;
  }

  /// Replaces the contents with a copy of `bytes`.
  void assign(std::span<const std::byte> bytes) {
    resize_for_overwrite(bytes.size());
    if (!bytes.empty()) std::memcpy(data(), bytes.data(), bytes.size());
  }

  /// Size 0; the capacity stays.
  void clear() noexcept { size_ = 0; }

 private:
  [[nodiscard]] std::size_t grown_capacity() const noexcept { return capacity() + capacity() / 2; }

  aligned_buffer<std::byte> storage_;
  std::size_t size_ = 0;
};

}  // namespace stellatrain
