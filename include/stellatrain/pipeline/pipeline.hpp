// SPDX-License-Identifier: Apache-2.0
// The pipeline a data-parallel trainer instantiates: per gradient bucket, select with error
// feedback, pack, exchange, unpack and aggregate, and step the CPU optimizer, with buckets and
// steps in flight concurrently and the density chosen per step from measurements.
#pragma once

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/optim/optimizer_concepts.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/bucket_plan.hpp>
#include <stellatrain/pipeline/checkpoint.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/hierarchical_exchange.hpp>
#include <stellatrain/pipeline/param_changes.hpp>
#include <stellatrain/pipeline/step_reports.hpp>
#include <stellatrain/pipeline/update_log.hpp>
#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/broadcast.hpp>
#include <stellatrain/transport/concept.hpp>

#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace stellatrain {

/// Settings of a `pipeline`. Every rank must use the same values (except `timeout`).
struct pipeline_options {
  /// Target fp32 gradient bytes per bucket (see `plan_buckets`); 0: one bucket per tensor.
  std::uint64_t bucket_bytes = std::uint64_t{4} << 20;
  /// 0: the forward of step t+1 sees every update through step t. 1: it may start with the
  /// updates through step t-1 (step t's exchange and optimizer overlap the next compute).
  int staleness = 1;
  /// Gradient hand-overs per tensor and step; the pipeline averages them.
  std::uint32_t micro_batches = 1;
  /// How the ranks' selections combine: `reduction::mean` (data-parallel averaging) or sum.
  reduction op = reduction::mean;
  /// Index encoding on the wire (`automatic`: the smallest per section).
  index_encoding wire_indices = index_encoding::automatic;
  /// Every tensor sends at least this many elements per step (when it has them).
  std::uint64_t min_k = 1;
  /// Tensors of at most this many elements are sent whole every step (biases, norms).
  std::uint64_t send_all_below = 0;
  /// Threads that run exchanges; bucket b's exchanges run on thread b mod exchange_threads,
  /// so that the latency of one bucket's exchange overlaps the transfer of another's.
  int exchange_threads = 2;
  /// Algorithm of the sparse all-gather.
  allgather_algorithm algorithm = allgather_algorithm::automatic;
  /// Bound on every wait: a collective, a gate, a hand-over waiting for a free slot.
  std::chrono::milliseconds timeout{120'000};
  /// Tags [tag_base, tag_base + 16384) are the pipeline's; tag_base + 16384 is its broadcast
  /// and tag_base + 16385 the topology check of a hierarchical pipeline.
  tag_type tag_base = 4096;
  /// Aggregation scatters into a dense gradient from this many received pairs per element.
  double dense_threshold = 0.25;
};

/// Totals of a pipeline's work on this rank.
struct pipeline_stats {
  std::uint64_t steps_applied = 0;  ///< steps whose every bucket is applied
  std::uint64_t bytes_sent = 0;     ///< packed bytes this rank contributed (its own messages)
  std::uint64_t link_bytes = 0;  ///< bytes its link carried by the cost model (P - 1 per message)
  std::uint64_t elements_sent = 0;  ///< selected elements this rank sent
  double stage_cpu_seconds =
      0;  ///< CPU time of its stages (select, pack, unpack, aggregate, optimize)
  double exchange_seconds = 0;   ///< wall time with an exchange in flight
  double gate_wait_seconds = 0;  ///< time the application waited in gates and hand-overs
  double last_density = 0;       ///< density of the last step selected
};

namespace detail {

inline double thread_cpu_seconds() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace detail

/// The data path of the data-parallel training step, per gradient bucket:
///
///   hand-over -> select with error feedback -> pack -> sparse all-gather -> unpack ->
///   aggregate (average) -> sparse optimizer step on the fp32 master parameters
///
/// `Compressor` (a `compressor`: the selection and its residuals), `Transport` (a `transport`),
/// `Optimizer` (a `sparse_optimizer`: the master parameters and their state), `Executor` (a
/// `task_executor`, e.g. `thread_pool`: runs the stages and their kernels) and `Policy` (a
/// `density_policy`: the density of each step) are the application's choice.
///
/// Use:
/// 1. `add_tensor(id, initial)` for every parameter tensor, in forward order, then `start()`
///    on every rank (collective): the tensors are grouped into buckets (`plan_buckets`), rank
///    0's initial values are broadcast so that every rank starts from the same parameters.
/// 2. Each step: after the backward pass produced a tensor's gradient, `push_gradient(t, g)`
///    (`micro_batches` times per step with gradient accumulation), or, without the copy,
///    write it into `gradient_buffer(t)` and call `push_gradient(t)`. When every tensor of a
///    bucket is in, the bucket goes down the pipeline while backward continues.
/// 3. Before the forward pass reads a bucket's parameters: `wait_for_forward(b)`, then
///    `copy_params(t, out)` for its tensors (the analogue of the upload to the GPU), or, in a
///    pipeline that records its updates (`Record`: float, fp16 or bf16, set by passing
///    `record_updates<T>` to the constructor), `copy_changes(t, held, ...)`: only the elements
///    changed since the copy's version `held` (pipeline/cuda_bridge.cuh scatters them into
///    GPU memory). Memory of the record: up to the union of the ranks' selections per tensor
///    and step, twice.
///
/// Staleness (the gate of step 3): with `staleness` 0, the forward of step t+1 waits until
/// every update of step t is applied; with 1, until every update of step t-1 is, so that step
/// t's exchange and optimizer run during step t+1's compute (the paper's mode). The parameters
/// it copies then hold the updates through t-1 and possibly t's (whichever is done): every
/// rank still holds bit-identical parameters after each applied step, because every rank
/// applies the same aggregated update in the same order.
///
/// Concurrency: selection and packing of bucket b at step t run while bucket b+1 is on the
/// wire and bucket b+2 is optimized; stages of one bucket run in step order. Ready stages run
/// oldest step first, then front bucket first (front layers are needed first by the next
/// forward). Exchanges run in a fixed order on every rank (step, then bucket from the back),
/// each on its own tags, so ranks never wait on each other's different buckets.
///
/// Determinism: aggregation reads the ranks' messages by rank, never by arrival, so the order
/// in which messages arrive changes nothing. Each message also carries its sender's step
/// reports (a control section, pipeline/step_reports.hpp), so that every rank's policy
/// observes the same measurements and chooses the same density.
///
/// Errors: a failure in any stage on any rank (bad message, peer failure, timeout, an
/// exception from a stage) aborts the transport, so every rank's pipeline fails; the next call
/// of every rank then throws `stellatrain::error` (or the stage's exception). No call hangs
/// past `timeout`.
///
/// Threads: one thread hands over the gradients of a given tensor at a time; gates and
/// `copy_params` may be called from any thread. The pipeline's own threads are its exchange
/// threads; everything else runs on the executor.
template <compressor Compressor, transport Transport, sparse_optimizer Optimizer,
          task_executor Executor, density_policy Policy = adaptive_density_controller,
          class Record = void>
requires(std::is_void_v<Record> || value_type<Record>) class pipeline {
  using value_t = typename Compressor::value_type;
  using index_t = typename Compressor::index_type;
  // The value type of the update record (unused without one).
  using log_value_t = std::conditional_t<std::is_void_v<Record>, float, Record>;
  using hier_bucket = detail::hierarchical_bucket<Transport, value_t, index_t>;

 public:
  using compressor_type = Compressor;
  using transport_type = Transport;
  using optimizer_type = Optimizer;
  /// The precision of the update record (`void`: none is kept).
  using record_type = Record;
  static constexpr bool records_updates = !std::is_void_v<Record>;
  /// The index type of `copy_changes`.
  using index_type = index_t;

  pipeline(Transport& transport, Executor& executor, Compressor compressor, Optimizer optimizer,
           pipeline_options options = {}, Policy policy = Policy{}, record_updates_t<Record> = {})
      : transport_(transport),
        ex_(executor),
        compressor_(std::move(compressor)),
        optimizer_(std::move(optimizer)),
        policy_(std::move(policy)),
        options_(options) {
    if (options_.staleness < 0 || options_.staleness > 1) {
      throw_error(errc::invalid_argument, "pipeline: staleness must be 0 or 1");
    }
    if (options_.micro_batches == 0 || options_.exchange_threads < 1) {
      throw_error(errc::invalid_argument,
                  "pipeline: micro_batches and exchange_threads must be at least 1");
    }
  }

  /// A hierarchical pipeline (the multi-cluster setting): each bucket is reduced inside the
  /// cluster over `links.lan`, each rank selects its shard of the cluster's sum and exchanges
  /// it over `links.wan` with the ranks of the other clusters that own the same elements, and
  /// the merged shards are gathered inside the cluster (pipeline/hierarchical_exchange.hpp,
  /// docs/design.md). `rank()` and `ranks()` are then the WAN's (global) ones. The
  /// optimizer is replicated: every rank steps every tensor with the same merged update.
  pipeline(hierarchical_links<Transport> links, Executor& executor, Compressor compressor,
           Optimizer optimizer, pipeline_options options = {}, Policy policy = Policy{},
           record_updates_t<Record> record = {})
      : pipeline(links.wan, executor, std::move(compressor), std::move(optimizer), options,
                 std::move(policy), record) {
    lan_ = &links.lan;
    topology_.emplace(std::move(links.topology));
  }

  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  /// Stops the exchange threads and waits for the stages in flight. Call `flush()` on every
  /// rank before destroying the pipelines; destroying one with exchanges in flight aborts the
  /// transport (the other ranks then fail instead of waiting).
  ~pipeline() {
    {
      std::unique_lock lock(mutex_);
      stopping_ = true;
      const bool in_flight = started_ && applied_step_ + 1 < pushed_steps_;
      if (in_flight && !failed_) {
        failed_ = true;
        failure_ = std::make_exception_ptr(
            error(errc::peer_failure, "pipeline destroyed with steps in flight"));
        abort_links("stellatrain pipeline destroyed with steps in flight");
      }
    }
    changed_.notify_all();
    exchangers_.clear();  // joins
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return active_tasks_ == 0; });
  }

