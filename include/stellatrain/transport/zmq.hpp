// SPDX-License-Identifier: Apache-2.0
// The ZeroMQ backend: ranks on any hosts, peers from an explicit address list, TCP
// underneath; the WAN-friendly backend (the StellaTrain paper used ZeroMQ). Needs libzmq and
// cppzmq (CMake target stellatrain::zmq); not part of <stellatrain/stellatrain.hpp>. The entry
// point of the backend, whose parts are the headers of transport/zmq/.
// stellatrain-component: zmq
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/zmq/options.hpp>
#include <stellatrain/transport/zmq/peers.hpp>
#include <stellatrain/transport/zmq/request.hpp>
#include <stellatrain/transport/zmq/transport.hpp>
