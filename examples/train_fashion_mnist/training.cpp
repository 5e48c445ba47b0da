// SPDX-License-Identifier: Apache-2.0
// The modes, each over the rank's metered link: "dense" (the averaged gradient through a dense
// ring all-reduce, as PyTorch DDP does), "dense-hier" (reduced inside each cluster, all-reduced
// between clusters, as a topology-aware all-reduce does), "stellatrain" (the pipeline: top-k
// selection with error feedback, packing, sparse all-gather, the CPU optimizer and the
// bandwidth-adaptive density controller), "stellatrain-hier" (the pipeline's hierarchical
// exchange: each cluster's uplink carries its selection once) and "stellatrain-local" (local
// steps: H inner Adam steps per rank, then the pseudo-gradients through the chunked low-bit
// codec and a plain outer SGD, SparseLoCo's recipe); "diloco" is the published local-steps method
// they are measured against: fp32 pseudo-gradients, a dense all-reduce, outer Nesterov SGD.
#include "training.hpp"

#include "mlp.hpp"

#include <stellatrain/batch/batch_split_agreement.hpp>
#include <stellatrain/batch/split_sampler.hpp>
#include <stellatrain/compress/chunked_compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pipeline/local_steps.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/pipeline/runtime_exchange.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/barrier.hpp>
#include <stellatrain/transport/group.hpp>
#include <stellatrain/transport/latency_probe.hpp>
#include <stellatrain/transport/metering.hpp>
#include <stellatrain/transport/rate_schedule.hpp>
#include <stellatrain/transport/shaping.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <span>
#include <thread>
#include <utility>

namespace fashion_mnist {
namespace {

namespace st = stellatrain;
namespace fm = fashion_mnist;

// Rank 0's clock: wall time of training, paused while it evaluates.
class training_clock {
 public:
  training_clock() : start_(now()) {}
  [[nodiscard]] double seconds() const {
    return std::chrono::duration<double>(now() - start_).count() - paused_;
  }
  template <class F>
  void paused(F&& f) {
    const auto t0 = now();
    f();
    paused_ += std::chrono::duration<double>(now() - t0).count();
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  std::chrono::steady_clock::time_point start_;
  double paused_ = 0;
};

// The learning rate of step `step` for a mode that starts at `start`: linear to s.lr_end over
// s.decay_steps steps, then constant.
float learning_rate(const settings& s, float start, std::uint64_t step) {
  if (s.decay_steps == 0) return start;
  const double f = std::min(1.0, static_cast<double>(step) / static_cast<double>(s.decay_steps));
  return static_cast<float>(start + (static_cast<double>(s.lr_end) - start) * f);
}

// Every mode runs over the rank's metered, type-erased link (see training.hpp).
using metered_link = st::metered_transport<st::any_transport>;

// The largest batch one rank computes (the model's buffers hold it).
std::uint64_t batch_capacity(const settings& s) {
  return static_cast<std::uint64_t>(std::max(s.batch, 500));
}

// The examples of this rank's steps: the global batch (s.batch per rank on average) split
// equally or by the ranks' measured speeds (--split), drawn so that an epoch uses every
// example once whatever the split. Also emulates the rank's device: with --device-rate R
// (over the rank's --slow-rank factor F), a rank whose forward and backward of b examples
// took less than b F / R waits for the rest, as that device would keep it busy; without, a
// slower rank waits (F - 1) times what they took. It reports the longer time.
class rank_batches {
 public:
  rank_batches(metered_link& t, const settings& s, const fm::data& d)
      : rank_(static_cast<std::size_t>(t.rank())),
        sampler_(d.train.count, s.seed),
        agreement_(t, {.global_batch = static_cast<std::uint64_t>(s.batch) *
                                       static_cast<std::uint64_t>(t.size()),
                       .bounds = {.min_per_rank = 1, .max_per_rank = batch_capacity(s)},
                       .interval = static_cast<std::uint64_t>(s.split_interval),
                       .adapt = s.split == "holistic",
                       .timeout = std::chrono::minutes(10)}),
        slowdown_(slowdown_of(s, t.rank())),
        device_rate_(s.device_rate / slowdown_) {}

  static double slowdown_of(const settings& s, int rank) {
    double f = 1;
    for (const auto& [r, factor] : s.slow_ranks)
      if (r == rank) f = factor;
    return f;
  }

  [[nodiscard]] int size() const { return static_cast<int>(agreement_.my_batch()); }
  [[nodiscard]] const std::vector<std::uint64_t>& split() const { return agreement_.split(); }
  [[nodiscard]] const st::batch_split_agreement<metered_link>& agreement() const {
    return agreement_;
  }

