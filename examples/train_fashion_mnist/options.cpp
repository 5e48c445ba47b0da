// SPDX-License-Identifier: Apache-2.0
#include "options.hpp"

#include "report.hpp"

#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/rate_schedule.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace fashion_mnist {
namespace {

namespace st = stellatrain;

// CLI11's Range lets nan through and says "not in range" of a value that is no number at all;
// these say what is wrong, and CLI11 puts the option's name in front.
template <class T>
bool parse_whole(const std::string& text, T& v) {
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, v);
  return ec == std::errc() && p == end;
}

// "RANK:FACTOR" of --slow-rank: a rank >= 0 and 1 <= FACTOR <= 100; empty if it is not that.
std::optional<std::pair<int, double>> slow_rank_of(const std::string& text) {
  const auto colon = text.find(':');
  int r = 0;
  double f = 0;
  if (colon == std::string::npos || !parse_whole(text.substr(0, colon), r) || r < 0 ||
      !parse_whole(text.substr(colon + 1), f) || !std::isfinite(f) || f < 1 || f > 100) {
    return std::nullopt;
  }
  return std::pair{r, f};
}

std::string show(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

CLI::Validator integer_in(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        long long v = 0;
        if (!parse_whole(text, v)) return "'" + text + "' is not an integer";
        if (v < lo || v > hi)
          return text + " is out of range " + std::to_string(lo) + ".." + std::to_string(hi);
        return {};
      },
      "[" + std::to_string(lo) + ".." + std::to_string(hi) + "]");
}

// A finite number in [lo, hi], or in (lo, hi] when `above_lo`.
CLI::Validator number_in(double lo, double hi, bool above_lo = false) {
  const std::string range = (above_lo ? "(" : "[") + show(lo) + ".." + show(hi) + "]";
  return CLI::Validator(
      [lo, hi, above_lo, range](std::string& text) -> std::string {
        double v = 0;
        if (!parse_whole(text, v) || !std::isfinite(v)) return "'" + text + "' is not a number";
        if (v < lo || v > hi || (above_lo && v == lo)) return text + " is out of range " + range;
        return {};
      },
      range);
}

// The folder exists or can be made, and a file can be written in it: found now, not after
// the training.
std::string check_writable(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return "cannot create '" + dir + "': " + ec.message();
  const auto probe = std::filesystem::path(dir) / ".train_fashion_mnist-write-check";
  if (!std::ofstream(probe)) return "cannot write in '" + dir + "'";
  std::filesystem::remove(probe, ec);
  return {};
}

constexpr const char* footer = R"(
Modes run in the order dense, dense-hier, diloco, stellatrain, stellatrain-hier,
stellatrain-local: dense averages the gradient through a ring all-reduce (what PyTorch DDP
does), dense-hier reduces inside each cluster first, diloco is DiLoCo's published method
written here (H inner Adam steps at --lr, fp32 pseudo-gradients all-reduced as dense-hier
does, outer Nesterov SGD with lr 0.7 and momentum 0.9), stellatrain is the pipeline (top-k with error
feedback, packing, sparse all-gather, CPU Adam, the bandwidth-adaptive density controller),
stellatrain-hier its hierarchical exchange and stellatrain-local its local steps (H inner Adam
steps, the pseudo-gradients as k of every 4096 in 1 or 2 bits with error feedback, exchanged
hierarchically between clusters, outer SGD of rate 1).

The learning-rate defaults are the best of sweeps on the reference machine (dense
0.0005-0.003, stellatrain 0.001-0.008; with the decay, starts of dense 0.001-0.003 and
stellatrain 0.003-0.005): Adam normalizes each element's step, so an element that error
feedback holds back for many steps moves about lr when it is sent at last; sparse training
wants larger steps early, and the decay to a common rate keeps its later steps as calm as
dense training's.

