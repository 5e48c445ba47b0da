// SPDX-License-Identifier: Apache-2.0
// The request base every backend's and decorator's request is built on: an empty request is
// complete, a pending one is cancelled exactly once (dropped, or overwritten by a move), a
// moved-from one is empty, and the backends' requests model `transport_request` through it.
#include "catch.hpp"

#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/detail/request_base.hpp>

#include <type_traits>
#include <utility>

namespace {

using namespace stellatrain;

// What a test handle was asked, shared by the handles of one test.
struct journal {
  int tests = 0;
  int waits = 0;
  int cancels = 0;
};

struct counting_handle {
  journal* log = nullptr;
  bool finished = false;  // the next test() completes

  [[nodiscard]] bool empty() const noexcept { return log == nullptr; }
  bool test() {
    ++log->tests;
    if (!finished) return false;
    log = nullptr;
    return true;
  }
  bool wait_until(transport_clock::time_point) {
    ++log->waits;
    return false;
  }
  void cancel() noexcept { ++log->cancels; }
};

class counting_request : public detail::request_base<counting_handle> {
 public:
  counting_request() = default;
  explicit counting_request(journal& j, bool finished = false)
      : request_base(counting_handle{&j, finished}) {}
};

}  // namespace

TEST_CASE("request base: an empty request is complete and never reaches its handle",
          "[transport][request_base]") {
  STATIC_REQUIRE(transport_request<counting_request>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<counting_request>);
  STATIC_REQUIRE_FALSE(std::is_copy_assignable_v<counting_request>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<counting_request>);
  STATIC_REQUIRE(std::is_nothrow_move_assignable_v<counting_request>);
  counting_request r;
  REQUIRE(r.test());
  REQUIRE(r.wait_until(transport_clock::now()));
}

TEST_CASE("request base: test and wait go to the handle until it completes",
          "[transport][request_base]") {
  journal j;
  {
    counting_request r(j, true);
    REQUIRE_FALSE(r.wait_until(transport_clock::now()));
    REQUIRE(r.test());
    REQUIRE(r.test());  // complete from then on, without asking the handle again
  }
  REQUIRE(j.waits == 1);
  REQUIRE(j.tests == 1);
  REQUIRE(j.cancels == 0);  // a completed request has nothing to cancel
}

TEST_CASE("request base: a pending request is cancelled once, wherever it moved",
          "[transport][request_base]") {
  journal j;
  {
    counting_request a(j);
    REQUIRE_FALSE(a.test());
    counting_request b(std::move(a));
    REQUIRE(a.test());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
    REQUIRE(j.tests == 1);
    REQUIRE(j.cancels == 0);
  }
  REQUIRE(j.cancels == 1);
}

TEST_CASE("request base: a move onto a pending request cancels the overwritten one",
          "[transport][request_base]") {
  journal first;
  journal second;
  {
    counting_request a(first);
    counting_request b(second);
    a = std::move(b);
    REQUIRE(first.cancels == 1);
    REQUIRE(second.cancels == 0);
    REQUIRE(b.test());  // NOLINT(bugprone-use-after-move)
    REQUIRE_FALSE(a.test());
    REQUIRE(second.tests == 1);
    auto& self = a;
    a = std::move(self);  // a self-move keeps the operation
    REQUIRE(second.cancels == 0);
  }
  REQUIRE(first.cancels == 1);
  REQUIRE(second.cancels == 1);
}

TEST_CASE("request base: the backends' and decorators' requests are built on it",
          "[transport][request_base]") {
  using in_process_base = detail::request_base<detail::inproc_handle>;
  STATIC_REQUIRE(std::is_base_of_v<in_process_base, in_process_request>);
  STATIC_REQUIRE(
      std::is_base_of_v<detail::request_base<detail::shaped_handle<in_process_transport>>,
                        shaped_request<in_process_transport>>);
  STATIC_REQUIRE(
      std::is_base_of_v<detail::request_base<detail::metered_handle<in_process_transport>>,
                        metered_request<in_process_transport>>);
  // No virtual call per test(): the request is its handle, nothing more.
  STATIC_REQUIRE_FALSE(std::is_polymorphic_v<in_process_request>);
  STATIC_REQUIRE(sizeof(in_process_request) == sizeof(detail::inproc_handle));
}
