// SPDX-License-Identifier: Apache-2.0
// The shape the requests of the backends and decorators share: move-only ownership of one
// operation's handle, cancelled when the request is dropped or overwritten, and an empty
// handle that counts as complete.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/concept.hpp>

#include <utility>

namespace stellatrain {

namespace detail {

// A template over the handle rather than a virtual base: test() stays one inline call, as
// it was when every request spelled this shape out itself.
//
// Handle: default construction gives the empty handle; moves are noexcept. Members:
//   bool empty() const noexcept  nothing left to ask: the request counts as complete (a
//                                handle whose inner request keeps the answer says false)
//   bool test(), bool wait_until(transport_clock::time_point)   called when not empty
//   void cancel() noexcept       called when not empty, before the handle is dropped or
//                                overwritten; the handle is not used again afterwards
template <class Handle>
class request_base {
 public:
  request_base(const request_base&) = delete;
  request_base& operator=(const request_base&) = delete;

  bool test() { return handle_.empty() || handle_.test(); }

  bool wait_until(transport_clock::time_point deadline) {
    return handle_.empty() || handle_.wait_until(deadline);
  }

 protected:
  request_base() = default;
  explicit request_base(Handle handle) noexcept : handle_(std::move(handle)) {}
  request_base(request_base&& other) noexcept : handle_(std::exchange(other.handle_, Handle{})) {}
  request_base& operator=(request_base&& other) noexcept {
    if (this != &other) {
      cancel();
      handle_ = std::exchange(other.handle_, Handle{});
    }
    return *this;
  }
  ~request_base() { cancel(); }

  Handle handle_{};

 private:
  void cancel() noexcept {
    if (!handle_.empty()) handle_.cancel();
  }
};

}  // namespace detail

}  // namespace stellatrain
