// SPDX-License-Identifier: Apache-2.0
// The modes, each over the rank's metered link: "dense" (the averaged gradient through a dense
// ring all-reduce, as PyTorch DDP does), "dense-hier" (reduced inside each cluster, all-reduced
// between clusters, as a topology-aware all-reduce does), "stellatrain" (the pipeline: top-k
// selection with error feedback, packing, sparse all-gather, the CPU optimizer and the
// bandwidth-adaptive density controller) and "stellatrain-hier" (the pipeline's hierarchical
// exchange: each cluster's uplink carries its selection once).
#include "training.hpp"

#include "mlp.hpp"

#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/barrier.hpp>
#include <stellatrain/transport/group.hpp>
#include <stellatrain/transport/metering.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <span>
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

// Every mode runs over the rank's metered, type-erased link (see training.hpp).
using metered_link = st::metered_transport<st::any_transport>;

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

// Collective: the mean over the clusters of the bytes that left each since `mine0` (this
// rank's wan_bytes at the start).
std::uint64_t wan_bytes_per_cluster(metered_link& t, const st::cluster_topology& topo,
                                    std::uint64_t mine0) {
  std::vector<std::uint64_t> per_cluster(static_cast<std::size_t>(topo.clusters()), 0);
  per_cluster[static_cast<std::size_t>(topo.cluster_of(t.rank()))] = wan_bytes(t, topo) - mine0;
  st::dense_allreduce(t, std::span<std::uint64_t>(per_cluster), {.tag = 7});
  std::uint64_t sum = 0;
  for (auto b : per_cluster) sum += b;
  return sum / per_cluster.size();
}

