// SPDX-License-Identifier: Apache-2.0
// Data-parallel training of an MLP on Fashion-MNIST over a slow link, twice: "dense" (the
// averaged gradient through a dense ring all-reduce, as PyTorch DDP does) and "stellatrain"
// (the pipeline: top-k selection with error feedback, packing, sparse all-gather, the CPU
// optimizer and the bandwidth-adaptive density controller). Prints progress and a table of
// time to the target accuracy, and writes summary.json, curve.csv and curve.png.
//
//   train_fashion_mnist                         4 in-process ranks, 100 Mbit/s, 20 ms RTT
//   mpirun -np 4 train_fashion_mnist --transport mpi
//   STELLATRAIN_RANK=r STELLATRAIN_ZMQ_PEERS=... train_fashion_mnist --transport zmq
//   train_fashion_mnist --help
#include "fashion_mnist.hpp"
#include "mlp.hpp"
#include "report.hpp"

#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/any_transport.hpp>
#include <stellatrain/transport/barrier.hpp>
#include <stellatrain/transport/in_process.hpp>
#include <stellatrain/transport/metering.hpp>
#include <stellatrain/transport/shaping.hpp>
#if STELLATRAIN_DEMO_WITH_MPI
#include <stellatrain/transport/mpi.hpp>
#endif
#if STELLATRAIN_DEMO_WITH_ZMQ
#include <stellatrain/transport/zmq.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace st = stellatrain;
namespace fm = fashion_mnist;