  // ------------------------------------------------------------------ registration

  /// Registers a parameter tensor with its initial values (copied); returns its index. `id` is
  /// its name on the wire (unique). Tensors are registered in forward order, before `start`.
  std::size_t add_tensor(std::uint32_t id, std::span<const float> initial) {
    if (started_)
      throw_error(errc::invalid_argument, "pipeline::add_tensor: the pipeline has started");
    for (const auto& t : tensors_) {
      if (t.id == id)
        throw_error(errc::invalid_argument, "pipeline::add_tensor: tensor id " +
                                                std::to_string(id) + " is already registered");
    }
    tensor_state t;
    t.id = id;
    t.size = initial.size();
    initial_.insert(initial_.end(), initial.begin(), initial.end());
    tensors_.push_back(std::move(t));
    return tensors_.size() - 1;
  }

  /// Collective: plans the buckets, broadcasts rank 0's initial parameters (every rank must
  /// have registered the same tensor ids and sizes; a mismatch throws on every rank) and starts
  /// the exchange threads.
  void start() {
    if (started_) throw_error(errc::invalid_argument, "pipeline::start: already started");
    if (tensors_.empty())
      throw_error(errc::invalid_argument, "pipeline::start: no tensors registered");
    ranks_ = transport_.size();
    if (hierarchical()) check_topology();
    broadcast_initial();
    std::vector<std::uint64_t> sizes;
    for (const auto& t : tensors_) sizes.push_back(t.size);
    const auto plan = plan_buckets(sizes, options_.bucket_bytes);
    buckets_.reserve(plan.size());
    std::uint64_t offset = 0;
    std::uint32_t pieces = 0;  // the compressor's ids of the shards' pieces
    for (std::size_t b = 0; b < plan.size(); ++b) {
      auto bucket = std::make_unique<bucket_state>();
      bucket->range = plan[b];
      std::uint64_t in_bucket = 0;
      std::uint64_t largest = 0;
      for (std::size_t i = 0; i < plan[b].tensor_count; ++i) {
        tensor_state& t = tensors_[plan[b].first_tensor + i];
        t.bucket = b;
        t.offset_in_bucket = in_bucket;
        in_bucket += t.size;
        largest = std::max(largest, t.size);
        const std::span<const float> init(initial_.data() + offset, t.size);
        offset += t.size;
        t.optimizer_index = optimizer_.add_tensor(init, ex_);
        if (!hierarchical()) compressor_.add_tensor(ex_, t.id, t.size);
        bucket->unpacker.register_tensor(t.id, t.size);
      }
      if (hierarchical()) {
        std::vector<detail::bucket_tensor> in;
        for (std::size_t i = 0; i < plan[b].tensor_count; ++i) {
          const tensor_state& t = tensors_[plan[b].first_tensor + i];
          in.push_back({t.id, t.size, t.offset_in_bucket});
        }
        bucket->hier = std::make_unique<hier_bucket>(*topology_, transport_.rank(), in, pieces);
        bucket->hier->add_to(compressor_, ex_);
      }
      for (auto& slot : bucket->slots) {
        slot.grad = aligned_buffer<float>(in_bucket, {.prefault = true}, ex_);
        slot.received.resize(static_cast<std::size_t>(ranks_));
        slot.preselected.assign(plan[b].tensor_count, 0);
        slot.preselected_pairs.resize(plan[b].tensor_count);
      }
      bucket->report_payload.reserve(step_reports_bytes(detail::step_report_book::sent));
      bucket->selections.resize(plan[b].tensor_count);
      bucket->decoded.resize(static_cast<std::size_t>(ranks_));
      for (auto& per_rank : bucket->decoded) per_rank.resize(plan[b].tensor_count);
      bucket->dense_grad = aligned_buffer<float>(largest, {.prefault = true}, ex_);
      buckets_.push_back(std::move(bucket));
    }
    input_views_.resize(buckets_.size());
    start_reports(0);
    initial_.clear();
    initial_.shrink_to_fit();
    for (auto& t : tensors_) total_elements_ += t.size;
    if constexpr (requires { policy_.set_model(exchange_cost_model{}); }) {
      policy_.set_model(cost_model(8.0));
    }
    started_ = true;
    start_exchangers();
  }

