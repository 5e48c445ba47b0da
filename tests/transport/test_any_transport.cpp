// SPDX-License-Identifier: Apache-2.0
// any_transport: a run-time choice of transport behind one type.
#include "catch.hpp"
#include "scenarios.hpp"

#include <stellatrain/stellatrain.hpp>

#include <functional>
#include <vector>

using namespace stellatrain;

TEST_CASE("any_transport holds transports by value or by reference", "[transport][any_transport]") {
  run_in_process(3, [](in_process_transport& raw) {
    const bool by_value = raw.rank() != 1;  // mixed on purpose: both work together
    in_process_transport* keep = &raw;
    any_transport t = by_value ? any_transport(std::move(raw)) : any_transport(std::ref(*keep));
    CHECK(t.size() == 3);
    test::p2p_case(t, 1, 20);
    test::allgather_case(
        t, [](int r) { return static_cast<std::size_t>(5000 * r); }, {.chunk_bytes = 1000}, 2);
    test::allreduce_case<double>(t, 999, {}, 3);
    test::broadcast_case(t, 0, 12345, {}, 4);
    barrier(t);
  });
}

TEST_CASE("any_transport over decorators, and without variable-length receives",
          "[transport][any_transport]") {
  run_in_process(2, [](in_process_transport& raw) {
    any_transport t(metered_transport(shaped_transport(std::move(raw), {.bits_per_second = 0})));
    test::allgather_case(
        t, [](int r) { return static_cast<std::size_t>(100 + r); }, {}, 1);
  });
  struct fixed_only {
    using request_type = in_process_request;
    in_process_transport& t;
    int rank() const noexcept { return t.rank(); }
    int size() const noexcept { return t.size(); }
    request_type isend(int p, tag_type g, std::span<const std::byte> b) { return t.isend(p, g, b); }
    request_type irecv(int p, tag_type g, std::span<std::byte> b) { return t.irecv(p, g, b); }
  };
  in_process_world world(1);
  auto raw = world.transport(0);
  any_transport t{fixed_only{raw}};
  message_buffer m;
  try {
    (void)t.irecv(0, 1, m);
    FAIL("no error");
  } catch (const error& e) {
    CHECK(e.code() == errc::unsupported);
  }
  any_request empty;
  CHECK(empty.test());
  t.abort("done");  // the held transport has no abort: nothing happens
  CHECK_FALSE(world.failed());
}
