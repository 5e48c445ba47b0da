// SPDX-License-Identifier: Apache-2.0
// The in-process backend: P ranks as threads of one process, each message copied once,
// straight from the sender's buffer into the receiver's. The default for tests and demos.
// The entry point of the backend, whose parts are the transport (in_process_transport.hpp),
// the world (in_process_world.hpp) and the runners (run_in_process.hpp).
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/transport/in_process_transport.hpp>
#include <stellatrain/transport/in_process_world.hpp>
#include <stellatrain/transport/run_in_process.hpp>
