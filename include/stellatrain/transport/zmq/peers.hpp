// SPDX-License-Identifier: Apache-2.0
// How ZeroMQ ranks find each other: a socket bound in advance (`zmq_listener`) and the peer
// list from the environment (`zmq_peer_list`).
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <zmq.hpp>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace stellatrain {

class zmq_transport;

/// A ZeroMQ socket bound before the transport exists, so that its address (for example a
/// port the system chose: "tcp://127.0.0.1:*") can be told to the other ranks first.
///
/// \code
///   stellatrain::zmq_listener l("tcp://127.0.0.1:*");
///   publish(rank, l.endpoint());                      // e.g. "tcp://127.0.0.1:40123"
///   stellatrain::zmq_transport t(std::move(l), rank, gather_all_endpoints());
/// \endcode
class zmq_listener {
 public:
  explicit zmq_listener(const std::string& bind_endpoint)
      : context_(std::make_unique<zmq::context_t>(1)) {
    try {
      router_.emplace(*context_, zmq::socket_type::router);
      router_->set(zmq::sockopt::rcvhwm, 0);
      router_->set(zmq::sockopt::linger, 0);
      router_->bind(bind_endpoint);
      endpoint_ = router_->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      throw error(errc::io_error, "zmq_listener: cannot bind " + bind_endpoint + ": " + e.what());
    }
  }

  /// The address peers connect to (the port resolved when it was given as `*` or 0).
  [[nodiscard]] const std::string& endpoint() const noexcept { return endpoint_; }

 private:
  friend class zmq_transport;
  std::unique_ptr<zmq::context_t> context_;
  std::optional<zmq::socket_t> router_;
  std::string endpoint_;
};

/// The rank and peer list of this process, from the environment:
/// `STELLATRAIN_RANK` (0-based) and either `STELLATRAIN_ZMQ_PEERS` (endpoints separated by
/// commas or white space, in rank order: "tcp://10.0.0.1:5555,tcp://10.0.0.2:5555") or
/// `STELLATRAIN_ZMQ_PEERS_FILE` (one endpoint per line; blank lines and `#` comments are
/// skipped). Throws `errc::invalid_argument` naming the variable when something is missing
/// or malformed.
struct zmq_peer_list {
  int rank = 0;
  std::vector<std::string> endpoints;

  [[nodiscard]] static zmq_peer_list from_environment() {
    zmq_peer_list out;
    const char* rank = std::getenv("STELLATRAIN_RANK");
    if (rank == nullptr)
      throw_error(errc::invalid_argument, "zmq_peer_list: STELLATRAIN_RANK is not set");
    char* end = nullptr;
    const long r = std::strtol(rank, &end, 10);
    if (end == rank || *end != '\0' || r < 0 || r > 1'000'000) {
      throw_error(errc::invalid_argument,
                  std::string("zmq_peer_list: STELLATRAIN_RANK='") + rank + "' is not a rank");
    }
    out.rank = static_cast<int>(r);
    std::string text;
    std::string source;
    if (const char* list = std::getenv("STELLATRAIN_ZMQ_PEERS"); list != nullptr) {
      text = list;
      source = "STELLATRAIN_ZMQ_PEERS";
    } else if (const char* file = std::getenv("STELLATRAIN_ZMQ_PEERS_FILE"); file != nullptr) {
      std::ifstream in(file);
      if (!in)
        throw_error(errc::io_error,
                    std::string("zmq_peer_list: cannot read STELLATRAIN_ZMQ_PEERS_FILE=") + file);
      std::string line;
      while (std::getline(in, line)) {
        const auto hash = line.find('#');
        if (hash != std::string::npos) line.resize(hash);
        text += line + "\n";
      }
      source = std::string("STELLATRAIN_ZMQ_PEERS_FILE=") + file;
    } else {
      throw_error(errc::invalid_argument,
                  "zmq_peer_list: set STELLATRAIN_ZMQ_PEERS or STELLATRAIN_ZMQ_PEERS_FILE");
    }
    for (char& c : text) {
      if (c == ',' || c == '\n' || c == '\t' || c == '\r') c = ' ';
    }
    std::istringstream words(text);
    std::string w;
    while (words >> w) out.endpoints.push_back(w);
    if (out.endpoints.empty())
      throw_error(errc::invalid_argument, "zmq_peer_list: " + source + " lists no endpoint");
    if (out.rank >= static_cast<int>(out.endpoints.size())) {
      throw_error(errc::invalid_argument,
                  "zmq_peer_list: STELLATRAIN_RANK=" + std::to_string(out.rank) + " but " + source +
                      " lists " + std::to_string(out.endpoints.size()) + " endpoints");
    }
    return out;
  }
};

}  // namespace stellatrain
