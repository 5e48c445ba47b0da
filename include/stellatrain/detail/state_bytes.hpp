// SPDX-License-Identifier: Apache-2.0
// Writing and reading saved state as bytes (host byte order, no alignment), with every read
// checked against the end of the input.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace stellatrain::detail {

/// Appends trivially copyable values and arrays to a byte vector.
class byte_writer {
 public:
  explicit byte_writer(std::vector<std::byte>& out) : out_(out) {}

  template <class T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }

  template <class T>
  void put_array(std::span<const T> v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size_bytes());
  }

 private:
  std::vector<std::byte>& out_;
};

/// Reads what `byte_writer` wrote; throws `errc::malformed_message` naming `what` and the
/// offset when the input ends early.
class byte_reader {
 public:
  byte_reader(std::span<const std::byte> in, const char* what) : in_(in), what_(what) {}

  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }

  template <class T>
  void get_array(std::span<T> out) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (out.empty()) return;
    std::memcpy(out.data(), take(out.size_bytes()), out.size_bytes());
  }

  [[nodiscard]] std::size_t offset() const noexcept { return pos_; }
  [[nodiscard]] std::size_t remaining() const noexcept { return in_.size() - pos_; }

 private:
  const std::byte* take(std::size_t bytes) {
    if (bytes > in_.size() - pos_) {
      throw_error(errc::malformed_message, std::string(what_) + ": input ends at byte " +
                                               std::to_string(in_.size()) + ", " + std::to_string(bytes) +
                                               " more bytes needed at offset " + std::to_string(pos_));
    }
    const std::byte* p = in_.data() + pos_;
    pos_ += bytes;
    return p;
  }

  std::span<const std::byte> in_;
  const char* what_;
  std::size_t pos_ = 0;
};

}  // namespace stellatrain::detail
