// SPDX-License-Identifier: Apache-2.0
// What the translation units of stellatrain._native share: the threads a call runs on, raw
// buffers as spans, and the registration of each unit's bindings.
#pragma once

#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace stellatrain_python {

namespace py = pybind11;
namespace st = stellatrain;

// The threads one optimizer's steps run on: the caller alone, or a pool of `threads`.
class executor_handle {
 public:
  explicit executor_handle(std::size_t threads) {
    if (threads == 0) {
      throw py::value_error("stellatrain: threads must be at least 1, got 0");
    }
    if (threads > 1) pool_ = std::make_unique<st::thread_pool>(threads);
  }
  [[nodiscard]] std::size_t threads() const noexcept { return pool_ ? pool_->threads() : 1; }

  template <class F>
  void run(F&& f) {
    if (pool_) {
      f(*pool_);
    } else {
      st::inline_executor ex;
      f(ex);
    }
  }

 private:
  std::unique_ptr<st::thread_pool> pool_;
};

template <class T>
inline std::span<T> span_at(std::uintptr_t address, std::uint64_t elements) {
  if (address == 0 && elements != 0) throw py::value_error("stellatrain: null buffer address");
  return {reinterpret_cast<T*>(address), static_cast<std::size_t>(elements)};
}

/// Binds the compression classes (compression.cpp).
void bind_compression(py::module_& m);
/// Binds the density controller (density.cpp).
void bind_density(py::module_& m);

}  // namespace stellatrain_python