namespace {

struct settings {
  int ranks = 4;               // in-process only; MPI/ZeroMQ take the world size
  double bandwidth_mbps = -1;  // per rank link; -1: 100 in-process, unshaped otherwise
  double rtt_ms = -1;          // -1: 20 in-process, 0 otherwise
  double min_density = 1e-4;
  double max_density = 0.01;
  double epochs = 0.5;
  double target = 0.82;
  std::string transport = "inprocess";
  std::string out = "out/demo";
  std::string mode = "both";
  int batch = 32;  // per rank
  int hidden = 1024;
  float lr = 1e-3f;         // dense mode
  float sparse_lr = 3e-3f;  // stellatrain mode
  float lr_end = 1e-3f;     // both modes decay linearly to this rate...
  int decay_steps = 60;     // ...over these steps (0: constant rates)
  int eval_every = 5;       // steps
  std::size_t eval_samples = 2000;
  std::uint64_t seed = 1;
  std::string data = fm::default_directory;
  int staleness = 0;
};

const char* usage =
    R"(train_fashion_mnist: data-parallel training over a slow link, dense all-reduce
against the stellatrain pipeline, on Fashion-MNIST (Debian's dataset-fashion-mnist).

Options (defaults in brackets):
  --transport T     inprocess | mpi | zmq                                 [inprocess]
                    mpi: run under mpirun, one rank per process;
                    zmq: STELLATRAIN_RANK and STELLATRAIN_ZMQ_PEERS (or _FILE) per process
  --ranks N         ranks as threads of this process (inprocess only)     [4]
  --bandwidth M     each rank's link rate in Mbit/s, shaped by the library; 0: no shaping
                    [100 for inprocess, 0 otherwise: the network decides]
  --rtt MS          round-trip time added by the shaping, ms              [20 for inprocess, else 0]
  --min-density D   lower bound of the controller's density               [0.0001]
  --max-density D   upper bound of the controller's density               [0.01]
  --epochs E        epochs of training of each mode (both the same)       [0.5]
  --target A        test accuracy whose time is measured, 0..1            [0.82]
  --mode M          both | dense | stellatrain                            [both]
  --batch B         examples per rank and step                            [32]
  --hidden H        width of the two hidden layers                        [1024]
  --lr L            Adam learning rate of the dense mode                  [0.001]
  --sparse-lr L     Adam learning rate of the stellatrain mode            [0.003]
  --lr-end L        rate both modes reach by a linear decay               [0.001]
  --decay-steps N   steps of that decay (0: each mode keeps its rate)     [60]
                    The defaults are the best of sweeps on the reference machine (dense
                    0.0005-0.003, stellatrain 0.001-0.008; with the decay, starts of dense
                    0.001-0.003 and stellatrain 0.003-0.005): Adam normalizes each element's
                    step, so an element that error feedback holds back for many steps moves
                    about lr when it is sent at last; sparse training wants larger steps
                    early, and the decay to a common rate keeps its later steps as calm as
                    dense training's.
  --staleness S     0 or 1, the pipeline's staleness                      [0]
                    (with 1, each change of the rate waits for the pipeline to drain)
  --eval-every K    steps between evaluations                             [5]
  --eval-samples N  test examples per evaluation during training          [2000]
  --seed S          seed of the initial parameters and data order         [1]
  --data DIR        folder of the IDX files     [/usr/share/datasets/fashion-mnist]
  --out DIR         where summary.json, curve.csv and curve.png go        [out/demo]
  --help            this text

Wall times exclude the evaluations (the clock stops while rank 0 evaluates). The final
accuracy is measured on the whole test set (10000 examples).
)";

settings parse(int argc, char** argv) {
  settings s;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc)
      throw st::error(st::errc::invalid_argument, std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    try {
      if (a == "--help" || a == "-h") {
        std::fputs(usage, stdout);
        std::exit(0);
      } else if (a == "--transport") {
        s.transport = value(i);
      } else if (a == "--ranks") {
        s.ranks = std::stoi(value(i));
      } else if (a == "--bandwidth") {
        s.bandwidth_mbps = std::stod(value(i));
      } else if (a == "--rtt") {
        s.rtt_ms = std::stod(value(i));
      } else if (a == "--min-density") {
        s.min_density = std::stod(value(i));
      } else if (a == "--max-density") {
        s.max_density = std::stod(value(i));
      } else if (a == "--epochs") {
        s.epochs = std::stod(value(i));
      } else if (a == "--target") {
        s.target = std::stod(value(i));
      } else if (a == "--mode") {
        s.mode = value(i);
      } else if (a == "--batch") {
        s.batch = std::stoi(value(i));
      } else if (a == "--hidden") {
        s.hidden = std::stoi(value(i));
      } else if (a == "--lr") {
        s.lr = std::stof(value(i));
      } else if (a == "--sparse-lr") {
        s.sparse_lr = std::stof(value(i));
      } else if (a == "--lr-end") {
        s.lr_end = std::stof(value(i));
      } else if (a == "--decay-steps") {
        s.decay_steps = std::stoi(value(i));
      } else if (a == "--staleness") {
        s.staleness = std::stoi(value(i));
      } else if (a == "--eval-every") {
        s.eval_every = std::stoi(value(i));
      } else if (a == "--eval-samples") {
        s.eval_samples = static_cast<std::size_t>(std::stoul(value(i)));
      } else if (a == "--seed") {
        s.seed = std::stoull(value(i));
      } else if (a == "--data") {
        s.data = value(i);
      } else if (a == "--out") {
        s.out = value(i);
      } else {
        throw st::error(st::errc::invalid_argument, "unknown option " + a + " (see --help)");
      }
    } catch (const std::logic_error&) {
      throw st::error(st::errc::invalid_argument, "bad value for " + a + " (see --help)");
    }
  }
  const bool inproc = s.transport == "inprocess";
  if (!inproc && s.transport != "mpi" && s.transport != "zmq") {
    throw st::error(st::errc::invalid_argument, "--transport must be inprocess, mpi or zmq");
  }
  if (s.mode != "both" && s.mode != "dense" && s.mode != "stellatrain") {
    throw st::error(st::errc::invalid_argument, "--mode must be both, dense or stellatrain");
  }
  if (s.bandwidth_mbps < 0) s.bandwidth_mbps = inproc ? 100 : 0;
  if (s.rtt_ms < 0) s.rtt_ms = inproc ? 20 : 0;
  if (s.ranks < 1 || s.batch < 1 || s.hidden < 1 || s.eval_every < 1 || !(s.epochs > 0) ||
      s.staleness < 0 || s.staleness > 1 || s.decay_steps < 0 || !(s.lr > 0) ||
      !(s.sparse_lr > 0) || !(s.lr_end > 0) || !(s.min_density > 0) ||
      s.min_density > s.max_density || s.max_density > 1) {
    throw st::error(st::errc::invalid_argument, "an option is out of range (see --help)");
  }
  return s;
}

struct data {
  fm::dataset train;
  fm::dataset test;
};

// What one mode's run produced on rank 0.
struct run_output {
  fm::mode_result result;
};