  // The inputs and labels of this rank's part of the next step.
  void next(const fm::dataset& d, std::vector<float>& x, std::vector<std::uint8_t>& y) {
    sampler_.next(agreement_.split(), rank_, indices_);
    x.resize(indices_.size() * fm::dataset::pixels);
    y.resize(indices_.size());
    for (std::size_t b = 0; b < indices_.size(); ++b) {
      std::copy_n(d.images.data() + indices_[b] * fm::dataset::pixels, fm::dataset::pixels,
                  x.data() + b * fm::dataset::pixels);
      y[b] = d.labels[indices_[b]];
    }
  }

  // Scales the gradient (the mean over this rank's examples) by b_i * P / B, so that the
  // exchange's average is the mean over the global batch.
  void weigh(std::span<float> grad) const {
    const double w = agreement_.my_weight();
    if (w == 1.0) return;
    for (auto& v : grad) v = static_cast<float>(v * w);
  }

  // After the forward and backward of next()'s batch took `seconds`: the emulated slowdown,
  // then the split's bookkeeping (in its decision steps a collective of all ranks).
  // Returns the seconds that bookkeeping took (no compute: the pipeline leaves it out).
  double computed(double seconds) {
    if (device_rate_ > 0) {
      const double device = static_cast<double>(size()) / device_rate_;
      if (device > seconds) {
        std::this_thread::sleep_for(std::chrono::duration<double>(device - seconds));
        seconds = device;
      }
    } else if (slowdown_ > 1) {
      std::this_thread::sleep_for(std::chrono::duration<double>((slowdown_ - 1) * seconds));
      seconds *= slowdown_;
    }
    const auto t0 = std::chrono::steady_clock::now();
    agreement_.end_step(seconds);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  std::size_t rank_;
  st::split_sampler sampler_;
  st::batch_split_agreement<metered_link> agreement_;
  double slowdown_;
  double device_rate_;
  std::vector<std::uint64_t> indices_;
};

// The uplinks' rate from --bandwidth-schedule, applied at step boundaries on this rank's
// training clock (evaluations do not advance it).
class link_schedule {
 public:
  link_schedule(const settings& s, std::shared_ptr<st::cluster_links> links)
      : links_(std::move(links)), initial_(s.bandwidth_mbps * 1e6) {
    if (!s.bandwidth_schedule.empty()) schedule_ = st::rate_schedule::parse(s.bandwidth_schedule);
    if (links_) links_->set_rate(initial_);
  }
  void at(double seconds) {
    if (!links_ || schedule_.empty()) return;
    const double rate = schedule_.rate_at(seconds, initial_);
    if (rate != applied_) {
      links_->set_rate(rate);
      applied_ = rate;
    }
  }
  [[nodiscard]] double mbps() const { return links_ ? links_->rate(0) / 1e6 : 0.0; }
  // Back to the starting rate for the next mode.
  ~link_schedule() {
    if (links_) links_->set_rate(initial_);
  }

 private:
  std::shared_ptr<st::cluster_links> links_;
  double initial_;
  double applied_ = -1;
  st::rate_schedule schedule_;
};

std::uint64_t steps_of(const settings& s, int ranks, const data& d) {
  const double per_step = static_cast<double>(ranks) * static_cast<double>(s.batch);
  return static_cast<std::uint64_t>(
      std::ceil(s.epochs * static_cast<double>(d.train.count) / per_step));
}

// Whether rank 0 evaluates after step `step` (counted from 0). Every rank then waits for it, so
// that no rank computes ahead while rank 0's clock is paused.
bool evaluates(const settings& s, std::uint64_t step, std::uint64_t steps) {
  return (step + 1) % static_cast<std::uint64_t>(s.eval_every) == 0 || step + 1 == steps;
}

// Evaluation and progress on rank 0; records when the target is first reached.
struct progress {
  const settings& s;
  const data& d;
  fm::mode_result& out;
  std::uint64_t steps;
  int ranks;
  double loss_sum = 0;
  int loss_count = 0;
  double last_loss = 0;
  double last_seconds = 0;
  std::uint64_t last_step = 0;

  // After each step: its end and the configuration it ran with.
  void stepped(const fm::step_point& point, float loss) {
    loss_sum += loss;
    ++loss_count;
    out.timeline.push_back(point);
  }