  // ------------------------------------------------------------------ the model

  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  [[nodiscard]] std::size_t bucket_of(std::size_t tensor) const { return tensor_at(tensor).bucket; }
  [[nodiscard]] bucket_range bucket(std::size_t b) const {
    return buckets_[bucket_index(b)]->range;
  }
  [[nodiscard]] std::uint64_t tensor_size(std::size_t tensor) const {
    return tensor_at(tensor).size;
  }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] int rank() const noexcept { return transport_.rank(); }
  [[nodiscard]] int ranks() const noexcept { return ranks_; }

  // ------------------------------------------------------------------ per step

  /// Hands over (one micro-batch of) the gradient of tensor `t` for the current step of that
  /// tensor: the pipeline copies it, so `grad` may be reused at once. The step of a hand-over
  /// is its count divided by `micro_batches`. Waits (a gate) only when the application runs
  /// more than `staleness + 1` steps ahead of the pipeline.
  void push_gradient(std::size_t t, std::span<const float> grad) {
    require_started("push_gradient");
    tensor_state& ts = tensor_at(t);
    if (grad.size() != ts.size) {
      throw_error(errc::size_mismatch, "pipeline::push_gradient: tensor " + std::to_string(ts.id) +
                                           " has " + std::to_string(ts.size) +
                                           " elements, the gradient " +
                                           std::to_string(grad.size()));
    }
    bucket_state& b = *buckets_[ts.bucket];
    const std::uint64_t count = ts.pushes;
    const std::int64_t step = static_cast<std::int64_t>(count / options_.micro_batches);
    const std::uint32_t micro = static_cast<std::uint32_t>(count % options_.micro_batches);
    // The slot last held step - 2: its selection must be done before it is overwritten.
    slot_state& slot = micro == 0 ? slot_for_next_push(ts, "push_gradient")
                                  : b.slots[static_cast<std::size_t>(step % 2)];
    float* dst = slot.grad.data() + ts.offset_in_bucket;
    if (micro == 0) {
      std::memcpy(dst, grad.data(), grad.size_bytes());
    } else {
      for (std::size_t i = 0; i < grad.size(); ++i) dst[i] += grad[i];
    }
    if (micro + 1 == options_.micro_batches && options_.micro_batches > 1) {
      const float scale = 1.0f / static_cast<float>(options_.micro_batches);
      for (std::size_t i = 0; i < grad.size(); ++i) dst[i] *= scale;
    }
    ts.pushes = count + 1;
    if (micro + 1 < options_.micro_batches) return;
    slot.preselected[t - b.range.first_tensor] = false;
    count_push(ts.bucket, step);
  }

  /// Zero-copy hand-over, the alternative to `push_gradient(t, grad)` (needs `micro_batches`
  /// == 1): the pipeline's own buffer for the next gradient of tensor `t`, `tensor_size(t)`
  /// floats. Write the whole gradient into it (for example by the device-to-host copy), then
  /// call `push_gradient(t)`. Until that call the buffer is the application's; after it, the
  /// pipeline's (writing to it then is a data race). Waits like `push_gradient` when the
  /// application runs ahead (the buffer alternates between two steps: step s - 2 must have
  /// been selected). Calling it again before the push returns the same buffer.
  [[nodiscard]] std::span<float> gradient_buffer(std::size_t t) {
    require_started("gradient_buffer");
    require_single_micro_batch("gradient_buffer");
    const tensor_state& ts = tensor_at(t);
    slot_state& slot = slot_for_next_push(ts, "gradient_buffer");
    return {slot.grad.data() + ts.offset_in_bucket, static_cast<std::size_t>(ts.size)};
  }

  /// Hands over the gradient of tensor `t` written into `gradient_buffer(t)` (no copy).
  void push_gradient(std::size_t t) {
    require_started("push_gradient");
    require_single_micro_batch("push_gradient (zero-copy)");
    tensor_state& ts = tensor_at(t);
    bucket_state& b = *buckets_[ts.bucket];
    slot_state& slot = slot_for_next_push(ts, "push_gradient");
    const auto step = static_cast<std::int64_t>(ts.pushes);
    ts.pushes = ts.pushes + 1;
    slot.preselected[t - b.range.first_tensor] = false;
    count_push(ts.bucket, step);
  }

  /// Hands over, instead of a dense gradient, a selection made elsewhere (for example on the
  /// GPU with its own error feedback, see pipeline/cuda_bridge.cuh): the compressor is not
  /// called for this tensor and step, and its residual is not touched. The pairs are copied;
  /// their indices must ascend strictly below the tensor's size (checked when packed).
  /// Needs `micro_batches` == 1.
  void push_selection(std::size_t t, sparse_view<const value_t, const index_t> selection) {
    require_started("push_selection");
    require_single_micro_batch("push_selection");
    tensor_state& ts = tensor_at(t);
    if (selection.dense_size() != ts.size) {
      throw_error(errc::size_mismatch, "pipeline::push_selection: tensor " + std::to_string(ts.id) +
                                           " has " + std::to_string(ts.size) +
                                           " elements, the selection's dense size is " +
                                           std::to_string(selection.dense_size()));
    }
    bucket_state& b = *buckets_[ts.bucket];
    const auto step = static_cast<std::int64_t>(ts.pushes);
    slot_state& slot = slot_for_next_push(ts, "push_selection");
    auto& buf = slot.preselected_pairs[t - b.range.first_tensor];
    buf.set_dense_size(ts.size);
    if (buf.capacity() < selection.size()) buf.reserve(selection.size(), {.prefault = true});
    buf.resize(selection.size());
    std::copy(selection.indices().begin(), selection.indices().end(), buf.indices().begin());
    std::copy(selection.values().begin(), selection.values().end(), buf.values().begin());
    slot.preselected[t - b.range.first_tensor] = true;
    ts.pushes = ts.pushes + 1;
    count_push(ts.bucket, step);
  }

  /// Waits until bucket `b` holds every update through `step` (a step below 0 returns at
  /// once). Throws the pipeline's failure, or `errc::timeout` after `options().timeout`.
  void wait_ready(std::size_t b, std::int64_t step) {
    require_started("wait_ready");
    bucket_state& bs = *buckets_[bucket_index(b)];
    timed_wait("wait_ready: bucket " + std::to_string(b) + " step " + std::to_string(step),
               [&] { return bs.applied >= step; });
  }

  /// The gate of the next forward pass for bucket `b`: waits for the updates through step
  /// s - 1 - staleness, where s is the number of steps whose gradients were handed over.
  void wait_for_forward(std::size_t b) {
    require_started("wait_for_forward");
    std::int64_t pushed;
    {
      std::lock_guard lock(mutex_);
      pushed = pushed_steps_;
    }
    wait_ready(b, pushed - 1 - options_.staleness);
  }

  /// Copies the parameters of tensor `t` into `out` (out.size() == the tensor's size), as one
  /// consistent snapshot (never half of an update), converted to fp16 / bf16 (rounding to
  /// nearest even) for those overloads. Returns the version copied (for `copy_changes`).
  /// Also after a failure: each tensor then holds the parameters of the last step applied to
  /// it (`step` of the version; tensors of different buckets may differ by a step), nothing
  /// of an exchange that did not complete, so that the application can keep them.
  param_version copy_params(std::size_t t, std::span<float> out) { return copy_params_as(t, out); }
  param_version copy_params(std::size_t t, std::span<fp16> out) { return copy_params_as(t, out); }
  param_version copy_params(std::size_t t, std::span<bf16> out) { return copy_params_as(t, out); }

  /// In a pipeline that records its updates (`Record`): writes to `indices` / `values` the
  /// elements of tensor `t` that changed since the copy of version `held` (sorted indices,
  /// their current values in `Record`), so that setting them brings the copy to the version
  /// returned. Consistent like `copy_params`. Returns `param_changes_kind::none` when the copy
  /// is current; `whole` (the spans' contents unspecified) when the changes are not kept:
  /// `held` is more than two steps behind, holds nothing known or predates a restore, an
  /// update in between was dense (a dense aggregation), or the spans are shorter than the
  /// changes (`count` says how many). Then copy the tensor with `copy_params`. Values of
  /// another precision do not compile. Errors: `errc::out_of_range` for an unknown tensor.
  /// Time: O(changes) (a merge of two sorted lists when `held` is two steps behind).
  param_changes copy_changes(std::size_t t, param_version held, std::span<index_t> indices,
                             std::span<log_value_t> values) requires records_updates {
    require_started("copy_changes");
    const tensor_state& ts = tensor_at(t);
    bucket_state& b = *buckets_[ts.bucket];
    std::lock_guard lock(b.params_mutex);
    const param_version now{.step = ts.applied,
                            .generation = generation_.load(std::memory_order_relaxed)};
    return ts.history.changes_since(held, now, indices, values);
  }

  /// Waits until every handed-over step is applied on this rank (not a barrier: other ranks
  /// may be behind).
  void flush() {
    require_started("flush");
    timed_wait("flush", [&] {
      for (const auto& b : buckets_) {
        if (b->applied + 1 < pushed_steps_) return false;
      }
      return true;
    });
  }

  /// Sets the learning rate of the steps handed over from now on, the earlier ones keeping
  /// theirs (a scheduler's hook that leaves steps in flight alone: with staleness 1 the
  /// previous step may still be applied at its own rate while the next one computes). Call
  /// between steps, when every tensor has been handed over equally often; all ranks must set
  /// the same rates at the same steps. The optimizer takes a new rate once every bucket has
  /// applied the step before it: the applies of that step's buckets wait for each other, the
  /// exchanges and the application do not. Setting the rate in effect is free. Needs an
  /// optimizer with `set_learning_rate(float)`. Errors: `errc::invalid_argument` for a rate that
  /// is negative or not finite, or a call in the middle of a step's hand-overs. A checkpoint
  /// holds the rate of the step after it; `load_checkpoint` restores that rate and drops the
  /// changes that had not taken effect.
  void set_learning_rate(float lr) requires requires(Optimizer& o) { o.set_learning_rate(lr); }
  {
    if (!std::isfinite(lr) || lr < 0) {
      throw_error(errc::invalid_argument,
                  "pipeline::set_learning_rate: the rate must be finite and >= 0, got " +
                      std::to_string(lr));
    }
    std::lock_guard lock(mutex_);
    const std::uint64_t pushes = static_cast<std::uint64_t>(pushed_steps_) * options_.micro_batches;
    for (const tensor_state& ts : tensors_) {
      if (ts.pushes != pushes) {
        throw_error(errc::invalid_argument,
                    "pipeline::set_learning_rate: call between steps (tensor " +
                        std::to_string(ts.id) + " has " + std::to_string(ts.pushes) +
                        " hand-overs, " + std::to_string(pushes) + " complete the last step)");
      }
    }
    if (requested_lr_ == lr) return;
    requested_lr_ = lr;
    if (!rate_changes_.empty() && rate_changes_.back().step == pushed_steps_) {
      rate_changes_.back().lr = lr;
    } else {
      rate_changes_.push_back({pushed_steps_, lr});
    }
    take_rate_changes(pushed_steps_);
  }

  /// Tells the pipeline that `seconds` of the time since this rank's last complete hand-over
  /// went to work other than the step's forward and backward (an evaluation, a checkpoint, a
  /// collective of the application's own): the step's compute time, which the density policy
  /// lets the exchange take, is measured without it. Waits in the pipeline's own gates and in
  /// flush() are left out already. Throws stellatrain::error(invalid_argument) for a time that
  /// is negative or not finite.
  void exclude_from_compute(double seconds) {
    if (!std::isfinite(seconds) || seconds < 0) {
      throw_error(errc::invalid_argument,
                  "pipeline: exclude_from_compute needs a finite time >= 0, got " +
                      std::to_string(seconds));
    }
    std::lock_guard lock(mutex_);
    gate_wait_in_step_ += seconds;
  }

  /// Steps whose gradients were all handed over.
  [[nodiscard]] std::int64_t steps_pushed() const {
    std::lock_guard lock(mutex_);
    return pushed_steps_;
  }

  /// Totals of this rank's work so far.
  [[nodiscard]] pipeline_stats stats() const {
    std::lock_guard lock(mutex_);
    pipeline_stats s = stats_;
    s.steps_applied = static_cast<std::uint64_t>(applied_step_ + 1);
    return s;
  }

  /// The density the next step selects with.
  [[nodiscard]] double next_density() const {
    std::lock_guard lock(mutex_);
    return policy_.density();
  }

  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }

  /// The last measurement handed to the policy (all ranks' reports of one step, combined),
  /// and how many steps were observed so far.
  [[nodiscard]] std::pair<step_measurement, std::uint64_t> last_measurement() const {
    std::lock_guard lock(mutex_);
    return {last_measurement_, observations_};
  }
  /// The optimizer (its master parameters and state). Use only while no step is in flight
  /// (`set_learning_rate` changes the rate while steps are).
  [[nodiscard]] Optimizer& optimizer() noexcept { return optimizer_; }
  [[nodiscard]] Compressor& compressor() noexcept { return compressor_; }

  // ------------------------------------------------------------------ checkpoints

  /// Writes the whole state (step, parameters and optimizer state, residuals and compressor
  /// state, the policy's state where it has one) in the checked format of
  /// core/saved_state.hpp (kind "STELLPIP", pipeline/checkpoint.hpp). Call after `flush()`
  /// with no hand-over in progress; the blob of each rank holds that rank's state (residuals
  /// differ between ranks).
  [[nodiscard]] std::vector<std::byte> save_checkpoint() {
    flush();
    // The rate of the next step goes into the optimizer's state.
    timed_wait("save_checkpoint", [&] { return take_rate_changes(pushed_steps_); });
    std::lock_guard lock(mutex_);
    const auto c = compressor_.save_state();
    std::vector<std::byte> o(static_cast<std::size_t>(optimizer_.state_size_bytes()));
    optimizer_.save_state(std::span<std::byte>(o));
    return detail::write_pipeline_checkpoint(static_cast<std::uint64_t>(pushed_steps_),
                                             checkpoint_tensors(), policy_, c, o);
  }

  /// Restores a blob of `save_checkpoint` into a started pipeline with the same tensors and
  /// options. A damaged blob (`errc::checksum_mismatch`, `errc::malformed_message`) or one of
  /// another configuration (`errc::invalid_argument`) throws and changes nothing. The run then
  /// continues exactly as the saved one would have. Call with no step in flight.
  void load_checkpoint(std::span<const std::byte> blob) {
    flush();
    stop_exchangers();
    struct restart {
      pipeline* self;
      ~restart() { self->start_exchangers(); }
    } restart_on_exit{this};
    std::lock_guard lock(mutex_);
    auto saved = detail::read_pipeline_checkpoint(blob, checkpoint_tensors(), policy_);
    // Each part checks itself before it changes anything; the compressor's state before this
    // call is kept, so that an optimizer state it refuses leaves both as they were.
    const auto compressor_before = compressor_.save_state();
    compressor_.load_state(ex_, saved.compressor);
    try {
      optimizer_.load_state(saved.optimizer);
    } catch (...) {
      compressor_.load_state(ex_, compressor_before);
      throw;
    }
    if (saved.policy) policy_ = std::move(*saved.policy);
    rate_changes_.clear();
    requested_lr_.reset();
    const auto s = static_cast<std::int64_t>(saved.steps);
    pushed_steps_ = s;
    applied_step_ = s - 1;
    for (auto& t : tensors_) {
      t.pushes = saved.steps * options_.micro_batches;
      t.applied = s - 1;
      t.history.forget();
    }
    generation_.fetch_add(1, std::memory_order_relaxed);  // copies made before hold another history
    for (auto& b : buckets_) {
      b->compressed = b->exchanged = b->applied = s - 1;
      for (auto& slot : b->slots) {
        slot.pushes = 0;
        slot.pushes_step = -1;
      }
    }
    first_unexchanged_step_ = s;
    start_reports(s);
  }

 private:
  struct tensor_state {
    std::uint32_t id = 0;
    std::uint64_t size = 0;
    std::size_t bucket = 0;
    std::uint64_t offset_in_bucket = 0;
    std::size_t optimizer_index = 0;
    std::uint64_t pushes = 0;  // hand-overs so far (micro-batches included)
    // Guarded by the bucket's params_mutex:
    std::int64_t applied = -1;  // the last step applied to the parameters
    detail::update_history<index_t, log_value_t> history;  // with an update record
  };

  struct slot_state {
    aligned_buffer<float> grad;            // the bucket's tensors' gradients, concatenated
    std::int64_t pushes_step = -1;         // the step `pushes` counts for
    std::size_t pushes = 0;                // tensors handed over completely
    std::vector<std::byte> message;        // this rank's packed selection
    std::vector<message_buffer> received;  // every rank's message, by rank
    std::vector<char> preselected;         // per tensor: handed over as a selection
    std::vector<sparse_buffer<value_t, index_t>> preselected_pairs;
  };

  struct bucket_state {
    bucket_range range;
    slot_state slots[2];           // steps alternate between two slots
    std::int64_t compressed = -1;  // last step selected and packed
    std::int64_t exchanged = -1;   // last step exchanged
    std::int64_t applied = -1;     // last step whose update is applied
    bool compress_busy = false;
    bool apply_busy = false;
    std::vector<sparse_buffer<value_t, index_t>> selections;  // per tensor of the bucket
    std::vector<std::byte> report_payload;  // this rank's step reports, sent with each message
    std::array<rank_report, step_reports_layout::max_reports> reports_in{};
    message_packer packer;
    message_unpacker unpacker;
    std::vector<std::vector<sparse_buffer<float, index_t>>> decoded;  // [rank][tensor]
    sparse_merger merger;
    sparse_buffer<float, index_t> merged;
    aligned_buffer<float> dense_grad;
    std::mutex params_mutex;            // optimizer step vs copy_params
    std::unique_ptr<hier_bucket> hier;  // a hierarchical pipeline's exchange of the bucket
  };

  struct step_record {
    std::int64_t step = -1;
    std::size_t pushed_buckets = 0;
    std::size_t exchanged_buckets = 0;
    std::size_t applied_buckets = 0;
    double density = -1;
    double compute_seconds = 0;
    // [begin, end) of each bucket's exchange, for the link's busy time of the step.
    std::vector<std::pair<transport_clock::time_point, transport_clock::time_point>> spans;
    std::uint64_t link_bytes = 0;
    std::uint64_t message_bytes = 0;
    std::uint64_t elements = 0;
  };

  struct ready_task {
    std::int64_t step;
    std::size_t bucket;
    bool apply;  // else compress
    bool operator<(const ready_task& o) const noexcept {
      // priority_queue pops the largest: the oldest step, then the front bucket, then apply.
      if (step != o.step) return step > o.step;
      if (bucket != o.bucket) return bucket > o.bucket;
      return !apply && o.apply;
    }
  };

  // ---------------------------------------------------------------- helpers (mutex_ held)

  step_record& record(std::int64_t step) {
    step_record& r = records_[static_cast<std::size_t>(step % records_size)];
    if (r.step != step) {
      auto spans = std::move(r.spans);  // keeps its capacity: no allocation per step
      spans.clear();
      r = step_record{};
      r.step = step;
      r.spans = std::move(spans);
    }
    return r;
  }

  std::size_t& step_pushed_buckets(std::int64_t step) { return record(step).pushed_buckets; }

  // One more tensor of bucket b is in for `step` (mutex_ not held).
  void count_push(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    std::lock_guard lock(mutex_);
    if (slot.pushes_step != step) {
      slot.pushes_step = step;
      slot.pushes = 0;
    }
    ++slot.pushes;
    if (slot.pushes == bs.range.tensor_count) {
      if (++step_pushed_buckets(step) == buckets_.size()) step_completed(step);
      launch_ready(b);
      // A hierarchical bucket goes to its exchange thread directly.
      if (hierarchical()) changed_.notify_all();
    }
  }

  void step_completed(std::int64_t step) {
    // All buckets of `step` handed over: the compute time of the step is the time since the
    // previous step completed, less the time the application spent waiting in gates.
    const auto now = transport_clock::now();
    if (last_step_time_ != transport_clock::time_point{}) {
      const double interval = std::chrono::duration<double>(now - last_step_time_).count();
      record(step).compute_seconds = std::max(0.0, interval - gate_wait_in_step_);
    }
    last_step_time_ = now;
    gate_wait_in_step_ = 0;
    pushed_steps_ = step + 1;
  }

  double density_of(std::int64_t step) {
    step_record& r = record(step);
    if (r.density < 0) r.density = std::clamp(static_cast<double>(policy_.density()), 0.0, 1.0);
    return r.density;
  }

  void launch_ready(std::size_t b) {
    bucket_state& bs = *buckets_[b];
    const std::int64_t next = bs.compressed + 1;
    const slot_state& slot = bs.slots[static_cast<std::size_t>(next % 2)];
    if (!hierarchical() && !bs.compress_busy && slot.pushes_step == next &&
        slot.pushes == bs.range.tensor_count && bs.exchanged >= next - 2) {
      bs.compress_busy = true;
      schedule({next, b, false});
    }
    const std::int64_t to_apply = bs.applied + 1;
    bool rate_changed = false;
    if (!bs.apply_busy && bs.exchanged >= to_apply && take_rate_changes(to_apply, &rate_changed)) {
      bs.apply_busy = true;
      schedule({to_apply, b, true});
      // Other buckets' applies of the step may have waited for the new rate (these calls
      // change no rate: this bucket's apply is now busy).
      if (rate_changed) {
        for (std::size_t o = 0; o < buckets_.size(); ++o) {
          if (o != b) launch_ready(o);
        }
      }
    }
  }

  // Puts into effect the learning-rate changes of the steps up to `step` once every bucket
  // has applied the step before each and none is applying; returns whether none of them is
  // left waiting (then `step` may be applied).
  bool take_rate_changes(std::int64_t step, bool* changed = nullptr) {
    while (!rate_changes_.empty() && rate_changes_.front().step <= step) {
      const rate_change& c = rate_changes_.front();
      for (const auto& b : buckets_) {
        if (b->applied < c.step - 1 || b->apply_busy) return false;
      }
      if constexpr (requires { optimizer_.set_learning_rate(c.lr); }) {
        optimizer_.set_learning_rate(c.lr);  // validated by set_learning_rate
      }
      rate_changes_.pop_front();
      if (changed) *changed = true;
    }
    return true;
  }

  void schedule(ready_task task) {
    ready_.push(task);
    ++active_tasks_;
    (void)ex_.submit([this] { run_one(); });
  }

  // Runs the most urgent ready task (one per submitted token).
  void run_one() noexcept {
    ready_task task{};
    {
      std::lock_guard lock(mutex_);
      task = ready_.top();
      ready_.pop();
    }
    const double cpu0 = detail::thread_cpu_seconds();
    try {
      if (!is_failed()) {
        if (task.apply) {
          apply_stage(task.bucket, task.step);
        } else {
          compress_stage(task.bucket, task.step);
        }
      }
    } catch (...) {
      fail(std::current_exception());
    }
    const double cpu = detail::thread_cpu_seconds() - cpu0;
    {
      std::lock_guard lock(mutex_);
      stats_.stage_cpu_seconds += cpu;
      bucket_state& bs = *buckets_[task.bucket];
      if (task.apply) {
        bs.apply_busy = false;
      } else {
        bs.compress_busy = false;
      }
      if (!failed_) {
        if (task.apply && !rate_changes_.empty()) {
          // A rate change waits for every bucket's apply: this one may have been the last.
          for (std::size_t b = 0; b < buckets_.size(); ++b) launch_ready(b);
        } else {
          launch_ready(task.bucket);
        }
      }
      --active_tasks_;
    }
    changed_.notify_all();
  }

  bool is_failed() const {
    std::lock_guard lock(mutex_);
    return failed_;
  }

  void fail(std::exception_ptr e) noexcept {
    {
      std::lock_guard lock(mutex_);
      if (failed_) return;
      failed_ = true;
      failure_ = e;
    }
    std::string reason = "stellatrain pipeline failed on rank " + std::to_string(transport_.rank());
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      reason += ": ";
      reason += x.what();
    } catch (...) {
    }
    abort_links(reason);
    changed_.notify_all();
  }

  [[nodiscard]] bool hierarchical() const noexcept { return lan_ != nullptr; }

  void abort_links(std::string_view reason) noexcept {
    detail::abort_transport(transport_, reason);
    if (lan_ != nullptr) detail::abort_transport(*lan_, reason);
  }

  void require_started(const char* what) const {
    if (!started_)
      throw_error(errc::invalid_argument,
                  std::string("pipeline::") + what + ": call start() first");
    std::lock_guard lock(mutex_);
    if (failed_) std::rethrow_exception(failure_);
  }

  void require_single_micro_batch(const char* what) const {
    if (options_.micro_batches != 1) {
      throw_error(errc::invalid_argument,
                  std::string("pipeline::") + what + ": needs micro_batches == 1");
    }
  }

  // The slot that the next push of `ts` fills (its step's first micro-batch), once the
  // selection of the step it held before (step - 2) is done.
  slot_state& slot_for_next_push(const tensor_state& ts, const char* what) {
    bucket_state& b = *buckets_[ts.bucket];
    const auto step = static_cast<std::int64_t>(ts.pushes / options_.micro_batches);
    timed_wait(
        std::string(what) + ": waiting for the selection of step " + std::to_string(step - 2),
        [&] { return b.compressed >= step - 2; });
    return b.slots[static_cast<std::size_t>(step % 2)];
  }

  // Waits for `ready` (evaluated under the lock), counting the wait as gate time; throws the
  // failure or a timeout.
  template <class Pred>
  void timed_wait(const std::string& what, Pred&& ready) {
    const auto t0 = transport_clock::now();
    std::unique_lock lock(mutex_);
    const bool ok = changed_.wait_until(lock, deadline_after(options_.timeout),
                                        [&] { return failed_ || ready(); });
    const double waited = std::chrono::duration<double>(transport_clock::now() - t0).count();
    gate_wait_in_step_ += waited;
    stats_.gate_wait_seconds += waited;
    if (failed_) std::rethrow_exception(failure_);
    if (!ok) throw_error(errc::timeout, "pipeline: timed out in " + what);
  }

  // Sequential latencies one bucket's exchange waits: P - 1 for the ring all-gather, else 1
  // (the direct all-gather, the hierarchical exchange's one message to each peer; a native
  // collective's count is the backend's and taken as 1).
  double rounds_per_exchange() const noexcept {
    if (hierarchical() || options_.algorithm == allgather_algorithm::native) return 1.0;
    return allgather_is_direct(exchange_allgather(0), ranks_) ? 1.0
                                                              : static_cast<double>(ranks_ - 1);
  }

  // The options of a flat exchange's all-gather, the one place that sets them.
  allgather_options exchange_allgather(tag_type tag) const noexcept {
    return {.tag = tag, .timeout = options_.timeout, .algorithm = options_.algorithm};
  }

  exchange_cost_model cost_model(double bytes_per_element) const {
    // Buckets' exchanges overlap across the exchange threads: their latencies do too.
    const double threads = static_cast<double>(std::min<std::size_t>(
        static_cast<std::size_t>(options_.exchange_threads), buckets_.size()));
    const double latency_rounds =
        rounds_per_exchange() *
        std::ceil(static_cast<double>(buckets_.size()) / std::max(threads, 1.0));
    if (hierarchical()) {
      // A cluster's uplink carries each of its G owners' selections (1/G of the elements each)
      // to each other cluster: per owner, the flat model over C ranks with 1/G of the
      // elements, at the owner's share of the uplink (what it measures, as all G send at once).
      const int c = topology_->cluster_of(transport_.rank());
      const double g = static_cast<double>(topology_->size_of(c));
      return {.elements =
                  static_cast<std::uint64_t>(std::ceil(static_cast<double>(total_elements_) / g)),
              .ranks = static_cast<std::uint32_t>(topology_->clusters()),
              .bytes_per_element = bytes_per_element,
              .header_bytes = 64.0 * static_cast<double>(buckets_.size()) +
                              48.0 * static_cast<double>(tensors_.size()) / g,
              .latency_rounds = latency_rounds};
    }
    return {.elements = total_elements_,
            .ranks = static_cast<std::uint32_t>(ranks_),
            .bytes_per_element = bytes_per_element,
            .header_bytes = 64.0 * static_cast<double>(buckets_.size()) +
                            48.0 * static_cast<double>(tensors_.size()),
            .latency_rounds = latency_rounds};
  }

  // ---------------------------------------------------------------- stages

  void compress_stage(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    double density;
    {
      std::lock_guard lock(mutex_);
      density = density_of(step);
    }
    bs.packer.clear(static_cast<std::uint64_t>(step));
    std::uint64_t elements = 0;
    for (std::size_t i = 0; i < bs.range.tensor_count; ++i) {
      const tensor_state& ts = tensors_[bs.range.first_tensor + i];
      std::uint64_t k =
          ts.size <= options_.send_all_below
              ? ts.size
              : static_cast<std::uint64_t>(std::ceil(density * static_cast<double>(ts.size)));
      k = std::min(ts.size, std::max(k, options_.min_k));
      auto& selection = slot.preselected[i] ? slot.preselected_pairs[i] : bs.selections[i];
      if (!slot.preselected[i]) {
        const std::span<const float> g(slot.grad.data() + ts.offset_in_bucket, ts.size);
        compressor_.compress(ex_, ts.id, g, k, selection);
      }
      elements += selection.size();
      bs.packer.add(ts.id, sparse_view<const value_t, const index_t>(selection.view()),
                    {.indices = options_.wire_indices, .values = value_encoding_of<value_t>});
    }
    add_reports(bs);
    const std::size_t bytes = bs.packer.prepare(ex_);
    slot.message.resize(bytes);
    bs.packer.write(slot.message, ex_);
    std::lock_guard lock(mutex_);
    bs.compressed = step;
    step_record& r = record(step);
    r.message_bytes += bytes;
    r.elements += elements;
    stats_.bytes_sent += bytes;
    stats_.elements_sent += elements;
    stats_.last_density = density;
  }

  void start_exchangers() {
    const int threads = std::min<int>(options_.exchange_threads, static_cast<int>(buckets_.size()));
    for (int c = 0; c < threads; ++c) {
      exchangers_.emplace_back([this, c, threads](std::stop_token) { exchange_loop(c, threads); });
    }
  }

  // Stops and joins the exchange threads (mutex_ not held).
  void stop_exchangers() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    exchangers_.clear();
    std::lock_guard lock(mutex_);
    stopping_ = false;
  }

  void exchange_loop(int thread, int threads) noexcept {
    // The buckets of this thread, back to front (the order backward completes them).
    std::vector<std::size_t> mine;
    for (std::size_t b = buckets_.size(); b-- > 0;) {
      if (static_cast<int>(b % static_cast<std::size_t>(threads)) == thread) mine.push_back(b);
    }
    std::int64_t step;
    {
      std::lock_guard lock(mutex_);
      step = first_unexchanged_step_;
    }
    for (;; ++step) {
      for (std::size_t b : mine) {
        bucket_state& bs = *buckets_[b];
        {
          std::unique_lock lock(mutex_);
          changed_.wait(lock, [&] {
            return stopping_ || failed_ || (ready_to_exchange(bs, step) && bs.applied >= step - 2);
          });
          if (stopping_ || failed_) return;
        }
        try {
          exchange(b, step);
        } catch (...) {
          fail(std::current_exception());
          return;
        }
      }
    }
  }

  // A flat pipeline exchanges the packed selection; a hierarchical one starts from the
  // gradients (its exchange selects).
  bool ready_to_exchange(const bucket_state& bs, std::int64_t step) const {
    if (!hierarchical()) return bs.compressed >= step;
    const slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    return slot.pushes_step == step && slot.pushes == bs.range.tensor_count;
  }

  void exchange(std::size_t b, std::int64_t step) {
    if (hierarchical()) {
      exchange_hierarchical(b, step);
      return;
    }
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    const auto t0 = transport_clock::now();
    const auto tag = static_cast<tag_type>(
        options_.tag_base +
        static_cast<tag_type>((static_cast<std::uint64_t>(step) * buckets_.size() + b) % 16384));
    sparse_allgather(transport_, std::span<const std::byte>(slot.message),
                     std::span<message_buffer>(slot.received), exchange_allgather(tag));
    finish_exchange(b, step, t0, transport_clock::now(),
                    static_cast<std::uint64_t>(ranks_ - 1) * slot.message.size());
  }

  // The time the spans cover together and how many disjoint groups they form: buckets whose
  // exchanges overlap share the link and their latencies; one that starts after the others
  // ended (its gradients came later) waits its own, and the gap is compute, not link.
  static std::pair<double, double> busy_time(
      std::vector<std::pair<transport_clock::time_point, transport_clock::time_point>>& spans) {
    std::sort(spans.begin(), spans.end());
    double busy = 0;
    double groups = 0;
    for (std::size_t i = 0; i < spans.size();) {
      auto [begin, end] = spans[i];
      for (++i; i < spans.size() && spans[i].first <= end; ++i)
        end = std::max(end, spans[i].second);
      busy += std::chrono::duration<double>(end - begin).count();
      groups += 1;
    }
    return {busy, groups};
  }

  // The exchange of bucket b at `step` ended; the link was busy for it during [t0, t1] and
  // carried `link` bytes of this rank's.
  void finish_exchange(std::size_t b, std::int64_t step, transport_clock::time_point t0,
                       transport_clock::time_point t1, std::uint64_t link) {
    {
      std::lock_guard lock(mutex_);
      bucket_state& bs = *buckets_[b];
      bs.exchanged = step;
      step_record& r = record(step);
      if (t1 > t0) r.spans.emplace_back(t0, t1);
      r.link_bytes += link;
      stats_.link_bytes += link;
      stats_.exchange_seconds += std::chrono::duration<double>(t1 - t0).count();
      if (++r.exchanged_buckets == buckets_.size()) {
        // This rank's view of the step, for every rank's policy (pipeline/step_reports.hpp).
        const double per_element =
            r.elements > 0 ? static_cast<double>(r.message_bytes) / static_cast<double>(r.elements)
                           : 0.0;
        const std::pair<double, double> busy = busy_time(r.spans);
        reports_.add_own({.step = step,
                          .exchange_seconds = busy.first,
                          .compute_seconds = r.compute_seconds,
                          .link_bytes = r.link_bytes,
                          .bytes_per_element = per_element,
                          .latency_rounds = busy.second * rounds_per_exchange()});
      }
      launch_ready(b);
    }
    changed_.notify_all();
  }

  void exchange_hierarchical(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    const auto x = (static_cast<std::uint64_t>(step) * buckets_.size() + b);
    const auto wan_tag = static_cast<tag_type>(options_.tag_base + x % 16384);
    const auto lan_tag = static_cast<tag_type>(options_.tag_base + x % 8192);
    double density;
    {
      std::lock_guard lock(mutex_);
      density = density_of(step);
    }
    const double cpu0 = detail::thread_cpu_seconds();
    bs.hier->reduce_and_select(
        *lan_, std::span<float>(slot.grad.data(), slot.grad.size()), compressor_, ex_,
        [&](const detail::bucket_tensor& t, std::uint64_t piece) {
          if (t.size <= options_.send_all_below) return piece;
          const auto k =
              static_cast<std::uint64_t>(std::ceil(density * static_cast<double>(piece)));
          return std::max(k, std::min(piece, options_.min_k));
        },
        lan_tag, options_.timeout);
    {
      std::lock_guard lock(mutex_);
      bs.compressed = step;  // the slot's gradient is free for step + 2
    }
    changed_.notify_all();
    std::span<const std::byte> payload;
    {
      std::lock_guard lock(mutex_);
      payload = reports_.own_payload(bs.report_payload);
    }
    const auto res =
        bs.hier->exchange(*lan_, transport_, step, options_.op, options_.wire_indices, payload, ex_,
                          wan_tag, static_cast<tag_type>(lan_tag + 8192), options_.timeout,
                          [&](int from, std::int64_t s, std::span<const std::byte> reports) {
                            take_reports(from, s, bs, reports);
                          });
    const double cpu = detail::thread_cpu_seconds() - cpu0;
    {
      std::lock_guard lock(mutex_);
      step_record& r = record(step);
      r.message_bytes += res.selection_bytes;
      r.elements += res.elements;
      stats_.bytes_sent += res.wan_bytes;
      stats_.elements_sent += res.elements;
      stats_.last_density = density;
      stats_.stage_cpu_seconds += cpu;
    }
    // The policy learns the uplink from the WAN messages' span alone: the LAN collectives and
    // the selection around them would otherwise count as transfer time, and a lower density
    // would then look like a slower link.
    finish_exchange(b, step, res.wan_begin, res.wan_end, res.wan_bytes);
  }

  void apply_stage(std::size_t b, std::int64_t step) {
    if (hierarchical()) {
      apply_hierarchical(b, step);
      return;
    }
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[static_cast<std::size_t>(step % 2)];
    const std::size_t nt = bs.range.tensor_count;
    // Unpack every rank's message, by rank (never by arrival).
    for (int r = 0; r < ranks_; ++r) {
      auto& per_rank = bs.decoded[static_cast<std::size_t>(r)];
      for (auto& d : per_rank) d.resize(0);
      const message_buffer& m = slot.received[static_cast<std::size_t>(r)];
      const message_info& info =
          bs.unpacker.parse(std::span<const std::byte>(m.data(), m.size()), ex_);
      if (info.tag != static_cast<std::uint64_t>(step)) {
        throw_error(errc::malformed_message, "pipeline: rank " + std::to_string(r) + " sent step " +
                                                 std::to_string(info.tag) + " for bucket " +
                                                 std::to_string(b) + " at step " +
                                                 std::to_string(step));
      }
      if (const std::size_t c = bs.unpacker.find_control(control_type::step_reports);
          c != message_unpacker::npos) {
        take_reports(r, step, bs, info.controls[c].payload);
      }
      for (std::size_t s = 0; s < info.sections.size(); ++s) {
        const section_info& sec = info.sections[s];
        const std::size_t i = tensor_in_bucket(bs, sec.tensor);
        if (i == npos) {
          throw_error(errc::malformed_message, "pipeline: rank " + std::to_string(r) +
                                                   " sent tensor " + std::to_string(sec.tensor) +
                                                   " in bucket " + std::to_string(b) +
                                                   ", which does not hold it");
        }
        auto& out = per_rank[i];
        out.reserve(sec.count, {.prefault = true});
        out.set_dense_size(sec.dense_size);
        bs.unpacker.decode(s, out, ex_);
      }
    }
    std::vector<sparse_view<const float, const index_t>>& inputs = inputs_scratch(b);
    for (std::size_t i = 0; i < nt; ++i) {
      tensor_state& ts = tensors_[bs.range.first_tensor + i];
      inputs.clear();
      std::uint64_t total = 0;
      for (int r = 0; r < ranks_; ++r) {
        auto& d = bs.decoded[static_cast<std::size_t>(r)][i];
        d.set_dense_size(ts.size);
        inputs.push_back(std::as_const(d).view());
        total += d.size();
      }
      bs.merged.set_dense_size(ts.size);
      if (bs.merged.capacity() < total) bs.merged.reserve(total, {.prefault = true});
      const std::span<float> dense(bs.dense_grad.data(), ts.size);
      const aggregate_kind kind = bs.merger.aggregate(
          std::span<const sparse_view<const float, const index_t>>(inputs), bs.merged, dense,
          {.op = options_.op, .dense_threshold = options_.dense_threshold}, ex_);
      std::lock_guard lock(bs.params_mutex);
      const auto sparse = std::as_const(bs.merged).view();
      if (kind == aggregate_kind::dense) {
        optimizer_.step(ts.optimizer_index, std::span<const float>(dense), ex_);
        ts.history.finish(step, /*whole=*/true);
      } else {
        if constexpr (records_updates) {
          step_and_log(ts, step, sparse);
        } else {
          optimizer_.step(ts.optimizer_index, sparse, ex_);
        }
      }
      ts.applied = step;
    }
    std::lock_guard lock(mutex_);
    bs.applied = step;
    step_record& rec = record(step);
    if (++rec.applied_buckets == buckets_.size()) applied_step_ = std::max(applied_step_, step);
  }

  // Every rank of every cluster holds the same merged update: it steps like the flat apply.
  void apply_hierarchical(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    for (std::size_t i = 0; i < bs.range.tensor_count; ++i) {
      tensor_state& ts = tensors_[bs.range.first_tensor + i];
      const auto& u = bs.hier->update(step, i);
      const auto sparse = u.view();
      const bool dense =
          choose_aggregate(u.size(), ts.size, options_.dense_threshold) == aggregate_kind::dense;
      if (dense) {
        float* d = bs.dense_grad.data();
        std::fill(d, d + ts.size, 0.0f);
        for (std::uint64_t j = 0; j < u.size(); ++j)
          d[static_cast<std::size_t>(u.indices()[j])] = u.values()[j];
      }
      std::lock_guard lock(bs.params_mutex);
      if (dense) {
        optimizer_.step(ts.optimizer_index, std::span<const float>(bs.dense_grad.data(), ts.size),
                        ex_);
        ts.history.finish(step, /*whole=*/true);
      } else if constexpr (records_updates) {
        step_and_log(ts, step, sparse);
      } else {
        optimizer_.step(ts.optimizer_index, sparse, ex_);
      }
      ts.applied = step;
    }
    std::lock_guard lock(mutex_);
    bs.applied = step;
    step_record& rec = record(step);
    if (++rec.applied_buckets == buckets_.size()) applied_step_ = std::max(applied_step_, step);
  }

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // Tensor `t`, or `errc::out_of_range`.
  tensor_state& tensor_at(std::size_t t) {
    if (t >= tensors_.size()) {
      throw_error(errc::out_of_range, "pipeline: tensor " + std::to_string(t) +
                                          " is not registered (" + std::to_string(tensors_.size()) +
                                          " tensors)");
    }
    return tensors_[t];
  }
  const tensor_state& tensor_at(std::size_t t) const {
    return const_cast<pipeline*>(this)->tensor_at(t);
  }
  // Bucket `b` checked, or `errc::out_of_range`.
  std::size_t bucket_index(std::size_t b) const {
    if (b >= buckets_.size()) {
      throw_error(errc::out_of_range, "pipeline: bucket " + std::to_string(b) +
                                          " does not exist (" + std::to_string(buckets_.size()) +
                                          " buckets)");
    }
    return b;
  }

  template <class T>
  param_version copy_params_as(std::size_t t, std::span<T> out) {
    if (!started_) throw_error(errc::invalid_argument, "pipeline::copy_params: call start() first");
    const tensor_state& ts = tensor_at(t);
    if (out.size() != ts.size) {
      throw_error(errc::size_mismatch, "pipeline::copy_params: tensor " + std::to_string(ts.id) +
                                           " has " + std::to_string(ts.size) +
                                           " elements, the output " + std::to_string(out.size()));
    }
    bucket_state& b = *buckets_[ts.bucket];
    std::lock_guard lock(b.params_mutex);
    const auto p = std::as_const(optimizer_).params(ts.optimizer_index);
    // Same bytes as the little-endian wire encoding of T on every host this library builds for.
    static_assert(std::endian::native == std::endian::little);
    detail::encode_values(p.data(), out.size(), value_encoding_of<T>,
                          reinterpret_cast<std::byte*>(out.data()));
    return {.step = ts.applied, .generation = generation_.load(std::memory_order_relaxed)};
  }

  // The sparse optimizer step of tensor `ts`, keeping the update in the record: the new
  // values come from the optimizer's own pass where it writes an upload copy (`param_copy`),
  // else from its parameters after the step.
  void step_and_log(tensor_state& ts, std::int64_t step,
                    const sparse_view<const float, const index_t>& g) requires records_updates {
    using T = Record;
    auto& log = ts.history.begin(step);
    log.indices.assign(g.indices().begin(), g.indices().end());
    std::vector<T>& values = log.values;
    values.resize(g.size());
    if constexpr (requires { optimizer_.step(ts.optimizer_index, g, ex_, param_copy<T>{}); }) {
      optimizer_.step(ts.optimizer_index, g, ex_, param_copy<T>{.values = std::span<T>(values)});
    } else {
      optimizer_.step(ts.optimizer_index, g, ex_);
      const auto p = std::as_const(optimizer_).params(ts.optimizer_index);
      for (std::size_t j = 0; j < values.size(); ++j)
        values[j] = from_float<T>(p[static_cast<std::size_t>(log.indices[j])]);
    }
    ts.history.finish(step, /*whole=*/false);
  }

  // ---------------------------------------------------------------- measurement reports

  // This rank's latest step reports, into the bucket's message.
  void add_reports(bucket_state& bs) {
    std::span<const std::byte> payload;
    {
      std::lock_guard lock(mutex_);
      payload = reports_.own_payload(bs.report_payload);
    }
    if (!payload.empty()) bs.packer.add_control(control_type::step_reports, payload);
  }

  // Rank r's reports from its message of `step`; every step whose reports are then complete
  // is observed by the policy.
  void take_reports(int r, std::int64_t step, bucket_state& bs,
                    std::span<const std::byte> payload) {
    const std::size_t n =
        read_step_reports(payload, step, bs.reports_in, "pipeline: rank " + std::to_string(r));
    std::lock_guard lock(mutex_);
    reports_.take(report_slot(r), std::span<const rank_report>(bs.reports_in.data(), n),
                  [&](const rank_report& agg) {
                    if constexpr (requires { policy_.set_model(exchange_cost_model{}); }) {
                      if (agg.bytes_per_element > 0)
                        policy_.set_model(cost_model(agg.bytes_per_element));
                    }
                    last_measurement_ = step_measurement{.compute_seconds = agg.compute_seconds,
                                                         .comm_seconds = agg.exchange_seconds,
                                                         .link_bytes = agg.link_bytes,
                                                         .latency_rounds = agg.latency_rounds};
                    policy_.observe(last_measurement_);
                    ++observations_;
                  });
  }

  // The ranks whose reports this rank receives: all of them in a flat pipeline; in a
  // hierarchical one its cluster and the ranks of other clusters that share a shard with it,
  // so its policy observes those (each cluster may choose its own density: every rank still
  // applies the same update, as the exchange does not depend on the density agreeing).
  void start_reports(std::int64_t first_step) {
    heard_.clear();
    if (hierarchical()) {
      const int c = topology_->cluster_of(transport_.rank());
      for (int j = 0; j < topology_->size_of(c); ++j)
        heard_.push_back(topology_->global_rank(c, j));
      for (const auto& b : buckets_)
        for (const auto& peer : b->hier->layout().peers) heard_.push_back(peer.rank);
      std::sort(heard_.begin(), heard_.end());
      heard_.erase(std::unique(heard_.begin(), heard_.end()), heard_.end());
      reports_.start(static_cast<int>(heard_.size()), first_step);
    } else {
      reports_.start(ranks_, first_step);
    }
  }

  int report_slot(int rank) const {
    if (!hierarchical()) return rank;
    const auto it = std::lower_bound(heard_.begin(), heard_.end(), rank);
    if (it == heard_.end() || *it != rank) {
      throw_error(errc::malformed_message, "pipeline: step reports from rank " +
                                               std::to_string(rank) +
                                               ", which shares no shard with this rank");
    }
    return static_cast<int>(it - heard_.begin());
  }

  // Every rank checks every rank's view of the topology and of its two links, so that a
  // mismatch fails on every rank at start with the same message (never a hang).
  void check_topology() {
    const cluster_topology& topo = *topology_;
    const tag_type tag = options_.tag_base + 16385;
    if (transport_.size() != topo.ranks()) {
      const std::string why = "pipeline::start: the clusters " + topo.to_string() + " hold " +
                              std::to_string(topo.ranks()) + " ranks, the WAN transport has " +
                              std::to_string(transport_.size());
      abort_links(why);
      throw_error(errc::invalid_argument, why);
    }
    std::vector<std::uint64_t> mine{static_cast<std::uint64_t>(transport_.rank()),
                                    static_cast<std::uint64_t>(lan_->size()),
                                    static_cast<std::uint64_t>(lan_->rank())};
    for (int v : topo.sizes()) mine.push_back(static_cast<std::uint64_t>(v));
    std::vector<message_buffer> all(static_cast<std::size_t>(ranks_));
    sparse_allgather(transport_, std::as_bytes(std::span<const std::uint64_t>(mine)),
                     std::span<message_buffer>(all), {.tag = tag, .timeout = options_.timeout});
    // Every rank judges by the same data (rank 0's clusters), so that all fail alike.
    std::vector<std::vector<std::uint64_t>> views(static_cast<std::size_t>(ranks_));
    for (int r = 0; r < ranks_; ++r) {
      const message_buffer& m = all[static_cast<std::size_t>(r)];
      auto& v = views[static_cast<std::size_t>(r)];
      v.resize(m.size() / sizeof(std::uint64_t));
      if (m.size() != v.size() * sizeof(std::uint64_t) || v.size() < 4) {
        throw_error(errc::malformed_message,
                    "pipeline::start: rank " + std::to_string(r) + " sent a broken topology");
      }
      std::memcpy(v.data(), m.data(), m.size());
    }
    auto clusters_of = [&](int r) {
      const auto& v = views[static_cast<std::size_t>(r)];
      std::string text;
      for (std::size_t i = 3; i < v.size(); ++i) {
        if (i > 3) text += ',';  // not `"," + std::to_string(...)`: GCC 12 -O3 -Wrestrict
        text += std::to_string(v[i]);
      }
      return text;
    };
    auto fail_with = [&](int r, const std::string& what) {
      throw_error(errc::invalid_argument,
                  "pipeline::start: rank " + std::to_string(r) + " " + what);
    };
    for (int r = 1; r < ranks_; ++r) {
      if (clusters_of(r) != clusters_of(0))
        fail_with(r, "has the clusters " + clusters_of(r) + ", rank 0 " + clusters_of(0));
    }
    // From here on every rank's topology is rank 0's.
    for (int r = 0; r < ranks_; ++r) {
      const auto& v = views[static_cast<std::size_t>(r)];
      if (v[0] != static_cast<std::uint64_t>(r))
        fail_with(r, "calls itself rank " + std::to_string(v[0]));
      const int c = topo.cluster_of(r);
      if (v[1] != static_cast<std::uint64_t>(topo.size_of(c)) ||
          v[2] != static_cast<std::uint64_t>(topo.local_rank(r))) {
        fail_with(r, "has a LAN transport of rank " + std::to_string(v[2]) + " of " +
                         std::to_string(v[1]) + "; in cluster " + std::to_string(c) + " of " +
                         topo.to_string() + " it needs rank " + std::to_string(topo.local_rank(r)) +
                         " of " + std::to_string(topo.size_of(c)));
      }
    }
  }

  std::vector<detail::checkpoint_tensor> checkpoint_tensors() const {
    std::vector<detail::checkpoint_tensor> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back({t.id, t.size});
    return out;
  }

  std::size_t tensor_in_bucket(const bucket_state& bs, std::uint32_t id) const noexcept {
    for (std::size_t i = 0; i < bs.range.tensor_count; ++i) {
      if (tensors_[bs.range.first_tensor + i].id == id) return i;
    }
    return npos;
  }

  std::vector<sparse_view<const float, const index_t>>& inputs_scratch(std::size_t b) {
    // One per bucket: applies of different buckets run concurrently.
    return input_views_[b];
  }

  void broadcast_initial() {
    // Every rank checks that the others registered the same tensors, then takes rank 0's values.
    std::vector<std::uint64_t> shape;
    shape.push_back(tensors_.size());
    for (const auto& t : tensors_) {
      shape.push_back(t.id);
      shape.push_back(t.size);
    }
    std::vector<std::uint64_t> root_shape = shape;
    const tag_type tag = options_.tag_base + 16384;
    collective_workspace<Transport> ws;
    broadcast(transport_, 0, std::as_writable_bytes(std::span<std::uint64_t>(root_shape)),
              {.tag = tag, .timeout = options_.timeout}, ws);
    if (root_shape != shape) {
      // Name the first difference, and tell every rank (they would otherwise see this one
      // leave without a reason).
      std::string what = "pipeline::start: rank " + std::to_string(transport_.rank()) +
                         " registered other tensors than rank 0";
      std::size_t i = 1;
      while (i + 1 < shape.size() && shape[i] == root_shape[i] && shape[i + 1] == root_shape[i + 1])
        i += 2;
      if (i + 1 < shape.size()) {
        what += ": its tensor " + std::to_string((i - 1) / 2) + " is id " +
                std::to_string(shape[i]) + " of " + std::to_string(shape[i + 1]) +
                " elements, rank 0's id " + std::to_string(root_shape[i]) + " of " +
                std::to_string(root_shape[i + 1]) + " elements";
      }
      abort_links(what);
      throw_error(errc::invalid_argument, what);
    }
    broadcast(transport_, 0, std::as_writable_bytes(std::span<float>(initial_)),
              {.tag = tag, .timeout = options_.timeout}, ws);
  }

  static constexpr std::size_t records_size = 8;

  Transport& transport_;
  Executor& ex_;
  Compressor compressor_;
  Optimizer optimizer_;
  Policy policy_;
  pipeline_options options_;
  int ranks_ = 1;
  bool started_ = false;
  std::uint64_t total_elements_ = 0;
  std::vector<tensor_state> tensors_;
  std::vector<float> initial_;
  std::vector<std::unique_ptr<bucket_state>> buckets_;
  std::vector<std::vector<sparse_view<const float, const index_t>>> input_views_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::priority_queue<ready_task> ready_;
  std::array<step_record, records_size> records_{};
  std::int64_t pushed_steps_ = 0;
  std::int64_t applied_step_ = -1;
  std::int64_t first_unexchanged_step_ = 0;
  transport_clock::time_point last_step_time_{};
  double gate_wait_in_step_ = 0;
  std::size_t active_tasks_ = 0;
  bool stopping_ = false;
  bool failed_ = false;
  std::exception_ptr failure_;
  pipeline_stats stats_;
  detail::step_report_book reports_;
  std::uint64_t observations_ = 0;
  std::atomic<std::uint64_t> generation_{0};  // load_checkpoint calls (param_version::generation)
  step_measurement last_measurement_{};
  Transport* lan_ = nullptr;  // a hierarchical pipeline's LAN tier (then transport_ is the WAN)
  std::optional<cluster_topology> topology_;
  std::vector<int> heard_;  // hierarchical: the global ranks whose reports arrive, ascending
  struct rate_change {
    std::int64_t step;  // the first step at the new rate
    float lr;
  };
  std::deque<rate_change> rate_changes_;  // set_learning_rate's, not yet in effect, by step
  std::optional<float> requested_lr_;     // the last rate set_learning_rate asked for
  std::vector<std::jthread> exchangers_;  // last: joined first
};

}  // namespace stellatrain
