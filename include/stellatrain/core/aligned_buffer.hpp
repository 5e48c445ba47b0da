// SPDX-License-Identifier: Apache-2.0
// Owning, aligned arrays of trivially copyable elements that can be pre-faulted on request.
//
// Why pre-fault: the first write to each 4 KiB page of fresh memory traps into the kernel
// (about 12 us per page on the machines this library is tuned on, i.e. ~3 ms per 1 MiB). A
// kernel that streams through fresh memory measures the page-fault handler, not itself.
// Buffers that live across training steps should be allocated once and pre-faulted.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace stellatrain {

/// Bytes in a cache line on the targeted x86-64 and Arm servers.
inline constexpr std::size_t cache_line_bytes = 64;

/// Bytes in a transparent huge page on x86-64 Linux.
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// How an `aligned_buffer` allocates its memory.
struct buffer_options {
  /// Alignment of the first element in bytes: a power of two, at least `alignof(T)`.
  std::size_t alignment = cache_line_bytes;
  /// Touch every page at construction (by zero-filling the buffer), so that no later access
  /// pays a page fault. The zero fill is split across the executor given to the constructor.
  bool prefault = false;
  /// For buffers of at least 2 MiB: align to 2 MiB and ask Linux for transparent huge pages
  /// (`madvise(MADV_HUGEPAGE)`), which cuts the number of faults by 512x where the kernel
  /// grants them. Elsewhere, or when refused, the buffer simply uses small pages.
  bool huge_pages = true;
  /// Bytes between the aligned boundary and the first element: a multiple of `alignof(T)`,
  /// below 2 MiB. Arrays that one kernel streams through together should not all start at the
  /// same offset from a large power of two; see `tensor_registry`, which places an optimizer's
  /// arrays this way.
  std::size_t offset = 0;
};

namespace detail {

inline void advise_huge_pages([[maybe_unused]] void* p,
                              [[maybe_unused]] std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice only: a kernel without THP support returns EINVAL and the buffer works as is.
  (void)::madvise(p, bytes, MADV_HUGEPAGE);
#endif
}

}  // namespace detail

/// Writes zeros over `bytes`, splitting the work across `ex` in 2 MiB pieces, so that every
/// page is faulted in. Returns after all pieces are written.
template <executor Executor>
void prefault(std::span<std::byte> bytes, Executor& ex) {
  constexpr std::size_t piece = huge_page_bytes;
  const std::size_t pieces = (bytes.size() + piece - 1) / piece;
  ex.bulk(pieces, [&](std::size_t i) {
    const std::size_t begin = i * piece;
    const std::size_t end = std::min(bytes.size(), begin + piece);
    std::memset(bytes.data() + begin, 0, end - begin);
  });
}