  // An evaluation after the last step (stepped() came first); the configuration is that step's
  // and the split's.
  // Returns whether the accuracy reached the target.
  bool record(fm::mlp& net, std::span<const float> params, std::uint64_t step, double seconds,
              std::uint64_t bytes, const rank_batches& batches, bool final_eval) {
    const fm::step_point& now = out.timeline.back();
    std::vector<double> compute;
    for (const auto& sample : batches.agreement().latest_samples())
      compute.push_back(sample.seconds);
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
    const double step_seconds =
        step > last_step ? (seconds - last_seconds) / static_cast<double>(step - last_step) : 0.0;
    if (step > last_step) {
      last_seconds = seconds;
      last_step = step;
    }
    out.curve.push_back({seconds, step, epoch, loss, acc, bytes, now.density, step_seconds,
                         now.bandwidth_mbps, now.link_mbps, batches.split(), std::move(compute)});
    if (!out.time_to_target && acc >= s.target && !final_eval) {
      out.time_to_target = seconds;
      out.steps_to_target = step;
    }
    if (final_eval) out.final_accuracy = acc;
    std::string split;
    for (auto b : batches.split()) split += (split.empty() ? "" : ",") + std::to_string(b);
    std::printf(
        "  %-11s step %4llu/%llu  epoch %.2f  loss %.4f  acc %5.2f%%%s  %7.1f s  %9.2f MB sent  "
        "density %.4f  %5.0f ms/step  batches %s\n",
        out.mode.c_str(), static_cast<unsigned long long>(step),
        static_cast<unsigned long long>(steps), epoch, loss, acc * 100,
        final_eval ? " (full test set)" : "               ", seconds,
        static_cast<double>(bytes) / 1e6, now.density, step_seconds * 1e3, split.c_str());
    std::fflush(stdout);
    return acc >= s.target;
  }

  // The evaluation on the full test set after the last step (`ran` steps: all, or fewer where
  // the mode stopped at its target), and the mode's totals.
  void finish(fm::mlp& net, std::span<const float> params, std::uint64_t ran, double seconds,
              std::uint64_t bytes, const rank_batches& batches) {
    out.seconds = seconds;
    out.steps = ran;
    out.bytes = bytes;
    out.parameters = params.size();
    record(net, params, ran, seconds, bytes, batches, true);
    out.split_changes = batches.agreement().changes();
  }
};

// Both tiers of the hierarchical modes are views of that link (the LAN: the cluster's ranks).
using group_link = st::group_transport<metered_link>;

std::uint64_t sent_bytes(metered_link& t) { return t.snapshot().total.bytes_sent; }

group_link everyone(metered_link& t) {
  std::vector<int> all(static_cast<std::size_t>(t.size()));
  for (int r = 0; r < t.size(); ++r) all[static_cast<std::size_t>(r)] = r;
  return group_link(t, std::move(all));
}

group_link cluster_of(metered_link& t, const st::cluster_topology& topo) {
  const int c = topo.cluster_of(t.rank());
  std::vector<int> members;
  for (int j = 0; j < topo.size_of(c); ++j) members.push_back(topo.global_rank(c, j));
  return group_link(t, std::move(members));
}

// The bytes this rank has sent to ranks of other clusters.
std::uint64_t wan_bytes(metered_link& t, const st::cluster_topology& topo) {
  const auto snap = t.snapshot();
  const int c = topo.cluster_of(t.rank());
  std::uint64_t n = 0;
  for (std::size_t r = 0; r < snap.peers.size(); ++r)
    if (topo.cluster_of(static_cast<int>(r)) != c) n += snap.peers[r].bytes_sent;
  return n;
}

// One mode's run on this rank: rank 0's progress, the training clock, and what the mode put
// on the links, without the trainer's own bookkeeping at its evaluations (a sum over the ranks
// in place of a barrier): that is no part of any mode's exchange. Every mode is quiescent
// there (its exchanges done), so what the links carry meanwhile is the bookkeeping's alone,
// and it is left out of every later figure. `Params` of evaluate and finish: a callable
// returning the parameters every rank agrees on.
class mode_run {
 public:
  // Collective (a barrier): every rank starts counting at the same point.
  mode_run(metered_link& t, const st::cluster_topology& topo, const settings& s, const data& d,
           fm::mode_result* out, std::uint64_t steps)
      : t_(t), topo_(topo), stop_at_target_(s.stop_at_target) {
    if (t.rank() == 0) prog_.emplace(progress{s, d, *out, steps, t.size()});
    st::barrier(t);
    sent0_ = sent_bytes(t);
    wan0_ = wan_bytes(t, topo);
    clock_ = training_clock();
  }

  [[nodiscard]] training_clock& clock() noexcept { return clock_; }

  // After every step: its end and configuration (rank 0 keeps them).
  void stepped(const fm::step_point& point, float loss) {
    ran_ = point.step;
    now_ = point.seconds;
    if (prog_) prog_->stepped(point, loss);
  }

