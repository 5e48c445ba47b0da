// SPDX-License-Identifier: Apache-2.0
// Opt-in type erasure: `any_transport` holds any transport chosen at run time (for example
// from a command-line flag) behind one type. Costs a virtual call and a heap allocation per
// operation; code that knows its transport at compile time should use it directly.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/message_buffer.hpp>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace stellatrain {

namespace detail {

struct any_request_base {
  virtual ~any_request_base() = default;
  virtual bool test() = 0;
  virtual bool wait_until(transport_clock::time_point deadline) = 0;
};

template <class R>
struct any_request_model final : any_request_base {
  explicit any_request_model(R&& r) : request(std::move(r)) {}
  bool test() override { return request.test(); }
  bool wait_until(transport_clock::time_point d) override { return request.wait_until(d); }
  R request;
};

}  // namespace detail

/// A type-erased `transport_request` (what `any_transport` returns).
class any_request {
 public:
  any_request() = default;
  // The same-type test comes first: it short-circuits the concept check that would
  // otherwise ask whether any_request is constructible from itself, recursively.
  template <class R>
  requires(!std::is_same_v<std::remove_cvref_t<R>, any_request> &&
           transport_request<std::remove_cvref_t<R>>) explicit any_request(R&& r)
      : impl_(std::make_unique<detail::any_request_model<std::remove_cvref_t<R>>>(std::move(r))) {}

  bool test() { return impl_ == nullptr || impl_->test(); }
  bool wait_until(transport_clock::time_point d) {
    return impl_ == nullptr || impl_->wait_until(d);
  }

 private:
  std::unique_ptr<detail::any_request_base> impl_;
};

static_assert(transport_request<any_request>);

namespace detail {

struct any_transport_base {
  virtual ~any_transport_base() = default;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  virtual any_request isend(int, tag_type, std::span<const std::byte>) = 0;
  virtual any_request irecv(int, tag_type, std::span<std::byte>) = 0;
  virtual any_request irecv(int, tag_type, message_buffer&) = 0;
  virtual void abort(std::string_view) noexcept = 0;
  virtual std::size_t preferred_chunk_bytes() const noexcept = 0;
};

template <class T>
struct any_transport_model final : any_transport_base {
  template <class U>
  explicit any_transport_model(U&& u) : t(std::forward<U>(u)) {}

  // `t` is a transport or a std::reference_wrapper of one.
  decltype(auto) get() noexcept {
    if constexpr (requires { t.get(); }) {
      return t.get();
    } else {
      return (t);
    }
  }
  decltype(auto) get() const noexcept {
    if constexpr (requires { t.get(); }) {
      return t.get();
    } else {
      return (t);
    }
  }

  int rank() const noexcept override { return get().rank(); }
  int size() const noexcept override { return get().size(); }
  any_request isend(int p, tag_type tag, std::span<const std::byte> b) override {
    return any_request(get().isend(p, tag, b));
  }
  any_request irecv(int p, tag_type tag, std::span<std::byte> b) override {
    return any_request(get().irecv(p, tag, b));
  }
  any_request irecv(int p, tag_type tag, message_buffer& m) override {
    using inner = std::remove_cvref_t<decltype(get())>;
    if constexpr (message_transport<inner>) {
      return any_request(get().irecv(p, tag, m));
    } else {
      throw_error(errc::unsupported,
                  "any_transport: the held transport has no receive of unknown length");
    }
  }
  void abort(std::string_view reason) noexcept override { abort_transport(get(), reason); }
  std::size_t preferred_chunk_bytes() const noexcept override {
    return chunk_bytes_for(get(), auto_chunk_bytes);
  }

  T t;
};

template <class T>
struct unwrap_transport {
  using type = T;
};
template <class T>
struct unwrap_transport<std::reference_wrapper<T>> {
  using type = T;
};

}  // namespace detail

/// Any transport behind one type; models `message_transport` (a variable-length receive on
/// a held transport that lacks it throws `errc::unsupported`).
///
/// Holds the transport by value (moved in), or by reference when given
/// `std::ref(transport)`. Native collectives of the held transport are not used through it.
///
/// \code
///   stellatrain::any_transport t = use_mpi ?
///   stellatrain::any_transport(stellatrain::mpi_transport{})
///                                          : stellatrain::any_transport(std::move(in_process));
///   stellatrain::barrier(t);
/// \endcode
class any_transport {
 public:
  using request_type = any_request;

  template <class T>
  requires(!std::is_same_v<std::remove_cvref_t<T>, any_transport> &&
           transport<typename detail::unwrap_transport<
               std::remove_cvref_t<T>>::type>) explicit any_transport(T&& t)
      : impl_(std::make_unique<detail::any_transport_model<std::remove_cvref_t<T>>>(
            std::forward<T>(t))) {}

  any_transport(any_transport&&) noexcept = default;
  any_transport& operator=(any_transport&&) noexcept = default;

  [[nodiscard]] int rank() const noexcept { return impl_->rank(); }
  [[nodiscard]] int size() const noexcept { return impl_->size(); }
  any_request isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    return impl_->isend(dest, tag, bytes);
  }
  any_request irecv(int source, tag_type tag, std::span<std::byte> into) {
    return impl_->irecv(source, tag, into);
  }
  any_request irecv(int source, tag_type tag, message_buffer& into) {
    return impl_->irecv(source, tag, into);
  }
  void abort(std::string_view reason) noexcept { impl_->abort(reason); }
  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept {
    return impl_->preferred_chunk_bytes();
  }

 private:
  std::unique_ptr<detail::any_transport_base> impl_;
};

static_assert(message_transport<any_transport>);

}  // namespace stellatrain