/// A fixed-size array of `T` on aligned heap memory.
///
/// Unlike `std::vector`, it never initialises elements unless asked: with
/// `buffer_options::prefault` every byte is zero after construction; without it the contents
/// are unspecified and must be written before they are read. Move-only. Sizes are 64-bit.
///
/// \code
///   stellatrain::thread_pool pool{2};
///   stellatrain::aligned_buffer<float> grad(25'000'000, {.prefault = true}, pool);
///   std::span<float> g = grad.span();
/// \endcode
template <class T>
class aligned_buffer {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "aligned_buffer holds trivially copyable, trivially destructible elements");

 public:
  using value_type = T;
  using size_type = std::size_t;

  aligned_buffer() = default;

  /// Allocates `count` elements; pre-faults on the calling thread if `options.prefault`.
  explicit aligned_buffer(size_type count, buffer_options options = {}) {
    inline_executor ex;
    allocate(count, options, ex);
  }

  /// Allocates `count` elements; pre-faults across `ex` if `options.prefault`.
  template <executor Executor>
  aligned_buffer(size_type count, buffer_options options, Executor& ex) {
    allocate(count, options, ex);
  }

  aligned_buffer(aligned_buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        base_(std::exchange(other.base_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        alignment_(std::exchange(other.alignment_, 0)) {}

  aligned_buffer& operator=(aligned_buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      base_ = std::exchange(other.base_, nullptr);
      size_ = std::exchange(other.size_, 0);
      alignment_ = std::exchange(other.alignment_, 0);
    }
    return *this;
  }

  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;

  ~aligned_buffer() { release(); }

  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] const T* data() const noexcept { return data_; }
  [[nodiscard]] size_type size() const noexcept { return size_; }
  [[nodiscard]] size_type size_bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// The alignment the memory was allocated with (0 when empty); the first element sits
  /// `buffer_options::offset` bytes past such a boundary.
  [[nodiscard]] size_type alignment() const noexcept { return alignment_; }

  [[nodiscard]] std::span<T> span() noexcept { return {data_, size_}; }
  [[nodiscard]] std::span<const T> span() const noexcept { return {data_, size_}; }
  operator std::span<T>() noexcept { return span(); }  // NOLINT(google-explicit-constructor)
  operator std::span<const T>() const noexcept { return span(); }  // NOLINT

  T& operator[](size_type i) noexcept {
    STELLATRAIN_ASSERT(i < size_, "aligned_buffer index out of range");
    return data_[i];
  }
  const T& operator[](size_type i) const noexcept {
    STELLATRAIN_ASSERT(i < size_, "aligned_buffer index out of range");
    return data_[i];
  }

  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + size_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + size_; }

 private:
  template <class Executor>
  void allocate(size_type count, buffer_options options, Executor& ex) {
    if (count == 0) return;
    std::size_t alignment = std::max(options.alignment, alignof(T));
    if (!std::has_single_bit(alignment)) {
      throw_error(errc::invalid_argument, "aligned_buffer: alignment " +
                                              std::to_string(options.alignment) +
                                              " is not a power of two");
    }
    if (options.offset % alignof(T) != 0 || options.offset >= huge_page_bytes) {
      throw_error(errc::invalid_argument, "aligned_buffer: offset " +
                                              std::to_string(options.offset) +
                                              " is not a multiple of the element alignment " +
                                              std::to_string(alignof(T)) + " below 2 MiB");
    }
    if (count > (std::numeric_limits<size_type>::max() - 2 * huge_page_bytes) / sizeof(T)) {
      throw_error(errc::resource_exhausted,
                  "aligned_buffer: " + std::to_string(count) + " elements overflow size_t");
    }
    std::size_t bytes = count * sizeof(T) + options.offset;
    const bool huge = options.huge_pages && bytes >= huge_page_bytes;
    if (huge) {
      alignment = std::max(alignment, huge_page_bytes);
      bytes = (bytes + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
    }
    void* p = ::operator new (bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr) {
      throw_error(errc::resource_exhausted, "aligned_buffer: cannot allocate " +
                                                std::to_string(bytes) + " bytes aligned to " +
                                                std::to_string(alignment));
    }
    if (huge) detail::advise_huge_pages(p, bytes);
    base_ = p;
    data_ = reinterpret_cast<T*>(static_cast<std::byte*>(p) + options.offset);
    size_ = count;
    alignment_ = alignment;
    if (options.prefault) {
      try {
        prefault(std::span<std::byte>(static_cast<std::byte*>(p), bytes), ex);
      } catch (...) {
        release();
        throw;
      }
    }
  }

  void release() noexcept {
    if (base_ != nullptr) {
      ::operator delete (base_, std::align_val_t{alignment_});
      base_ = nullptr;
      data_ = nullptr;
      size_ = 0;
      alignment_ = 0;
    }
  }

  T* data_ = nullptr;
  void* base_ = nullptr;  // what was allocated: `data_` less the offset
  size_type size_ = 0;
  size_type alignment_ = 0;
};

}  // namespace stellatrain