  // Collective, at an evaluation after the last step, on a paused clock: rank 0 evaluates;
  // every rank learns whether the mode stops there (--stop-at-target).
  template <class Params>
  bool evaluate(fm::mlp& net, Params&& params, const rank_batches& batches) {
    bool stop = false;
    clock_.paused([&] {
      stop = bookkeeping([&] {
        return prog_ && prog_->record(net, params(), ran_, now_, sent(), batches, false);
      });
    });
    return stop;
  }

  // Collective, after the last step: the evaluation on the full test set and the mode's
  // totals (rank 0's), then a barrier before the next mode.
  template <class Params>
  void finish(fm::mlp& net, Params&& params, const rank_batches& batches, fm::mode_result* out) {
    const double seconds = clock_.seconds();
    bookkeeping([&] {
      if (prog_) prog_->finish(net, params(), ran_, seconds, sent(), batches);
      return false;
    });
    if (out) out->wan_bytes_per_cluster = wan_per_cluster_;
    st::barrier(t_);
  }

 private:
  // Bytes this rank sent in the mode so far.
  [[nodiscard]] std::uint64_t sent() const { return sent_bytes(t_) - sent0_ - excluded_sent_; }

  // Collective: rank 0 evaluates (`evaluate` returns whether the target was reached), then
  // every rank learns the bytes that left each cluster so far and whether the mode stops.
  template <class Evaluate>
  bool bookkeeping(Evaluate&& evaluate) {
    const std::uint64_t sent_before = sent_bytes(t_);
    const std::uint64_t wan_before = wan_bytes(t_, topo_);
    const bool reached = evaluate();
    // One sum: each cluster's WAN bytes (its ranks' shares), then rank 0's decision.
    std::vector<std::uint64_t> sums(static_cast<std::size_t>(topo_.clusters()) + 1, 0);
    sums[static_cast<std::size_t>(topo_.cluster_of(t_.rank()))] =
        wan_before - wan0_ - excluded_wan_;
    sums.back() = t_.rank() == 0 && reached && stop_at_target_ ? 1 : 0;
    st::dense_allreduce(t_, std::span<std::uint64_t>(sums), {.tag = 7});
    excluded_sent_ += sent_bytes(t_) - sent_before;
    excluded_wan_ += wan_bytes(t_, topo_) - wan_before;
    std::uint64_t wan = 0;
    for (std::size_t c = 0; c + 1 < sums.size(); ++c) wan += sums[c];
    wan_per_cluster_ = wan / static_cast<std::uint64_t>(topo_.clusters());
    if (prog_) prog_->out.curve.back().wan_bytes = wan_per_cluster_;
    return sums.back() != 0;
  }

  metered_link& t_;
  const st::cluster_topology& topo_;
  bool stop_at_target_;
  std::optional<progress> prog_;
  training_clock clock_;
  std::uint64_t sent0_ = 0;
  std::uint64_t wan0_ = 0;
  std::uint64_t excluded_sent_ = 0;
  std::uint64_t excluded_wan_ = 0;
  std::uint64_t wan_per_cluster_ = 0;
  std::uint64_t ran_ = 0;  // steps so far
  double now_ = 0;         // the last step's end
};

// The model, its parameters initialised from `seed`.
fm::mlp make_model(const settings& s, std::vector<float>& params, std::uint64_t seed) {
  fm::mlp net({static_cast<int>(fm::dataset::pixels), s.hidden, s.hidden, fm::dataset::classes},
              static_cast<int>(batch_capacity(s)));
  params.resize(net.parameter_count());
  net.initialize(params, seed);
  return net;
}

// ---------------------------------------------------------------------------------- dense
// Hierarchical dense exchange: reduce-scatter inside the cluster, all-reduce of the shard
// among its owners in every cluster, all-gather of the shards inside the cluster. Needs
// clusters of equal size (the owners of shard j are the ranks of local rank j).
class dense_hierarchy {
 public:
  dense_hierarchy(metered_link& t, const st::cluster_topology& topo)
      : lan_(cluster_of(t, topo)), owners_(owners(t, topo)), shards_(lan_.size()) {}

