// SPDX-License-Identifier: Apache-2.0
// Uses the zmq component: a one-rank world on a free loopback port sends itself a message.
#include <stellatrain/stellatrain.hpp>
#include <stellatrain/transport/zmq.hpp>

#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  stellatrain::zmq_transport t(0, {"tcp://127.0.0.1:*"});
  const std::vector<std::byte> out(100, std::byte{7});
  stellatrain::message_buffer in;
  auto r = t.irecv(0, 1, in);
  auto s = t.isend(0, 1, out);
  stellatrain::wait_or_throw(r, std::chrono::seconds(10), "message to itself");
  stellatrain::wait_or_throw(s, std::chrono::seconds(10), "send to itself");
  std::printf("zmq component: bound %s, %zu bytes to itself\n", t.endpoint().c_str(), in.size());
  return in.size() == 100 ? 0 : 1;
}
