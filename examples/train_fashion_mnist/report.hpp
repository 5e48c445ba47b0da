// SPDX-License-Identifier: Apache-2.0
// What the trainer reports: a curve of accuracy and bytes against wall time per mode, the
// summary table, summary.json, curve.csv and a plot drawn by gnuplot.
#pragma once

#include "results.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace fashion_mnist {

inline std::string json_number(std::optional<double> v) {
  if (!v) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", *v);
  return buf;
}

/// `speedup[i]`: results[i]'s time to target against dense flat's (null where unknown).
inline void write_summary_json(const std::filesystem::path& path,
                               const std::vector<mode_result>& results, double target,
                               const std::vector<std::optional<double>>& speedup,
                               const std::string& settings) {
  std::ofstream out(path);
  out << "{\n  \"target_accuracy\": " << target << ",\n  \"settings\": " << settings
      << ",\n  \"modes\": {\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    out << "    \"" << r.mode << "\": {\"final_accuracy\": " << json_number(r.final_accuracy)
        << ", \"time_to_target_s\": " << json_number(r.time_to_target) << ", \"steps_to_target\": "
        << (r.steps_to_target ? std::to_string(*r.steps_to_target) : std::string("null"))
        << ", \"steps\": " << r.steps << ", \"bytes_sent_rank0\": " << r.bytes
        << ", \"wan_bytes_per_cluster\": " << r.wan_bytes_per_cluster
        << ", \"speedup_vs_dense\": " << json_number(speedup[i])
        << ", \"wall_s\": " << json_number(r.seconds) << "}" << (i + 1 < results.size() ? "," : "")
        << "\n";
  }
  out << "  }\n}\n";
}

inline void write_curve_csv(const std::filesystem::path& path,
                            const std::vector<mode_result>& results) {
  std::ofstream out(path);
  out << "mode,seconds,step,epoch,loss,accuracy,bytes,density\n";
  for (const auto& r : results) {
    for (const auto& p : r.curve) {
      out << r.mode << ',' << p.seconds << ',' << p.step << ',' << p.epoch << ',' << p.loss << ','
          << p.accuracy << ',' << p.bytes << ',' << p.density << '\n';
    }
  }
}

/// Draws accuracy and bytes against wall time with gnuplot (one data file per mode). Returns
/// false, with the reason in `why`, when gnuplot is missing or fails.
inline bool plot(const std::filesystem::path& dir, const std::vector<mode_result>& results,
                 double target, std::string& why) {
  for (const auto& r : results) {
    std::ofstream data(dir / ("curve_" + r.mode + ".dat"));
    for (const auto& p : r.curve)
      data << p.seconds << ' ' << p.accuracy * 100 << ' ' << static_cast<double>(p.bytes) / 1e6
           << '\n';
  }
  const auto script = dir / "plot.gp";
  {
    std::ofstream gp(script);
    gp << "set terminal pngcairo size 1100,450 font ',10'\n"
       << "set output '" << (dir / "curve.png").string() << "'\n"
       << "set multiplot layout 1,2\n"
       << "set xlabel 'wall time (s)'\nset ylabel 'test accuracy (%)'\nset grid\nset key bottom "
          "right\n"
       << "set logscale x\n"
       << "set arrow from graph 0, first " << target * 100 << " to graph 1, first " << target * 100
       << " nohead dashtype 2\n"
       << "plot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'" << (dir / ("curve_" + results[i].mode + ".dat")).string()
         << "' using 1:2 with linespoints title '" << results[i].mode << "'";
    }
    gp << "\nunset arrow\nset ylabel 'MB sent by rank 0'\nset logscale y\nset key top left\nplot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'" << (dir / ("curve_" + results[i].mode + ".dat")).string()
         << "' using 1:3 with lines title '" << results[i].mode << "'";
    }
    gp << "\nunset multiplot\n";
  }
  const std::string command = "gnuplot '" + script.string() + "' 2>&1";
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    why = "gnuplot not found (apt-get install gnuplot-nox)";
    return false;
  }
  if (std::system(command.c_str()) != 0) {
    why = "gnuplot failed on " + script.string();
    return false;
  }
  return true;
}

}  // namespace fashion_mnist
