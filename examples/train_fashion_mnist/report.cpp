// SPDX-License-Identifier: Apache-2.0
#include "report.hpp"

#include <stellatrain/version.hpp>

#include <nlohmann/json.hpp>

#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

extern char** environ;

namespace fashion_mnist {
namespace {

// Keys in the order written, so that summary.json reads top-down.
using json = nlohmann::ordered_json;

// A float option as the decimal it was given as (0.001, not 0.0010000000474974513).
double decimal(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.7g", static_cast<double>(v));
  return std::strtod(buf, nullptr);
}

json optional_number(std::optional<double> v) {
  if (!v || !std::isfinite(*v)) return nullptr;
  return *v;
}

json slow_ranks_of(const settings& s) {
  json out = json::array();
  for (const auto& [rank, factor] : s.slow_ranks)
    out.push_back({{"rank", rank}, {"factor", factor}});
  return out;
}

json options_of(const settings& s) {
  return {{"transport", s.transport},
          {"allgather", s.allgather},
          {"ranks", s.ranks},
          {"clusters", s.clusters},
          {"bandwidth_mbps", s.bandwidth_mbps},
          {"lan_mbps", s.lan_mbps},
          {"rtt_ms", s.rtt_ms},
          {"min_density", s.min_density},
          {"max_density", s.max_density},
          {"epochs", s.epochs},
          {"target", s.target},
          {"modes", s.modes},
          {"batch", s.batch},
          {"hidden", s.hidden},
          {"lr", decimal(s.lr)},
          {"sparse_lr", decimal(s.sparse_lr)},
          {"lr_end", decimal(s.lr_end)},
          {"decay_steps", s.decay_steps},
          {"staleness", s.staleness},
          {"local_steps", s.local_steps},
          {"local_topk", s.local_topk},
          {"local_bits", s.local_bits},
          {"diloco_steps", s.diloco_steps},
          {"stop_at_target", s.stop_at_target},
          {"split", s.split},
          {"split_interval", s.split_interval},
          {"slow_ranks", slow_ranks_of(s)},
          {"device_rate", s.device_rate},
          {"bandwidth_schedule", s.bandwidth_schedule},
          {"eval_every", s.eval_every},
          {"eval_samples", s.eval_samples},
          {"seed", s.seed},
          {"data", s.data},
          {"out", s.out}};
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

// The instruction sets this binary was compiled for, and those the CPU has.
json isa() {
  json built = json::array();
#if defined(__AVX512F__)
  built.push_back("avx512f");
#endif
#if defined(__AVX2__)
  built.push_back("avx2");
#endif
#if defined(__FMA__)
  built.push_back("fma");
#endif
#if defined(__F16C__)
  built.push_back("f16c");
#endif
#if defined(__SSE4_2__)
  built.push_back("sse4.2");
#endif
#if defined(__SSE2__)
  built.push_back("sse2");
#endif
#if defined(__ARM_NEON)
  built.push_back("neon");
#endif
  json cpu = json::array();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) cpu.push_back("avx512f");
  if (__builtin_cpu_supports("avx2")) cpu.push_back("avx2");
  if (__builtin_cpu_supports("fma")) cpu.push_back("fma");
  if (__builtin_cpu_supports("sse4.2")) cpu.push_back("sse4.2");
#endif
  return {{"compiled_for", built}, {"cpu_has", cpu}};
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Per curve point: progress and the configuration in force (summary.json's "curve").
json curve_of(const mode_result& r) {
  json points = json::array();
  for (const auto& p : r.curve) {
    points.push_back({{"seconds", p.seconds},
                      {"step", p.step},
                      {"accuracy", p.accuracy},
                      {"loss", p.loss},
                      {"bytes", p.bytes},
                      {"wan_bytes_per_cluster", p.wan_bytes},
                      {"density", p.density},
                      {"step_seconds", p.step_seconds},
                      {"bandwidth_estimate_mbps", p.bandwidth_mbps},
                      {"link_mbps", p.link_mbps},
                      {"batches", p.split},
                      {"compute_seconds", p.compute}});
  }
  return points;
}

// Per step: its end on the training clock and the configuration (summary.json's "timeline").
json timeline_of(const mode_result& r) {
  json points = json::array();
  for (const auto& p : r.timeline) {
    points.push_back({{"step", p.step},
                      {"seconds", p.seconds},
                      {"density", p.density},
                      {"bandwidth_estimate_mbps", p.bandwidth_mbps},
                      {"latency_estimate_ms", p.latency_ms},
                      {"link_mbps", p.link_mbps}});
  }
  return points;
}

// The bytes that had left each cluster when the mode first reached its target (the clusters'
// mean), or none.
std::optional<double> wan_bytes_to_target(const mode_result& r) {
  if (!r.steps_to_target) return std::nullopt;
  for (const auto& p : r.curve)
    if (p.step == *r.steps_to_target) return static_cast<double>(p.wan_bytes);
  return std::nullopt;
}

// Bits over each cluster's uplink per parameter and training step (inner step for the
// local-step modes), over the whole run.
double wan_bits_per_parameter_and_step(const mode_result& r) {
  if (r.parameters == 0 || r.steps == 0) return 0;
  return static_cast<double>(r.wan_bytes_per_cluster) * 8 /
         (static_cast<double>(r.parameters) * static_cast<double>(r.steps));
}

void write_summary_json(const std::filesystem::path& path, const settings& s,
                        const std::vector<mode_result>& results,
                        const std::vector<std::optional<double>>& speedup,
                        const stellatrain::cluster_topology& topology) {
  json modes = json::object();
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    modes[r.mode] = {
        {"final_accuracy", r.final_accuracy},
        {"time_to_target_s", optional_number(r.time_to_target)},
        {"steps_to_target", r.steps_to_target ? json(*r.steps_to_target) : json(nullptr)},
        {"steps", r.steps},
        {"bytes_sent_rank0", r.bytes},
        {"wan_bytes_per_cluster", r.wan_bytes_per_cluster},
        {"wan_bytes_per_cluster_to_target", optional_number(wan_bytes_to_target(r))},
        {"wan_bits_per_parameter_and_step", wan_bits_per_parameter_and_step(r)},
        {"parameters", r.parameters},
        {"speedup_vs_dense", optional_number(speedup[i])},
        {"wall_s", r.seconds},
        {"split_changes", r.split_changes},
        {"curve", curve_of(r)},
        {"timeline", timeline_of(r)}};
  }
  const json summary = {{"target_accuracy", s.target},
                        {"run",
                         {{"timestamp_utc", utc_now()},
                          {"stellatrain_version", stellatrain::version_string},
                          {"seed", s.seed},
                          {"data", s.data},
                          {"cpu", cpu_model()},
                          {"isa", isa()},
                          {"ranks", topology.ranks()},
                          {"clusters", topology.to_string()},
                          {"command_line", s.command_line}}},
                        {"options", options_of(s)},
                        {"modes", modes}};
  std::ofstream(path) << summary.dump(2) << '\n';
}

void write_curve_csv(const std::filesystem::path& path, const std::vector<mode_result>& results) {
  std::ofstream out(path);
  // batches and compute_seconds list the ranks in order, separated by ';'.
  out << "mode,seconds,step,epoch,loss,accuracy,bytes,wan_bytes_per_cluster,density,step_seconds,"
         "bandwidth_estimate_mbps,link_mbps,batches,compute_seconds\n";
  for (const auto& r : results) {
    for (const auto& p : r.curve) {
      out << r.mode << ',' << p.seconds << ',' << p.step << ',' << p.epoch << ',' << p.loss << ','
          << p.accuracy << ',' << p.bytes << ',' << p.wan_bytes << ',' << p.density << ','
          << p.step_seconds << ',' << p.bandwidth_mbps << ',' << p.link_mbps << ',';
      for (std::size_t i = 0; i < p.split.size(); ++i) out << (i ? ";" : "") << p.split[i];
      out << ',';
      for (std::size_t i = 0; i < p.compute.size(); ++i) out << (i ? ";" : "") << p.compute[i];
      out << '\n';
    }
  }
}

// Runs `gnuplot plot.gp` inside `dir`: the script names its files relative to the folder, so
// no path is ever quoted, for gnuplot or for a shell.
bool run_gnuplot(const std::filesystem::path& dir, std::string& why) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addchdir_np(&actions, dir.c_str());
  char program[] = "gnuplot";
  char script[] = "plot.gp";
  char* argv[] = {program, script, nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, program, &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    why = "gnuplot not found (apt-get install gnuplot-nox)";
    return false;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      why = "lost gnuplot";
      return false;
    }
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    why = WIFEXITED(status) && WEXITSTATUS(status) == 127
              ? "gnuplot not found (apt-get install gnuplot-nox)"
              : "gnuplot failed on " + (dir / "plot.gp").string();
    return false;
  }
  return true;
}

// Accuracy and bytes against wall time (one data file per mode, named after the mode).
bool plot(const std::filesystem::path& dir, const std::vector<mode_result>& results, double target,
          std::string& why) {
  for (const auto& r : results) {
    std::ofstream data(dir / ("curve_" + r.mode + ".dat"));
    for (const auto& p : r.curve) {
      // The full test set's point has no step time: NaN leaves it out of the step-time panel.
      data << p.seconds << ' ' << p.accuracy * 100 << ' ' << static_cast<double>(p.bytes) / 1e6
           << ' ' << (p.step_seconds > 0 ? std::to_string(p.step_seconds * 1e3) : "NaN") << ' '
           << p.density << ' ' << p.link_mbps << ' ' << p.bandwidth_mbps << '\n';
    }
  }
  {
    std::ofstream gp(dir / "plot.gp");
    gp << "set terminal pngcairo size 1100,900 font ',10'\n"
       << "set output 'curve.png'\n"
       << "set multiplot layout 2,2\n"
       << "set xlabel 'wall time (s)'\nset ylabel 'test accuracy (%)'\nset grid\n"
       << "set key bottom right\nset logscale x\n"
       << "set arrow from graph 0, first " << target * 100 << " to graph 1, first " << target * 100
       << " nohead dashtype 2\n"
       << "plot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'curve_" << results[i].mode
         << ".dat' using 1:2 with linespoints title '" << results[i].mode << "'";
    }
    gp << "\nunset arrow\nset ylabel 'MB sent by rank 0'\nset logscale y\nset key top left\nplot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'curve_" << results[i].mode << ".dat' using 1:3 with lines title '"
         << results[i].mode << "'";
    }
    // The configuration in force: step time, and the density chosen against the link.
    gp << "\nunset logscale\nset logscale x\nset ylabel 'wall time per step (ms)'\n"
       << "set key top right\nplot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'curve_" << results[i].mode << ".dat' using 1:4 with steps title '"
         << results[i].mode << "'";
    }
    gp << "\nset ylabel 'density (k/n)'\nset logscale y\nset y2label 'uplink (Mbit/s)'\n"
       << "set y2tics\nset y2range [0:*]\nset key bottom right\nplot ";
    for (std::size_t i = 0; i < results.size(); ++i) {
      gp << (i ? ", " : "") << "'curve_" << results[i].mode << ".dat' using 1:5 with steps title '"
         << results[i].mode << " density'";
    }
    if (!results.empty()) {
      gp << ", 'curve_" << results.front().mode
         << ".dat' using 1:6 axes x1y2 with steps dashtype 2 linewidth 2 title 'uplink rate'";
    }
    gp << "\nunset multiplot\n";
  }
  return run_gnuplot(dir, why);
}

}  // namespace