// The model, its parameters initialised from `seed`.
fm::mlp make_model(const settings& s, std::vector<float>& params, std::uint64_t seed) {
  fm::mlp net({static_cast<int>(fm::dataset::pixels), s.hidden, s.hidden, fm::dataset::classes},
              std::max(s.batch, 500));
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
               const settings& s, const data& d, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  std::optional<dense_hierarchy> hier;
  if (hierarchical) hier.emplace(t, topo);
  std::vector<float> params;
  // The same seed on every rank: an identical start, as DDP's broadcast gives.
  fm::mlp net = make_model(s, params, s.seed);
  st::adam_optimizer adam({.lr = s.lr});
  adam.add_tensor(params);
  std::vector<float> grad(params.size());
  const shard my_shard(d.train.count, r, ranks, s.seed);
  std::vector<float> x;
  std::vector<std::uint8_t> y;
  const std::uint64_t steps = steps_of(s, ranks, d);
  st::collective_workspace<metered_link> ws;
  std::optional<progress> prog;
  if (r == 0) prog.emplace(progress{s, d, *out, steps, ranks});
  st::barrier(t);
  const std::uint64_t bytes0 = sent_bytes(t);
  const std::uint64_t wan0 = wan_bytes(t, topo);
  training_clock clock;
  for (std::uint64_t step = 0; step < steps; ++step) {
    my_shard.batch(d.train, step, s.batch, x, y);
    const float loss = net.forward_backward(adam.params(0), x.data(), y.data(), s.batch, grad);
    if (hier) {
      hier->allreduce(std::span<float>(grad), ranks);
    } else {
      st::dense_allreduce(t, std::span<float>(grad),
                          {.tag = 1, .timeout = std::chrono::minutes(10), .average = true}, ws);
    }
    adam.set_learning_rate(learning_rate(s, s.lr, step));
    adam.step(0, std::span<const float>(grad));
    if (prog) {
      prog->loss_sum += loss;
      ++prog->loss_count;
      if ((step + 1) % static_cast<std::uint64_t>(s.eval_every) == 0 || step + 1 == steps) {
        const double now = clock.seconds();
        clock.paused([&] {
          prog->record(net, adam.params(0), step + 1, now, sent_bytes(t) - bytes0, 1.0, false);
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
  const std::uint64_t wan = wan_bytes_per_cluster(t, topo, wan0);
  if (out) out->wan_bytes_per_cluster = wan;
  st::barrier(t);
}

// ---------------------------------------------------------------------------------- stellatrain
void run_stellatrain(metered_link& t, const st::cluster_topology& topo, bool hierarchical,
                     const settings& s, const data& d, fm::mode_result* out) {
  const int r = t.rank();
  const int ranks = t.size();
  group_link wan = everyone(t);
  group_link lan = cluster_of(t, topo);
  std::vector<float> params;
  // Another start on every rank: the pipeline broadcasts rank 0's values.
  fm::mlp net = make_model(s, params, s.seed + static_cast<std::uint64_t>(r));
  st::thread_pool pool{1};
  const double latency_s = s.rtt_ms / 2000.0;
  using compressor = st::error_feedback_compressor<st::threshold_selector<>, st::bf16>;
  using pipeline = st::pipeline<compressor, group_link, st::adam_optimizer, st::thread_pool>;
  const auto make = [&](auto&& links) {
    return std::make_unique<pipeline>(
        links, pool, compressor(), st::adam_optimizer({.lr = s.sparse_lr}),
        // In one process every rank's shaped link carries its P-1 copies at the link
        // rate whatever the order: the direct all-gather pays the latency once. Over
        // real TCP the automatic choice (a ring for more than 2 ranks) keeps one flow
        // per link.
        st::pipeline_options{.bucket_bytes = std::uint64_t{4} << 20,
                             .staleness = s.staleness,
                             .send_all_below = 4096,
                             .exchange_threads = 4,
                             .algorithm = s.transport == "inprocess"
                                              ? st::allgather_algorithm::direct
                                              : st::allgather_algorithm::automatic,
                             .timeout = std::chrono::minutes(10)},
        st::adaptive_density_controller(
            {.min_density = s.min_density,
             .max_density = s.max_density,
             .initial_density = std::min(s.max_density, std::max(s.min_density, 0.01)),
             .latency_seconds = latency_s}));
  };
  const std::unique_ptr<pipeline> owned =
      hierarchical ? make(st::hierarchical_links<group_link>{lan, wan, topo}) : make(wan);
  pipeline& p = *owned;
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
  st::barrier(t);
  const std::uint64_t bytes0 = sent_bytes(t);
  const std::uint64_t wan0 = wan_bytes(t, topo);
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
          fetch_all();  // evaluate with every update through this step
          prog->record(net, params, step + 1, now, sent_bytes(t) - bytes0, density, false);
        });
      }
    }
  }
  fetch_all();
  if (prog) {
    out->seconds = clock.seconds();
    out->steps = steps;
    out->bytes = sent_bytes(t) - bytes0;
    prog->record(net, params, steps, out->seconds, out->bytes, p.stats().last_density, true);
  }
  const std::uint64_t wan_total = wan_bytes_per_cluster(t, topo, wan0);
  if (out) out->wan_bytes_per_cluster = wan_total;
  st::barrier(t);
}

void run_modes(metered_link& t, const st::cluster_topology& topo, const settings& s, const data& d,
               std::vector<fm::mode_result>* results) {
  static const char* what[] = {
      "averaged gradients through a dense ring all-reduce over every rank",
      "reduce-scatter inside each cluster, all-reduce between clusters, all-gather inside",
      "top-k + error feedback, sparse all-gather over every rank, CPU Adam, adaptive density",
      "reduce inside each cluster, top-k of each rank's shard, sparse exchange between clusters"};
  for (const auto& mode : s.modes) {
    std::size_t m = 0;
    while (fm::mode_names[m] != mode) ++m;
    if (t.rank() == 0) std::printf("\n== %s: %s\n", mode.c_str(), what[m]);
    fm::mode_result res;
    res.mode = mode;
    fm::mode_result* out = t.rank() == 0 ? &res : nullptr;
    const bool hierarchical = mode.ends_with("-hier");
    if (mode.starts_with("dense")) {
      run_dense(t, topo, hierarchical, s, d, out);
    } else {
      run_stellatrain(t, topo, hierarchical, s, d, out);
    }
    if (t.rank() == 0) results->push_back(std::move(res));
  }
}

}  // namespace

void train(st::any_transport rank_link, const st::cluster_topology& topology, const settings& s,
           const data& d, std::vector<mode_result>* results) {
  metered_link t(std::move(rank_link));
  topology.check_world(t.size(), "--clusters");
  run_modes(t, topology, s, d, results);
}

}  // namespace fashion_mnist