// Rank 0's clock: wall time of training, paused while it evaluates.
class training_clock {
 public:
  training_clock() : start_(now()) {}
  [[nodiscard]] double seconds() const {
    return std::chrono::duration<double>(now() - start_).count() - paused_;
  }
  template <class F>
  auto paused(F&& f) {
    const auto t0 = now();
    auto r = f();
    paused_ += std::chrono::duration<double>(now() - t0).count();
    return r;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  std::chrono::steady_clock::time_point start_;
  double paused_ = 0;
};

// The examples of rank r of P for step s: a fixed random order of the rank's shard.
class shard {
 public:
  shard(std::size_t count, int rank, int ranks, std::uint64_t seed) {
    for (std::size_t i = static_cast<std::size_t>(rank); i < count;
         i += static_cast<std::size_t>(ranks))
      order_.push_back(i);
    std::mt19937_64 rng(seed * 7919 + static_cast<std::uint64_t>(rank));
    std::shuffle(order_.begin(), order_.end(), rng);
  }
  void batch(const fm::dataset& d, std::uint64_t step, int size, std::vector<float>& x,
             std::vector<std::uint8_t>& y) const {
    x.resize(static_cast<std::size_t>(size) * fm::dataset::pixels);
    y.resize(static_cast<std::size_t>(size));
    for (int b = 0; b < size; ++b) {
      const std::size_t i =
          order_[(step * static_cast<std::size_t>(size) + static_cast<std::size_t>(b)) %
                 order_.size()];
      std::copy_n(d.images.data() + i * fm::dataset::pixels, fm::dataset::pixels,
                  x.data() + static_cast<std::size_t>(b) * fm::dataset::pixels);
      y[static_cast<std::size_t>(b)] = d.labels[i];
    }
  }

 private:
  std::vector<std::size_t> order_;
};

// The learning rate of step `step` for a mode that starts at `start`: linear to s.lr_end over
// s.decay_steps steps, then constant.
float learning_rate(const settings& s, float start, std::uint64_t step) {
  if (s.decay_steps == 0) return start;
  const double f = std::min(1.0, static_cast<double>(step) / static_cast<double>(s.decay_steps));
  return static_cast<float>(start + (static_cast<double>(s.lr_end) - start) * f);
}

std::uint64_t steps_of(const settings& s, int ranks, const data& d) {
  const double per_step = static_cast<double>(ranks) * static_cast<double>(s.batch);
  return static_cast<std::uint64_t>(
      std::ceil(s.epochs * static_cast<double>(d.train.count) / per_step));
}

// Evaluation and progress on rank 0; returns true once the target is first reached.
struct progress {
  const settings& s;
  const data& d;
  fm::mode_result& out;
  std::uint64_t steps;
  int ranks;
  double loss_sum = 0;
  int loss_count = 0;
  double last_loss = 0;

