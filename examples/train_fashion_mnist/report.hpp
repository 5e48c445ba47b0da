// SPDX-License-Identifier: Apache-2.0
// What the trainer reports on rank 0: the summary table, summary.json (the results, the
// options and the run: seed, data, library version, CPU, ISA, time), curve.csv and a plot
// drawn by gnuplot.
#pragma once

#include "results.hpp"
#include "settings.hpp"

#include <stellatrain/transport/cluster_topology.hpp>

#include <string>
#include <vector>

namespace fashion_mnist {

/// The options as JSON text, indented (what summary.json records under "options").
std::string options_json(const settings& s);

/// Prints the table of `results` and writes summary.json, curve.csv and curve.png into s.out.
void report(const settings& s, const std::vector<mode_result>& results,
            const stellatrain::cluster_topology& topology);

}  // namespace fashion_mnist
