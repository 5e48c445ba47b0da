// SPDX-License-Identifier: Apache-2.0
// The trainer's command line (CLI11): every option is checked, with its name in the message,
// before any data is read or any rank starts.
#pragma once

#include "settings.hpp"

#include <optional>

namespace fashion_mnist {

/// Parses and checks the command line into `s`. Returns the exit code when the program is done
/// (it printed --help, --dry-run's settings, or an error on stderr), nothing when it trains.
/// Also checks that --out can be written (creating the folder) and that --data is a folder.
std::optional<int> parse_options(int argc, char** argv, settings& s);

}  // namespace fashion_mnist