  void record(fm::mlp& net, std::span<const float> params, std::uint64_t step, double seconds,
              std::uint64_t bytes, double density, bool final_eval) {
    const std::size_t n = final_eval ? d.test.count : std::min(s.eval_samples, d.test.count);
    const double acc =
        static_cast<double>(net.correct(params, d.test.images.data(), d.test.labels.data(), n)) /
        static_cast<double>(n);
    // The mean training loss since the last record (the final record repeats the last one).
    const double loss = loss_count > 0 ? loss_sum / loss_count : last_loss;
    last_loss = loss;
    loss_sum = 0;
    loss_count = 0;
    const double epoch = static_cast<double>(step) * static_cast<double>(s.batch) *
                         static_cast<double>(ranks) / static_cast<double>(d.train.count);
    out.curve.push_back({seconds, step, epoch, loss, acc, bytes, density});
    if (!out.time_to_target && acc >= s.target && !final_eval) {
      out.time_to_target = seconds;
      out.steps_to_target = step;
    }
    if (final_eval) out.final_accuracy = acc;
    std::printf(
        "  %-11s step %4llu/%llu  epoch %.2f  loss %.4f  acc %5.2f%%%s  %7.1f s  %9.2f MB sent  "
        "density %.4f\n",
        out.mode.c_str(), static_cast<unsigned long long>(step),
        static_cast<unsigned long long>(steps), epoch, loss, acc * 100,
        final_eval ? " (full test set)" : "               ", seconds,
        static_cast<double>(bytes) / 1e6, density);
    std::fflush(stdout);
  }
};

template <st::transport Transport>
std::uint64_t sent_bytes(Transport& t) {
  return t.snapshot().total.bytes_sent;
}

// ---------------------------------------------------------------------------------- dense
template <st::transport Transport>
void run_dense(Transport& t, const settings& s, const data& d, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  fm::mlp net({static_cast<int>(fm::dataset::pixels), s.hidden, s.hidden, fm::dataset::classes},
              std::max(s.batch, 500));
  std::vector<float> params(net.parameter_count());
  net.initialize(params,
                 s.seed);  // the same seed on every rank: identical start, as DDP broadcasts
  st::adam_optimizer adam({.lr = s.lr});
  adam.add_tensor(params);
  std::vector<float> grad(params.size());
  const shard my_shard(d.train.count, r, ranks, s.seed);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  st::collective_workspace<Transport> ws;
  std::optional<progress> prog;
  if (r == 0) prog.emplace(progress{s, d, *out, steps, ranks});
  st::barrier(t);
  const std::uint64_t bytes0 = sent_bytes(t);
  training_clock clock;
  for (std::uint64_t step = 0; step < steps; ++step) {
    my_shard.batch(d.train, step, s.batch, x, y);
    const float loss = net.forward_backward(adam.params(0), x.data(), y.data(), s.batch, grad);
    st::dense_allreduce(t, std::span<float>(grad),
                        {.tag = 1, .timeout = std::chrono::minutes(10), .average = true}, ws);
    adam.set_learning_rate(learning_rate(s, s.lr, step));
    adam.step(0, std::span<const float>(grad));
    if (prog) {
      prog->loss_sum += loss;
      ++prog->loss_count;
      if ((step + 1) % static_cast<std::uint64_t>(s.eval_every) == 0 || step + 1 == steps) {
        const double now = clock.seconds();
        clock.paused([&] {
          prog->record(net, adam.params(0), step + 1, now, sent_bytes(t) - bytes0, 1.0, false);
          return 0;
        });
      }
    }
  }
  if (prog) {
    out->seconds = clock.seconds();
    out->steps = steps;
    out->bytes = sent_bytes(t) - bytes0;
    prog->record(net, adam.params(0), steps, out->seconds, out->bytes, 1.0, true);
  }
  st::barrier(t);
}

// ---------------------------------------------------------------------------------- stellatrain
template <st::transport Transport>
void run_stellatrain(Transport& t, const settings& s, const data& d, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  fm::mlp net({static_cast<int>(fm::dataset::pixels), s.hidden, s.hidden, fm::dataset::classes},
              std::max(s.batch, 500));
  std::vector<float> params(net.parameter_count());
  net.initialize(params, s.seed + static_cast<std::uint64_t>(r));  // rank 0's values are broadcast
  st::thread_pool pool{1};
  const double latency_s = s.rtt_ms / 2000.0;
  st::pipeline p(t, pool, st::error_feedback_compressor<st::threshold_selector<>, st::bf16>(),
                 st::adam_optimizer({.lr = s.sparse_lr}),
                 // In one process every rank's shaped link carries its P-1 copies at the link
                 // rate whatever the order: the direct all-gather pays the latency once. Over
                 // real TCP the automatic choice (a ring for more than 2 ranks) keeps one flow
                 // per link.
                 {.bucket_bytes = std::uint64_t{4} << 20,
                  .staleness = s.staleness,
                  .send_all_below = 4096,
                  .exchange_threads = 4,
                  .algorithm = s.transport == "inprocess" ? st::allgather_algorithm::direct
                                                          : st::allgather_algorithm::automatic,
                  .timeout = std::chrono::minutes(10)},
                 st::adaptive_density_controller(
                     {.min_density = s.min_density,
                      .max_density = s.max_density,
                      .initial_density = std::min(s.max_density, std::max(s.min_density, 0.01)),
                      .latency_seconds = latency_s}));
  for (const auto& tensor : net.tensors()) {
    p.add_tensor(tensor.id, std::span<const float>(params).subspan(tensor.offset, tensor.size));
  }
  p.start();
  std::vector<float> grad(params.size());
  const shard my_shard(d.train.count, r, ranks, s.seed);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  std::optional<progress> prog;
  if (r == 0) prog.emplace(progress{s, d, *out, steps, ranks});
  const auto& tensors = net.tensors();
  auto fetch = [&] {
    for (std::size_t b = 0; b < p.bucket_count(); ++b) {
      p.wait_for_forward(b);
      const auto range = p.bucket(b);
      for (std::size_t i = range.first_tensor; i < range.first_tensor + range.tensor_count; ++i) {
        p.copy_params(i, std::span<float>(params).subspan(tensors[i].offset, tensors[i].size));
      }
    }
  };
  st::barrier(t);
  const std::uint64_t bytes0 = sent_bytes(t);
  training_clock clock;
  for (std::uint64_t step = 0; step < steps; ++step) {
    fetch();
    if (const float lr = learning_rate(s, s.sparse_lr, step); lr != p.optimizer().options().lr) {
      // The optimizer's rate may change only while it is idle: with staleness 0 the gates of
      // fetch() have seen every handed-over step applied; with 1, wait for it.
      if (s.staleness > 0) p.flush();
      p.optimizer().set_learning_rate(lr);
    }
    my_shard.batch(d.train, step, s.batch, x, y);
    const float loss = net.forward_backward(params, x.data(), y.data(), s.batch, grad);
    for (std::size_t i = tensors.size(); i-- > 0;) {  // backward order: last layer first
      p.push_gradient(i, std::span<const float>(grad).subspan(tensors[i].offset, tensors[i].size));
    }
    if (prog) {
      prog->loss_sum += loss;
      ++prog->loss_count;
      if ((step + 1) % static_cast<std::uint64_t>(s.eval_every) == 0 || step + 1 == steps) {
        const double now = clock.seconds();
        const double density = p.stats().last_density;
        clock.paused([&] {
          // Evaluate the parameters with every update through this step applied.
          p.flush();
          for (std::size_t i = 0; i < tensors.size(); ++i) {
            p.copy_params(i, std::span<float>(params).subspan(tensors[i].offset, tensors[i].size));
          }
          prog->record(net, params, step + 1, now, sent_bytes(t) - bytes0, density, false);
          return 0;
        });
      }
    }
  }
  p.flush();
  if (prog) {
    out->seconds = clock.seconds();
    out->steps = steps;
    out->bytes = sent_bytes(t) - bytes0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      p.copy_params(i, std::span<float>(params).subspan(tensors[i].offset, tensors[i].size));
    }
    prog->record(net, params, steps, out->seconds, out->bytes, p.stats().last_density, true);
  }
  st::barrier(t);
}