  void allreduce(std::span<float> grad, int ranks) {
    const auto timeout = std::chrono::minutes(10);
    st::dense_reduce_scatter(lan_, grad, {.tag = 2, .timeout = timeout}, lan_ws_);
    const auto mine = st::segment_of(grad.size(), lan_.size(), lan_.rank());
    const auto shard = grad.subspan(mine.begin, mine.size());
    st::dense_allreduce(owners_, shard, {.tag = 3, .timeout = timeout}, owners_ws_);
    const float inv = 1.0f / static_cast<float>(ranks);
    for (auto& v : shard) v *= inv;
    st::sparse_allgather(lan_, std::as_bytes(shard), std::span<st::message_buffer>(shards_),
                         {.tag = 4, .timeout = timeout}, lan_ws_);
    for (int j = 0; j < lan_.size(); ++j) {
      const auto seg = st::segment_of(grad.size(), lan_.size(), j);
      const auto& m = shards_[static_cast<std::size_t>(j)];
      if (m.size() != seg.size() * sizeof(float))
        throw st::error(st::errc::size_mismatch, "dense-hier: a shard of the wrong size");
      std::memcpy(grad.data() + seg.begin, m.data(), m.size());
    }
  }

 private:
  static group_link owners(metered_link& t, const st::cluster_topology& topo) {
    const int j = topo.local_rank(t.rank());
    std::vector<int> members;
    for (int c = 0; c < topo.clusters(); ++c) {
      if (topo.size_of(c) != topo.size_of(0)) {
        throw st::error(st::errc::invalid_argument,
                        "dense-hier needs clusters of equal size, not " + topo.to_string());
      }
      members.push_back(topo.global_rank(c, j));
    }
    return group_link(t, std::move(members));
  }
  group_link lan_;
  group_link owners_;
  std::vector<st::message_buffer> shards_;
  st::collective_workspace<group_link> lan_ws_;
  st::collective_workspace<group_link> owners_ws_;
};

void run_dense(metered_link& t, const st::cluster_topology& topo, bool hierarchical,
               const settings& s, const data& d, link_schedule& links, fm::mode_result* out) {
  const int ranks = t.size();
  std::optional<dense_hierarchy> hier;
  if (hierarchical) hier.emplace(t, topo);
  std::vector<float> params;
  // The same seed on every rank: an identical start, as DDP's broadcast gives.
  fm::mlp net = make_model(s, params, s.seed);
  st::adam_optimizer adam({.lr = s.lr});
  adam.add_tensor(params);
  std::vector<float> grad(params.size());
  rank_batches batches(t, s, d);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  st::collective_workspace<metered_link> ws;
  const auto model = [&] { return std::span<const float>(adam.params(0)); };
  mode_run run(t, topo, s, d, out, steps);
  training_clock& clock = run.clock();
  for (std::uint64_t step = 0; step < steps; ++step) {
    links.at(clock.seconds());
    batches.next(d.train, x, y);
    const auto c0 = std::chrono::steady_clock::now();
    const float loss =
        net.forward_backward(adam.params(0), x.data(), y.data(), batches.size(), grad);
    batches.weigh(grad);
    batches.computed(std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count());
    if (hier) {
      hier->allreduce(std::span<float>(grad), ranks);
    } else {
      st::dense_allreduce(t, std::span<float>(grad),
                          {.tag = 1, .timeout = std::chrono::minutes(10), .average = true}, ws);
    }
    adam.set_lr(learning_rate(s, s.lr, step));
    adam.step(0, std::span<const float>(grad));
    run.stepped({step + 1, clock.seconds(), 1.0, 0.0, links.mbps(), 0.0}, loss);
    if (evaluates(s, step, steps) && run.evaluate(net, model, batches)) break;
  }
  run.finish(net, model, batches, out);
}

// ---------------------------------------------------------------------------------- diloco
// DiLoCo as published (Douillard et al., arXiv 2311.08105), written here from the paper, not
// the authors' code: every rank trains its replica with its own Adam for H steps (--diloco-steps)
// at the dense modes' rate (the paper's inner optimizer is its data-parallel baseline's);
// then the pseudo-gradients (outer - replica) are averaged in fp32 by a dense all-reduce
// (hierarchical, as dense-hier, where the clusters are of one size), an outer SGD with Nesterov
// momentum (the paper's lr 0.7, momentum 0.9) steps the outer parameters, and every replica
// becomes them. Evaluations read the outer parameters.
void run_diloco(metered_link& t, const st::cluster_topology& topo, const settings& s, const data& d,
                link_schedule& links, fm::mode_result* out) {
  const int ranks = t.size();
  bool equal_clusters = topo.clusters() > 1;
  for (int c = 0; c < topo.clusters(); ++c)
    equal_clusters = equal_clusters && topo.size_of(c) == topo.size_of(0);
  std::optional<dense_hierarchy> hier;
  if (equal_clusters) hier.emplace(t, topo);
  std::vector<float> params;
  // The same seed on every rank: an identical start, as DDP's broadcast gives.
  fm::mlp net = make_model(s, params, s.seed);
  st::sgd_optimizer outer_opt({.lr = 0.7f, .momentum = 0.9f, .nesterov = true});
  outer_opt.add_tensor(params);
  st::adam_optimizer inner({.lr = s.lr});
  inner.add_tensor(params);
  const std::span<float> replica = inner.params(0);
  const std::span<const float> outer = outer_opt.params(0);
  const auto read_outer = [&] { return outer; };
  std::vector<float> grad(params.size());
  std::vector<float> pseudo(params.size());
  rank_batches batches(t, s, d);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  const auto inner_steps = static_cast<std::uint64_t>(s.diloco_steps);
  st::collective_workspace<metered_link> ws;
  mode_run run(t, topo, s, d, out, steps);
  training_clock& clock = run.clock();
  for (std::uint64_t step = 0; step < steps; ++step) {
    links.at(clock.seconds());
    batches.next(d.train, x, y);
    const auto c0 = std::chrono::steady_clock::now();
    const float loss = net.forward_backward(replica, x.data(), y.data(), batches.size(), grad);
    batches.computed(std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count());
    inner.set_lr(learning_rate(s, s.lr, step));
    inner.step(0, std::span<const float>(grad));
    if ((step + 1) % inner_steps == 0) {
      for (std::size_t i = 0; i < pseudo.size(); ++i) pseudo[i] = outer[i] - replica[i];
      if (hier) {
        hier->allreduce(std::span<float>(pseudo), ranks);
      } else {
        st::dense_allreduce(t, std::span<float>(pseudo),
                            {.tag = 1, .timeout = std::chrono::minutes(10), .average = true}, ws);
      }
      outer_opt.step(0, std::span<const float>(pseudo));
      std::copy(outer.begin(), outer.end(), replica.begin());
    }
    run.stepped({step + 1, clock.seconds(), 1.0, 0.0, links.mbps(), 0.0}, loss);
    if (evaluates(s, step, steps) && run.evaluate(net, read_outer, batches)) break;
  }
  run.finish(net, read_outer, batches, out);
}

// ---------------------------------------------------------------------------------- stellatrain
// The sparse all-gather of the stellatrain modes. In one process every rank's shaped link
// carries its P-1 copies at the link rate whatever the order: the direct all-gather pays the
// latency once. Over real TCP the automatic choice (a ring for more than 2 ranks) keeps one
// flow per link.
st::allgather_algorithm allgather_of(const settings& s) {
  return s.allgather == "direct"      ? st::allgather_algorithm::direct
         : s.allgather == "ring"      ? st::allgather_algorithm::ring
         : s.transport == "inprocess" ? st::allgather_algorithm::direct
                                      : st::allgather_algorithm::automatic;
}

void run_stellatrain(metered_link& t, const st::cluster_topology& topo, bool hierarchical,
                     const settings& s, const data& d, link_schedule& links, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  group_link wan = everyone(t);
  group_link lan = cluster_of(t, topo);
  std::vector<float> params;
  // Another start on every rank: the pipeline broadcasts rank 0's values.
  fm::mlp net = make_model(s, params, s.seed + static_cast<std::uint64_t>(r));
  st::thread_pool pool{1};
  // The controller charges each exchange its latency: known where the library shapes the
  // links, else measured (the emulated or real network is the link).
  const double latency_s =
      s.shaped() ? s.rtt_ms / 2000.0
                 : st::measure_latency(t, {.tag = 8, .timeout = std::chrono::minutes(10)});
  using compressor = st::error_feedback_compressor<st::threshold_selector<>, st::bf16>;
  using exchange = st::runtime_exchange<group_link, compressor>;
  using pipeline = st::pipeline<exchange, st::thread_pool, st::adam_optimizer>;
  const st::allgather_algorithm allgather = allgather_of(s);
  const auto make = [&](exchange how) {
    return std::make_unique<pipeline>(
        std::move(how), pool, st::adam_optimizer({.lr = s.sparse_lr}),
        st::pipeline_options{.bucket_bytes = std::uint64_t{4} << 20,
                             .staleness = s.staleness,
                             .send_all_below = 4096,
                             .exchange_threads = 4,
                             .algorithm = allgather,
                             .timeout = std::chrono::minutes(10)},
        st::adaptive_density_controller(
            {.min_density = s.min_density,
             .max_density = s.max_density,
             .initial_density = std::min(s.max_density, std::max(s.min_density, 0.01)),
             .latency_seconds = latency_s}));
  };
  const std::unique_ptr<pipeline> owned =
      hierarchical
          ? make(exchange(st::hierarchical_links<group_link>{lan, wan, topo}, compressor()))
          : make(exchange(wan, compressor()));
  pipeline& p = *owned;
  for (const auto& tensor : net.tensors()) {
    p.add_tensor(tensor.id, std::span<const float>(params).subspan(tensor.offset, tensor.size));
  }
  p.start();
  std::vector<float> grad(params.size());
  rank_batches batches(t, s, d);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  const auto& tensors = net.tensors();
  auto copy_params = [&](std::size_t i) {
    p.copy_params(i, std::span<float>(params).subspan(tensors[i].offset, tensors[i].size));
  };
  auto fetch = [&] {  // before the forward pass: each bucket once its gate opens
    for (std::size_t b = 0; b < p.bucket_count(); ++b) {
      p.wait_for_forward(b);
      const auto range = p.bucket(b);
      for (std::size_t i = range.first_tensor; i < range.first_tensor + range.tensor_count; ++i) {
        copy_params(i);
      }
    }
  };
  auto fetch_all = [&] {  // every update handed over so far applied
    p.flush();
    for (std::size_t i = 0; i < tensors.size(); ++i) copy_params(i);
  };
  const auto model = [&] { return std::span<const float>(params); };
  mode_run run(t, topo, s, d, out, steps);
  training_clock& clock = run.clock();
  for (std::uint64_t step = 0; step < steps; ++step) {
    fetch();
    // With staleness 1 the previous step may still be applied, at its own rate.
    p.set_lr(learning_rate(s, s.sparse_lr, step));
    links.at(clock.seconds());
    batches.next(d.train, x, y);
    const auto c0 = std::chrono::steady_clock::now();
    const float loss = net.forward_backward(params, x.data(), y.data(), batches.size(), grad);
    batches.weigh(grad);
    p.exclude_from_compute(batches.computed(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count()));
    for (std::size_t i = tensors.size(); i-- > 0;) {  // backward order: last layer first
      p.push_gradient(i, std::span<const float>(grad).subspan(tensors[i].offset, tensors[i].size));
    }
    // Evaluations see every update through this step; waiting for them is training time (with
    // staleness 0 the next step would wait as long).
    const bool evaluated = evaluates(s, step, steps);
    if (evaluated) fetch_all();
    run.stepped({step + 1, clock.seconds(), p.stats().last_density,
                 p.policy().bandwidth() * 8 / 1e6, links.mbps(), p.policy().latency() * 1e3},
                loss);
    if (evaluated) {
      const auto e0 = std::chrono::steady_clock::now();
      const bool stop = run.evaluate(net, model, batches);
      p.exclude_from_compute(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count());
      if (stop) break;
    }
  }
  fetch_all();
  run.finish(net, model, batches, out);
}

// Local steps: every rank trains its replica with its own Adam for H steps; then the
// pseudo-gradients (outer - replica) go through the chunked codec (--local-topk of every 4096,
// --local-bits values, error feedback with decay 0.95) and a plain outer SGD of rate 1, and
// every replica becomes the outer parameters. With several clusters the exchange is the
// hierarchical one (reduced inside each cluster, each cluster's selection over its uplink
// once), else the flat sparse all-gather. Evaluations read the outer parameters, the model
// every rank agrees on.
void run_local(metered_link& t, const st::cluster_topology& topo, const settings& s, const data& d,
               link_schedule& links, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  group_link wan = everyone(t);
  group_link lan = cluster_of(t, topo);
  std::vector<float> params;
  fm::mlp net = make_model(s, params, s.seed + static_cast<std::uint64_t>(r));
  st::thread_pool pool{1};
  const double density = s.local_topk / 4096.0;
  using compressor = st::chunked_compressor<>;
  using exchange = st::runtime_exchange<group_link, compressor>;
  const st::chunked_compressor_options codec{
      .chunk_bits = 12,
      .bits = s.local_bits == 1 ? st::chunk_value_bits::one : st::chunk_value_bits::two,
      .decay = 0.95f};
  st::pipeline p(topo.clusters() > 1 ? exchange(st::hierarchical_links<group_link>{lan, wan, topo},
                                                compressor(codec))
                                     : exchange(wan, compressor(codec)),
                 pool, st::sgd_optimizer({.lr = 1.0f}),
                 st::pipeline_options{.bucket_bytes = std::uint64_t{4} << 20,
                                      .staleness = 0,
                                      .exchange_threads = 4,
                                      .algorithm = allgather_of(s),
                                      .timeout = std::chrono::minutes(10)},
                 st::fixed_density{density});
  const auto& tensors = net.tensors();
  for (const auto& tensor : tensors) {
    p.add_tensor(tensor.id, std::span<const float>(params).subspan(tensor.offset, tensor.size));
  }
  p.start();
  // The replica: the inner optimizer's parameters, from the outer ones (rank 0's).
  st::adam_optimizer inner({.lr = s.sparse_lr});
  std::vector<std::span<float>> replica;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto slice = std::span<float>(params).subspan(tensors[i].offset, tensors[i].size);
    p.copy_params(i, slice);
    replica.push_back(inner.params(inner.add_tensor(slice)));
  }
  st::local_steps loop(p, {.inner_steps = static_cast<std::uint32_t>(s.local_steps)});
  std::vector<float> grad(params.size());
  std::vector<float> outer(params.size());
  rank_batches batches(t, s, d);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  const auto read_outer = [&] {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      p.copy_params(i, std::span<float>(outer).subspan(tensors[i].offset, tensors[i].size));
    return std::span<const float>(outer);
  };
  mode_run run(t, topo, s, d, out, steps);
  training_clock& clock = run.clock();
  for (std::uint64_t step = 0; step < steps; ++step) {
    inner.set_lr(learning_rate(s, s.sparse_lr, step));
    links.at(clock.seconds());
    for (std::size_t i = 0; i < tensors.size(); ++i)
      std::copy(replica[i].begin(), replica[i].end(), params.begin() + tensors[i].offset);
    batches.next(d.train, x, y);
    const auto c0 = std::chrono::steady_clock::now();
    const float loss = net.forward_backward(params, x.data(), y.data(), batches.size(), grad);
    p.exclude_from_compute(batches.computed(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count()));
    for (std::size_t i = 0; i < tensors.size(); ++i)
      inner.step(i, std::span<const float>(grad).subspan(tensors[i].offset, tensors[i].size));
    loop.step(replica);
    run.stepped({step + 1, clock.seconds(), density, 0, links.mbps(), 0}, loss);
    if (evaluates(s, step, steps)) {
      const auto e0 = std::chrono::steady_clock::now();
      const bool stop = run.evaluate(net, read_outer, batches);
      p.exclude_from_compute(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count());
      if (stop) break;
    }
  }
  run.finish(net, read_outer, batches, out);
}

void run_modes(metered_link& t, const st::cluster_topology& topo, const settings& s, const data& d,
               const std::shared_ptr<st::cluster_links>& uplinks,
               std::vector<fm::mode_result>* results) {
  static const char* what[] = {
      "averaged gradients through a dense ring all-reduce over every rank",
      "reduce-scatter inside each cluster, all-reduce between clusters, all-gather inside",
      "DiLoCo, written from the paper: H inner Adam steps, fp32 pseudo-gradients all-reduced, "
      "outer Nesterov SGD",
      "top-k + error feedback, sparse all-gather over every rank, CPU Adam, adaptive density",
      "reduce inside each cluster, top-k of each rank's shard, sparse exchange between clusters",
      "local steps: H inner Adam steps, pseudo-gradients as k of every 4096 in 1 or 2 bits, "
      "hierarchical between clusters, outer SGD"};
  for (const auto& mode : s.modes) {
    std::size_t m = 0;
    while (fm::mode_names[m] != mode) ++m;
    if (t.rank() == 0) std::printf("\n== %s: %s\n", mode.c_str(), what[m]);
    fm::mode_result res;
    res.mode = mode;
    fm::mode_result* out = t.rank() == 0 ? &res : nullptr;
    const bool hierarchical = mode.ends_with("-hier");
    link_schedule links(s, uplinks);
    if (mode.starts_with("dense")) {
      run_dense(t, topo, hierarchical, s, d, links, out);
    } else if (mode == "diloco") {
      run_diloco(t, topo, s, d, links, out);
    } else if (mode == "stellatrain-local") {
      run_local(t, topo, s, d, links, out);
    } else {
      run_stellatrain(t, topo, hierarchical, s, d, links, out);
    }
    if (t.rank() == 0) results->push_back(std::move(res));
  }
}

}  // namespace

void train(st::any_transport rank_link, const st::cluster_topology& topology, const settings& s,
           const data& d, const std::shared_ptr<st::cluster_links>& uplinks,
           std::vector<mode_result>* results) {
  metered_link t(std::move(rank_link));
  topology.check_world(t.size(), "--clusters");
  for (const auto& [r, factor] : s.slow_ranks) {
    if (r >= t.size()) {
      throw st::error(st::errc::invalid_argument, "--slow-rank " + std::to_string(r) + ":" +
                                                      std::to_string(factor) + ": only " +
                                                      std::to_string(t.size()) + " ranks");
    }
  }
  run_modes(t, topology, s, d, uplinks, results);
}

}  // namespace fashion_mnist