std::string options_json(const settings& s) { return options_of(s).dump(2); }

void report(const settings& s, const std::vector<mode_result>& results,
            const stellatrain::cluster_topology& topology) {
  const mode_result* dense = nullptr;
  for (const auto& r : results)
    if (r.mode == "dense") dense = &r;
  // Time to target of each mode against dense flat (what PyTorch DDP does).
  std::vector<std::optional<double>> speedup;
  for (const auto& r : results) {
    speedup.emplace_back();
    if (dense && dense->time_to_target && r.time_to_target && *r.time_to_target > 0)
      speedup.back() = *dense->time_to_target / *r.time_to_target;
  }
  // WAN figures are per cluster (the mean over the clusters) and leave out the trainer's own
  // bookkeeping at evaluations; bits are per parameter and (inner) step.
  std::printf("\n%-17s %9s %14s %7s %12s %13s %14s %11s %8s\n", "mode", "final acc",
              "time to target", "steps", "WAN MB", "WAN MB to tgt", "per step (KB)", "bits/param",
              "speedup");
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    char ttt[32] = "not reached";
    if (r.time_to_target) std::snprintf(ttt, sizeof ttt, "%.1f s", *r.time_to_target);
    char sp[32] = "";
    if (speedup[i]) std::snprintf(sp, sizeof sp, "%.1fx", *speedup[i]);
    char to_target[32] = "-";
    if (const auto b = wan_bytes_to_target(r))
      std::snprintf(to_target, sizeof to_target, "%.2f", *b / 1e6);
    const double wan_mb = static_cast<double>(r.wan_bytes_per_cluster) / 1e6;
    std::printf("%-17s %8.2f%% %14s %7llu %12.2f %13s %14.2f %11.4f %8s\n", r.mode.c_str(),
                r.final_accuracy * 100, ttt, static_cast<unsigned long long>(r.steps), wan_mb,
                to_target, r.steps ? wan_mb * 1e3 / static_cast<double>(r.steps) : 0.0,
                wan_bits_per_parameter_and_step(r), sp);
  }
  std::string link = "links not shaped by the library";
  if (s.shaped()) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "uplinks %g Mbit/s, %g ms RTT between clusters, LAN ",
                  s.bandwidth_mbps, s.rtt_ms);
    link = buf;
    if (s.lan_mbps > 0) {
      std::snprintf(buf, sizeof buf, "%g Mbit/s", s.lan_mbps);
      link += buf;
    } else {
      link += "unshaped";
    }
  }
  std::printf("(target accuracy %.1f%% on %zu test examples; clusters %s, %s, %s)\n",
              s.target * 100, s.eval_samples, topology.to_string().c_str(), s.transport.c_str(),
              link.c_str());
  const std::filesystem::path dir(s.out);
  std::filesystem::create_directories(dir);
  write_summary_json(dir / "summary.json", s, results, speedup, topology);
  write_curve_csv(dir / "curve.csv", results);
  std::string why;
  const bool plotted = plot(dir, results, s.target, why);
  std::printf("\nwrote %s\n      %s\n", (dir / "summary.json").string().c_str(),
              (dir / "curve.csv").string().c_str());
  if (plotted) {
    std::printf("      %s\n", (dir / "curve.png").string().c_str());
  } else {
    std::printf("      (no plot: %s)\n", why.c_str());
  }
}

}  // namespace fashion_mnist