Wall times exclude the evaluations (the clock stops while rank 0 evaluates). The final
accuracy is measured on the whole test set (10000 examples).

  train_fashion_mnist                       4 in-process ranks, clusters 2,2
  mpirun -np 4 train_fashion_mnist --transport mpi --clusters 2,2
  STELLATRAIN_RANK=r STELLATRAIN_ZMQ_PEERS=tcp://...,... train_fashion_mnist --transport zmq
)";

}  // namespace

std::optional<int> parse_options(int argc, char** argv, settings& s) {
  CLI::App app{
      "train_fashion_mnist: data-parallel training by clusters of ranks joined by slow "
      "uplinks, dense all-reduce against the stellatrain pipeline, each flat and hierarchical, "
      "on Fashion-MNIST (Debian's dataset-fashion-mnist)."};
  app.footer(footer);
  app.get_formatter()->column_width(34);
  const auto max_int = static_cast<long long>(std::numeric_limits<int>::max());

  std::vector<std::string> modes{"all"};
  bool dry_run = false;
  app.add_option("--transport", s.transport,
                 "inprocess | mpi | zmq; mpi: run under mpirun, one rank per process; zmq: "
                 "STELLATRAIN_RANK and STELLATRAIN_ZMQ_PEERS (or _FILE) per process")
      ->check(CLI::IsMember({"inprocess", "mpi", "zmq"}))
      ->capture_default_str();
  app.add_option("--allgather", s.allgather,
                 "automatic | direct | ring: the stellatrain modes' sparse all-gather "
                 "(automatic: direct in process, else a ring for more than 2 ranks; direct "
                 "pays one latency per exchange, the ring P-1)")
      ->check(CLI::IsMember({"automatic", "direct", "ring"}))
      ->capture_default_str();
  auto* clusters = app.add_option(
      "--clusters", s.clusters,
      "cluster sizes in rank order, e.g. 2,2 or 3,1; their sum is the number of ranks "
      "[inprocess: 2,2, or one rank per cluster with --ranks; otherwise $STELLATRAIN_CLUSTERS, "
      "else one rank per cluster]");
  clusters->check(CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          (void)st::cluster_topology::parse(text);
        } catch (const st::error& e) {
          return e.what();
        }
        return {};
      },
      "SIZES"));
  auto* ranks = app.add_option("--ranks", s.ranks,
                               "ranks as threads of this process (inprocess only), one per "
                               "cluster [4]")
                    ->check(integer_in(1, 1024));
  auto* bandwidth =
      app.add_option("--bandwidth,--uplink", s.bandwidth_mbps,
                     "each cluster's uplink in Mbit/s, shaped by the library in each direction "
                     "(shared by the cluster's ranks of one process); 0: no shaping [100 for "
                     "inprocess, 0 otherwise: the network (wan-emu) decides]")
          ->check(number_in(0, 1e6));
  app.add_option("--lan-bandwidth", s.lan_mbps,
                 "each rank's link inside its cluster, Mbit/s; 0: unshaped")
      ->check(number_in(0, 1e6))
      ->capture_default_str();
  auto* rtt = app.add_option("--rtt", s.rtt_ms,
                             "round-trip time between clusters added by the shaping, ms [20 for "
                             "inprocess, else 0]")
                  ->check(number_in(0, 60e3));
  app.add_option("--min-density", s.min_density, "lower bound of the controller's density")
      ->check(number_in(0, 1, true))
      ->capture_default_str();
  app.add_option("--max-density", s.max_density, "upper bound of the controller's density")
      ->check(number_in(0, 1, true))
      ->capture_default_str();
  app.add_option("--epochs", s.epochs, "epochs of training of each mode (all the same)")
      ->check(number_in(0, 1000, true))
      ->capture_default_str();
  app.add_option("--target", s.target, "test accuracy whose time is measured, 0..1")
      ->check(number_in(0, 1))
      ->capture_default_str();
  app.add_option("--mode", modes,
                 "modes to run, comma-separated: all, both (dense,stellatrain), dense, "
                 "dense-hier, diloco, stellatrain, stellatrain-hier, stellatrain-local [all]")
      ->delimiter(',')
      ->check(CLI::IsMember({"all", "both", "dense", "dense-hier", "diloco", "stellatrain",
                             "stellatrain-hier", "stellatrain-local"}));
  app.add_flag("--stop-at-target", s.stop_at_target,
               "end each mode at its first evaluation at or above --target (its final "
               "accuracy is then that point's, on the whole test set)");
  app.add_option("--batch", s.batch, "examples per rank and step")
      ->check(integer_in(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--hidden", s.hidden, "width of the two hidden layers")
      ->check(integer_in(1, 1 << 14))
      ->capture_default_str();
  app.add_option("--lr", s.lr, "Adam learning rate of the dense modes and diloco's inner steps")
      ->check(number_in(0, 10, true))
      ->capture_default_str();
  app.add_option("--sparse-lr", s.sparse_lr,
                 "Adam learning rate of the stellatrain modes (stellatrain-local: its inner steps)")
      ->check(number_in(0, 10, true))
      ->capture_default_str();
  app.add_option("--lr-end", s.lr_end, "rate all modes reach by a linear decay")
      ->check(number_in(0, 10, true))
      ->capture_default_str();
  app.add_option("--decay-steps", s.decay_steps,
                 "steps of that decay (0: each mode keeps its rate)")
      ->check(integer_in(0, max_int))
      ->capture_default_str();
  app.add_option("--local-steps", s.local_steps,
                 "H of the stellatrain-local mode: inner Adam steps per outer step")
      ->check(integer_in(1, 10000))
      ->capture_default_str();
  app.add_option("--local-topk", s.local_topk,
                 "stellatrain-local: pseudo-gradient elements sent of every chunk of 4096")
      ->check(integer_in(1, 4096))
      ->capture_default_str();
  app.add_option("--local-bits", s.local_bits,
                 "stellatrain-local: bits per value sent, 1 (sign and a scale per chunk) or 2 "
                 "(sign and one of two magnitudes per chunk)")
      ->check(integer_in(1, 2))
      ->capture_default_str();
  app.add_option("--diloco-steps", s.diloco_steps,
                 "H of the diloco mode: inner Adam steps (at --lr) per outer step")
      ->check(integer_in(1, 10000))
      ->capture_default_str();
  app.add_option("--staleness", s.staleness,
                 "the pipeline's staleness, 0 or 1 (with 1, a step's exchange and update run "
                 "during the next step's compute)")
      ->check(integer_in(0, 1))
      ->capture_default_str();
  app.add_option("--split", s.split,
                 "how the global batch (--batch times the ranks) goes to the ranks: equal, or "
                 "holistic (by the ranks' measured compute speeds, agreed after 3 steps, then "
                 "every --split-interval steps)")
      ->check(CLI::IsMember({"equal", "holistic"}))
      ->capture_default_str();
  app.add_option("--split-interval", s.split_interval,
                 "steps between the ranks' exchanges of their compute times (the first after "
                 "3 steps, or this many if fewer)")
      ->check(integer_in(1, max_int))
      ->capture_default_str();
  app.add_option("--device-rate", s.device_rate,
                 "examples per second of each rank's emulated device: a rank computes its "
                 "forward and backward, then waits until its batch over this rate has passed "
                 "(the real time counts where it is longer); 0: the CPU's own pace, shared by "
                 "the ranks that are threads of this process")
      ->check(number_in(0, 1e9))
      ->capture_default_str();
  std::vector<std::string> slow;
  app.add_option("--slow-rank", slow,
                 "RANK:FACTOR, repeatable: that rank emulates a device FACTOR times slower: "
                 "with --device-rate, a device of that rate over FACTOR; without, it waits "
                 "(FACTOR - 1) times its measured forward and backward after each")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            if (slow_rank_of(text)) return {};
            return "'" + text + "' is not RANK:FACTOR with a rank >= 0 and 1 <= FACTOR <= 100";
          },
          "RANK:FACTOR"));
  auto* schedule = app.add_option(
      "--bandwidth-schedule", s.bandwidth_schedule,
      "the uplinks' rate over each mode's training time, SECONDS:MBITS,... (e.g. 20:50,40:200; "
      "tc units as 50mbit also work); before the first change --bandwidth");
  schedule->check(CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          (void)st::rate_schedule::parse(text);
        } catch (const st::error& e) {
          return e.what();
        }
        return {};
      },
      "SCHEDULE"));
  app.add_option("--eval-every", s.eval_every, "steps between evaluations")
      ->check(integer_in(1, max_int))
      ->capture_default_str();
  app.add_option("--eval-samples", s.eval_samples,
                 "test examples per evaluation during training (at most the test set's 10000)")
      ->check(integer_in(1, 10000))
      ->capture_default_str();
  app.add_option("--seed", s.seed, "seed of the initial parameters and data order")
      ->check(integer_in(0, std::numeric_limits<long long>::max()))
      ->capture_default_str();
  app.add_option("--data", s.data, "folder of the IDX files")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
  app.add_option("--out", s.out, "where summary.json, curve.csv and curve.png go (made if missing)")
      ->capture_default_str();
  app.add_flag("--dry-run", dry_run,
               "check the options, print the settings as JSON and exit without training");

  try {
    app.parse(argc, argv);
    const bool inproc = s.transport == "inprocess";
    if (!inproc && ranks->count() > 0) {
      throw CLI::ValidationError(
          "--ranks", "only with --transport inprocess (MPI and ZeroMQ take the world size)");
    }
    if (s.min_density > s.max_density) {
      throw CLI::ValidationError(
          "--min-density", show(s.min_density) + " is above --max-density " + show(s.max_density));
    }
    if (inproc) {
      if (s.clusters.empty() && ranks->count() == 0) s.clusters = "2,2";
      if (!s.clusters.empty()) {
        const int sum = st::cluster_topology::parse(s.clusters).ranks();
        if (ranks->count() > 0 && sum != s.ranks) {
          throw CLI::ValidationError("--ranks", std::to_string(s.ranks) +
                                                    " disagrees with --clusters " + s.clusters +
                                                    " (" + std::to_string(sum) + " ranks)");
        }
        s.ranks = sum;
      }
    }
    if (bandwidth->count() == 0) s.bandwidth_mbps = inproc ? 100 : 0;
    if (schedule->count() > 0 && !(s.bandwidth_mbps > 0)) {
      throw CLI::ValidationError("--bandwidth-schedule",
                                 "needs links shaped by the library (--bandwidth > 0)");
    }
    s.slow_ranks.clear();
    for (const auto& text : slow) {
      const auto [r, f] = *slow_rank_of(text);  // checked by the option's validator
      if (inproc && r >= s.ranks) {
        throw CLI::ValidationError("--slow-rank",
                                   text + ": there are " + std::to_string(s.ranks) + " ranks");
      }
      s.slow_ranks.emplace_back(r, f);
    }
    if (rtt->count() == 0) s.rtt_ms = inproc ? 20 : 0;
    if (const std::string why = check_writable(s.out); !why.empty())
      throw CLI::ValidationError("--out", why);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  s.modes.clear();
  for (const auto& m : mode_names) {
    const bool asked = std::find(modes.begin(), modes.end(), m) != modes.end() ||
                       std::find(modes.begin(), modes.end(), "all") != modes.end() ||
                       (std::find(modes.begin(), modes.end(), "both") != modes.end() &&
                        (m == "dense" || m == "stellatrain"));
    if (asked) s.modes.push_back(m);
  }
  s.command_line.assign(argv, argv + argc);
  if (dry_run) {
    std::printf("%s\n", options_json(s).c_str());
    return 0;
  }
  return std::nullopt;
}

}  // namespace fashion_mnist
