// SPDX-License-Identifier: Apache-2.0
// The transport concept: the minimal conforming example of concept.hpp, complete, passes the
// collectives at P = 1; archetypes that miss one requirement are rejected.
#include "catch.hpp"
#include "scenarios.hpp"

#include <stellatrain/stellatrain.hpp>

#include <algorithm>
#include <deque>
#include <vector>

namespace {

using namespace stellatrain;

// One rank that talks only to itself; messages match on tag in order (the concept's rule).
struct loopback {
  struct request_type {
    bool test() { return true; }
    bool wait_until(transport_clock::time_point) { return true; }
  };
  struct message {
    tag_type tag;
    std::vector<std::byte> bytes;
  };
  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int size() const noexcept { return 1; }
  request_type isend(int, tag_type tag, std::span<const std::byte> b) {
    queue.push_back({tag, {b.begin(), b.end()}});
    return {};
  }
  request_type irecv(int, tag_type tag, std::span<std::byte> b) {
    const auto it =
        std::find_if(queue.begin(), queue.end(), [&](const message& m) { return m.tag == tag; });
    if (it == queue.end()) throw error(errc::unsupported, "loopback: receive before send");
    if (it->bytes.size() != b.size()) throw error(errc::size_mismatch, "loopback: wrong size");
    std::copy(it->bytes.begin(), it->bytes.end(), b.begin());
    queue.erase(it);
    return {};
  }
  std::deque<message> queue;
};

struct request_without_wait {
  bool test() { return true; }
};
struct no_request_type {
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
};
struct rank_not_noexcept : loopback {
  int rank() const { return 0; }
};
struct bad_request : loopback {
  using request_type = request_without_wait;
  request_type isend(int, tag_type, std::span<const std::byte>) { return {}; }
  request_type irecv(int, tag_type, std::span<std::byte>) { return {}; }
};
struct no_irecv {
  using request_type = loopback::request_type;
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  request_type isend(int, tag_type, std::span<const std::byte>) { return {}; }
};

}  // namespace

TEST_CASE("transport concept accepts conforming types and rejects archetypes",
          "[transport][concept]") {
  STATIC_REQUIRE(transport<loopback>);
  STATIC_REQUIRE_FALSE(message_transport<loopback>);
  STATIC_REQUIRE(transport_request<loopback::request_type>);
  STATIC_REQUIRE_FALSE(transport_request<request_without_wait>);
  STATIC_REQUIRE_FALSE(transport<no_request_type>);
  STATIC_REQUIRE_FALSE(transport<rank_not_noexcept>);
  STATIC_REQUIRE_FALSE(transport<bad_request>);
  STATIC_REQUIRE_FALSE(transport<no_irecv>);
  STATIC_REQUIRE(message_transport<in_process_transport>);
  STATIC_REQUIRE(message_transport<any_transport>);
  STATIC_REQUIRE(message_transport<shaped_transport<in_process_transport>>);
  STATIC_REQUIRE(message_transport<metered_transport<in_process_transport>>);
  STATIC_REQUIRE(transport<metered_transport<loopback>>);
  STATIC_REQUIRE_FALSE(message_transport<metered_transport<loopback>>);
}

TEST_CASE("the minimal example transport runs the collectives at P = 1", "[transport][concept]") {
  loopback t;
  const auto mine = test::message_of(0, 100, 1);
  std::vector<message_buffer> out(1);
  sparse_allgather(t, mine, out);
  test::expect_message(out[0].span(), 0, 100, 1, "loopback allgather");
  std::vector<float> v{1.0f, 2.0f};
  dense_allreduce(t, std::span<float>(v));
  CHECK(v == std::vector<float>{1.0f, 2.0f});
  barrier(t);
  message_buffer m;
  broadcast(t, 0, m);
  CHECK(m.empty());
  // Its send/receive work as the concept describes.
  const auto a = test::message_of(0, 10, 2);
  std::vector<std::byte> b(10);
  t.isend(0, 3, a);
  t.irecv(0, 3, std::span<std::byte>(b));
  CHECK(b == a);
  std::vector<std::byte> wrong(9);
  t.isend(0, 3, a);
  CHECK_THROWS_AS(t.irecv(0, 3, std::span<std::byte>(wrong)), error);
}

TEST_CASE("deadline_after saturates and wait_or_throw reports timeouts", "[transport][concept]") {
  CHECK(deadline_after(std::chrono::hours::max()) == transport_clock::time_point::max());
  const auto d = deadline_after(std::chrono::milliseconds(5));
  CHECK(d > transport_clock::now() - std::chrono::seconds(1));
  in_process_world world(1);
  auto t = world.transport(0);
  std::vector<std::byte> b(4);
  auto r = t.irecv(0, 1, std::span<std::byte>(b));
  try {
    wait_or_throw(r, std::chrono::milliseconds(20), "a message that never comes");
    FAIL("no timeout");
  } catch (const error& e) {
    CHECK(e.code() == errc::timeout);
    CHECK(std::string(e.what()).find("never comes") != std::string::npos);
  }
}

TEST_CASE("chunk_bytes_for: explicit sizes, the transport's preference, the default",
          "[transport][concept]") {
  struct prefers_small : loopback {
    std::size_t preferred_chunk_bytes() const noexcept { return 1000; }
  };
  loopback plain;
  prefers_small small;
  CHECK(chunk_bytes_for(plain, 4096) == 4096);
  CHECK(chunk_bytes_for(plain, 0) == 0);
  CHECK(chunk_bytes_for(plain, auto_chunk_bytes) == (std::size_t{256} << 10));
  CHECK(chunk_bytes_for(small, auto_chunk_bytes) == 1000);
  CHECK(chunk_bytes_for(small, 77) == 77);
  // Decorators and type erasure pass the preference through.
  metered_transport<prefers_small> metered{prefers_small{}};
  CHECK(chunk_bytes_for(metered, auto_chunk_bytes) == 1000);
  any_transport erased{prefers_small{}};
  CHECK(erased.preferred_chunk_bytes() == 1000);
  in_process_world world(1);
  shaped_transport shaped(world.transport(0), {});
  CHECK(chunk_bytes_for(shaped, auto_chunk_bytes) == (std::size_t{256} << 10));
}
