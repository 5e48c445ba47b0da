// SPDX-License-Identifier: Apache-2.0
// The options of the ZeroMQ backend (`zmq_options`).
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace stellatrain {

/// Options of `zmq_transport`. All ranks should use the same values.
struct zmq_options {
  /// How long the constructor waits for every peer to connect and greet.
  std::chrono::milliseconds connect_timeout{30'000};
  /// ZeroMQ heartbeats on every connection: a peer silent for `heartbeat_timeout` (crashed
  /// host, frozen process, cut network) is disconnected, and the transport fails.
  std::chrono::milliseconds heartbeat_interval{1'000};
  std::chrono::milliseconds heartbeat_timeout{5'000};
  /// A peer that disconnects without having said goodbye fails the transport once this much
  /// time has passed without its goodbye arriving (the goodbye and the disconnect travel on
  /// different connections, so a clean close may be seen as a disconnect first).
  std::chrono::milliseconds close_grace{500};
  /// At destruction, how long queued messages may still take to leave.
  std::chrono::milliseconds linger{5'000};
  /// Also protect every payload with a CRC32C (headers always have one).
  bool payload_checksum = false;
  /// Frames announcing more bytes are refused (and ZeroMQ drops such connections).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// Where this rank binds; empty = its own entry of the peer list.
  std::string bind_endpoint{};
};

}  // namespace stellatrain