template <st::transport Transport>
void run_modes(Transport& t, const settings& s, const data& d,
               std::vector<fm::mode_result>* results) {
  if (s.mode == "both" || s.mode == "dense") {
    if (t.rank() == 0)
      std::printf("\n== dense: averaged gradients through a dense ring all-reduce\n");
    fm::mode_result res;
    res.mode = "dense";
    run_dense(t, s, d, &res);
    if (t.rank() == 0) results->push_back(std::move(res));
  }
  if (s.mode == "both" || s.mode == "stellatrain") {
    if (t.rank() == 0) {
      std::printf(
          "\n== stellatrain: top-k + error feedback, sparse all-gather, CPU Adam, adaptive "
          "density\n");
    }
    fm::mode_result res;
    res.mode = "stellatrain";
    run_stellatrain(t, s, d, &res);
    if (t.rank() == 0) results->push_back(std::move(res));
  }
}

// Wraps the backend: shaping when asked, then metering (bytes sent by rank 0). The link is
// type-erased, so that the training code is compiled once for every backend and link (a
// virtual call per message costs nothing next to the exchange; one instantiation per link
// doubled this file's compile time).
template <st::transport Inner>
void with_link(Inner inner, const settings& s, const data& d,
               std::vector<fm::mode_result>* results) {
  std::optional<st::any_transport> link;
  if (s.bandwidth_mbps > 0 || s.rtt_ms > 0) {
    const auto latency = std::chrono::microseconds(static_cast<std::int64_t>(s.rtt_ms * 500.0));
    link.emplace(st::shaped_transport<Inner>(
        std::move(inner), {.bits_per_second = s.bandwidth_mbps * 1e6, .latency = latency}));
  } else {
    link.emplace(std::move(inner));
  }
  st::metered_transport<st::any_transport> t(std::move(*link));
  run_modes(t, s, d, results);
}

void report(const settings& s, std::vector<fm::mode_result>& results, int ranks) {
  const fm::mode_result* dense = nullptr;
  const fm::mode_result* sparse = nullptr;
  for (const auto& r : results) (r.mode == "dense" ? dense : sparse) = &r;
  std::optional<double> speedup;
  if (dense && sparse && dense->time_to_target && sparse->time_to_target &&
      *sparse->time_to_target > 0) {
    speedup = *dense->time_to_target / *sparse->time_to_target;
  }
  std::printf("\n%-12s %10s %15s %10s %14s %9s\n", "mode", "final acc", "time to target", "steps",
              "MB sent (r0)", "speedup");
  for (const auto& r : results) {
    char ttt[32] = "not reached";
    if (r.time_to_target) std::snprintf(ttt, sizeof ttt, "%.1f s", *r.time_to_target);
    char sp[32] = "";
    if (&r == sparse && speedup) std::snprintf(sp, sizeof sp, "%.1fx", *speedup);
    if (&r == dense && speedup) std::snprintf(sp, sizeof sp, "1.0x");
    std::printf("%-12s %9.2f%% %15s %10llu %14.1f %9s\n", r.mode.c_str(), r.final_accuracy * 100,
                ttt, static_cast<unsigned long long>(r.steps), static_cast<double>(r.bytes) / 1e6,
                sp);
  }
  char link[96] = "links not shaped by the library";
  if (s.bandwidth_mbps > 0 || s.rtt_ms > 0)
    std::snprintf(link, sizeof link, "%.0f Mbit/s, %.0f ms RTT", s.bandwidth_mbps, s.rtt_ms);
  std::printf("(target accuracy %.1f%% on %zu test examples; %d ranks, %s, %s)\n", s.target * 100,
              s.eval_samples, ranks, s.transport.c_str(), link);

  const std::filesystem::path dir(s.out);
  std::filesystem::create_directories(dir);
  std::ostringstream settings_json;
  settings_json << "{\"transport\": \"" << s.transport << "\", \"ranks\": " << ranks
                << ", \"bandwidth_mbps\": " << s.bandwidth_mbps << ", \"rtt_ms\": " << s.rtt_ms
                << ", \"epochs\": " << s.epochs << ", \"batch\": " << s.batch
                << ", \"hidden\": " << s.hidden << ", \"lr\": " << s.lr
                << ", \"sparse_lr\": " << s.sparse_lr << ", \"lr_end\": " << s.lr_end
                << ", \"decay_steps\": " << s.decay_steps << ", \"min_density\": " << s.min_density
                << ", \"max_density\": " << s.max_density << ", \"staleness\": " << s.staleness
                << "}";
  fm::write_summary_json(dir / "summary.json", results, s.target, speedup, settings_json.str());
  fm::write_curve_csv(dir / "curve.csv", results);
  std::string why;
  const bool plotted = fm::plot(dir, results, s.target, why);
  std::printf("\nwrote %s\n      %s\n", (dir / "summary.json").string().c_str(),
              (dir / "curve.csv").string().c_str());
  if (plotted) {
    std::printf("      %s\n", (dir / "curve.png").string().c_str());
  } else {
    std::printf("      (no plot: %s)\n", why.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
#if STELLATRAIN_DEMO_WITH_MPI
    std::optional<st::mpi_environment> mpi;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::string(argv[i]) == "--transport" && std::string(argv[i + 1]) == "mpi")
        mpi.emplace(argc, argv);
    }
#endif
    const settings s = parse(argc, argv);
    data d{fm::load(s.data, "train"), fm::load(s.data, "t10k")};
    std::vector<fm::mode_result> results;
    int ranks = s.ranks;
    int my_rank = 0;
    if (s.transport == "inprocess") {
      std::printf(
          "Fashion-MNIST: %zu training and %zu test examples; MLP 784-%d-%d-10; %d in-process "
          "ranks\n",
          d.train.count, d.test.count, s.hidden, s.hidden, s.ranks);
      st::run_in_process(
          s.ranks, [&](st::in_process_transport& t) { with_link(std::move(t), s, d, &results); });
    } else if (s.transport == "mpi") {
#if STELLATRAIN_DEMO_WITH_MPI
      st::mpi_transport t;
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over MPI: %d ranks\n", ranks);
      with_link(std::move(t), s, d, &results);
#else
      throw st::error(st::errc::unsupported,
                      "this build has no MPI support (install libopenmpi-dev and rebuild)");
#endif
    } else {
#if STELLATRAIN_DEMO_WITH_ZMQ
      auto t = st::zmq_transport::from_environment();
      ranks = t.size();
      my_rank = t.rank();
      if (my_rank == 0) std::printf("Fashion-MNIST over ZeroMQ: %d ranks\n", ranks);
      with_link(std::move(t), s, d, &results);
#else
      throw st::error(
          st::errc::unsupported,
          "this build has no ZeroMQ support (install libzmq3-dev cppzmq-dev and rebuild)");
#endif
    }
    if (my_rank == 0) report(s, results, ranks);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_fashion_mnist: %s\n", e.what());
    return 1;
  }
}
