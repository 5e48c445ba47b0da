// SPDX-License-Identifier: Apache-2.0
// The pipeline a data-parallel trainer instantiates: per gradient bucket, an exchange strategy
// (select with error feedback, pack, exchange, unpack and merge) and the CPU optimizer's step,
// with buckets and steps in flight concurrently and the density chosen per step from
// measurements.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/optim/optimizer_concepts.hpp>
#include <stellatrain/pipeline/bucket_plan.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/detail/checkpoint.hpp>
#include <stellatrain/pipeline/detail/handover_slot.hpp>
#include <stellatrain/pipeline/detail/lr_changes.hpp>
#include <stellatrain/pipeline/detail/parameter_store.hpp>
#include <stellatrain/pipeline/detail/stage_runner.hpp>
#include <stellatrain/pipeline/detail/start_checks.hpp>
#include <stellatrain/pipeline/detail/step_book.hpp>
#include <stellatrain/pipeline/detail/tags.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/flat_exchange.hpp>
#include <stellatrain/pipeline/hierarchical_exchange.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/pipeline/update_record.hpp>
#include <stellatrain/transport/concept.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

/// The data-parallel training step, per gradient bucket:
///
///   hand-over -> exchange strategy (select with error feedback -> pack -> exchange ->
///   unpack -> merge) -> sparse optimizer step on the fp32 master parameters
///
/// `Exchange` (an `exchange_strategy` holding the compressor and the transports),
/// `Executor` (a `task_executor`, e.g. `thread_pool`: runs the stages and their kernels),
/// `Optimizer` (a `sparse_optimizer`: the master parameters and their state) and `Policy` (a
/// `density_policy`: the density of each step) are the application's choice. The first
/// constructor argument picks the strategy: a transport `flat_exchange`, `hierarchical_links`
/// `hierarchical_exchange` (`pipeline<flat_exchange<Transport, Compressor>, Executor,
/// Optimizer>` names the type):
/// \code
///   stellatrain::pipeline p(transport, pool, compressor, stellatrain::adam_optimizer(), {});
/// \endcode
///
/// Use:
/// 1. `add_tensor(id, initial)` for every parameter tensor, in forward order, then `start()`
///    on every rank (collective): the tensors are grouped into buckets (`plan_buckets`), rank
///    0's initial values are broadcast so that every rank starts from the same parameters.
/// 2. Each step: after the backward pass produced a tensor's gradient, `push_gradient(t, g)`
///    (`micro_batches` times per step with gradient accumulation), or, without the copy,
///    write it into `gradient_buffer(t)` and call `push_gradient_buffer(t)`. When every
///    tensor of a bucket is in, the bucket goes down the pipeline while backward continues.
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
/// applies the same merged update in the same order.
///
/// Concurrency: each bucket goes through the strategy's encode (on the executor), exchange
/// (on an exchange thread) and decode, then the optimizer step (on the executor), so that
/// bucket b is selected while bucket b+1 is on the wire and bucket b+2 is optimized; the
/// stages of one bucket run in step order (pipeline/detail/stage_runner.hpp). Every message
/// carries its sender's step reports, so that every rank's policy observes the same
/// measurements and chooses the same density.
///
/// Errors: a failure in any stage on any rank (bad message, peer failure, timeout, an
/// exception from a stage) aborts the transports, so every rank's pipeline fails; the next
/// call of every rank then throws `stellatrain::error` (or the stage's exception). No call
/// hangs past `timeout`.
///
/// Threads: one thread hands over the gradients of a given tensor at a time; gates and
/// `copy_params` may be called from any thread. The pipeline's own threads are its exchange
/// threads; everything else runs on the executor.
template <exchange_strategy Exchange, task_executor Executor, sparse_optimizer Optimizer,
          density_policy Policy = adaptive_density_controller, class Record = void>
requires(std::is_void_v<Record> || value_type<Record>) class pipeline {
  using value_t = typename Exchange::value_type;
  using index_t = typename Exchange::index_type;
  // The value type of the update record (unused without one).
  using record_value_t = std::conditional_t<std::is_void_v<Record>, float, Record>;

 public:
  using exchange_type = Exchange;
  using compressor_type = typename Exchange::compressor_type;
  using transport_type = typename Exchange::transport_type;
  using optimizer_type = Optimizer;
  /// The precision of the update record (`void`: none is kept).
  using record_type = Record;
  static constexpr bool records_updates = !std::is_void_v<Record>;
  /// The index type of `copy_changes`.
  using index_type = index_t;

  pipeline(Exchange exchange, Executor& executor, Optimizer optimizer,
           pipeline_options options = {}, Policy policy = Policy{}, record_updates_t<Record> = {})
      : exchange_(std::move(exchange)),
        ex_(executor),
        params_(std::move(optimizer)),
        book_(std::move(policy)),
        options_(options),
        rank_(exchange_.transport().rank()),
        ranks_(exchange_.transport().size()),
        runner_(*this, executor, "stellatrain pipeline failed on rank " + std::to_string(rank_)) {
    if (options_.staleness < 0 || options_.staleness > 1) {
      throw_error(errc::invalid_argument, "pipeline: staleness must be 0 or 1");
    }
    if (options_.micro_batches == 0 || options_.exchange_threads < 1) {
      throw_error(errc::invalid_argument,
                  "pipeline: micro_batches and exchange_threads must be at least 1");
    }
  }

  /// The strategy's links and compressor: a transport (a flat pipeline) or
  /// `hierarchical_links` (a hierarchical one, whose `rank()` and `ranks()` are the WAN's).
  pipeline(typename detail::links_of<Exchange>::type links, Executor& executor,
           compressor_type compressor, Optimizer optimizer, pipeline_options options = {},
           Policy policy = Policy{}, record_updates_t<Record> record = {})
      : pipeline(Exchange(links, std::move(compressor)), executor, std::move(optimizer), options,
                 std::move(policy), record) {}

  pipeline(const pipeline&) = delete;
  pipeline& operator=(const pipeline&) = delete;

  /// Stops the exchange threads and waits for the stages in flight. Call `flush()` on every
  /// rank before destroying the pipelines; destroying one with exchanges in flight aborts the
  /// transport (the other ranks then fail instead of waiting).
  ~pipeline() {
    runner_.shut_down([&] { return started_ && applied_step_ + 1 < pushed_steps_; });
  }

  // ------------------------------------------------------------------ registration

  /// Registers a parameter tensor with its initial values (copied); returns its index. `id` is
  /// its name on the wire (unique). Tensors are registered in forward order, before `start`.
  std::size_t add_tensor(std::uint32_t id, std::span<const float> initial) {
    if (started_)
      throw_error(errc::invalid_argument, "pipeline::add_tensor: the pipeline has started");
    return tensors().add(id, initial);
  }

  /// Collective: plans the buckets, broadcasts rank 0's initial parameters (every rank must
  /// have registered the same tensor ids and sizes; a mismatch throws on every rank) and starts
  /// the exchange threads.
  void start() {
    if (started_) throw_error(errc::invalid_argument, "pipeline::start: already started");
    if (tensors().empty())
      throw_error(errc::invalid_argument, "pipeline::start: no tensors registered");
    exchange_.start(options_);
    const auto shapes = tensors().shapes();
    detail::broadcast_initial(
        exchange_.transport(), std::span<const detail::tensor_shape>(shapes), tensors().initial(),
        detail::pipeline_tags(options_.tag_base, 0).broadcast(), options_.timeout);
    std::vector<std::uint64_t> sizes;
    for (const auto& t : tensors()) sizes.push_back(t.size);
    const auto plan = plan_buckets(sizes, options_.bucket_bytes);
    const auto placed = params_.place(plan, ex_);
    for (std::size_t b = 0; b < plan.size(); ++b) {
      auto& bucket = *buckets_.emplace_back(std::make_unique<bucket_state>());
      bucket.range = plan[b];
      exchange_.add_bucket(std::span<const bucket_tensor>(placed[b]), ex_);
      for (auto& slot : bucket.slots) slot.allocate(plan[b].elements, plan[b].tensor_count, ex_);
    }
    book_.start(exchange_.shape(), exchange_.report_sources(), tensors().elements(),
                buckets_.size(), tensors().size(), options_.exchange_threads);
    tensors().release_initial();
    started_ = true;
    runner_.start_exchanges(buckets_.size(), options_.exchange_threads, 0);
  }

  // ------------------------------------------------------------------ the model

  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors().size(); }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  [[nodiscard]] std::size_t bucket_of(std::size_t tensor) const {
    return tensors().at(tensor).bucket;
  }
  [[nodiscard]] bucket_range bucket(std::size_t b) const { return bucket_at(b).range; }
  [[nodiscard]] std::uint64_t tensor_size(std::size_t tensor) const {
    return tensors().at(tensor).size;
  }
  [[nodiscard]] const pipeline_options& options() const noexcept { return options_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int ranks() const noexcept { return ranks_; }

  // ------------------------------------------------------------------ per step

  /// Hands over (one micro-batch of) the gradient of tensor `t` for the current step of that
  /// tensor: the pipeline copies it, so `grad` may be reused at once. The step of a hand-over
  /// is its count divided by `micro_batches`. Waits (a gate) only when the application runs
  /// more than `staleness + 1` steps ahead of the pipeline.
  void push_gradient(std::size_t t, std::span<const float> grad) {
    require_started("push_gradient");
    auto& ts = tensors().at(t);
    ts.require_size(grad.size(), "pipeline::push_gradient", "the gradient");
    const std::uint64_t count = ts.pushes;
    const std::int64_t step = static_cast<std::int64_t>(count / options_.micro_batches);
    const std::uint32_t micro = static_cast<std::uint32_t>(count % options_.micro_batches);
    // The slot last held step - 2: its exchange must be done before it is overwritten.
    slot_state& slot = micro == 0 ? slot_for_next_push(ts, "push_gradient")
                                  : buckets_[ts.bucket]->slots[detail::slot_of(step)];
    slot.add_gradient(ts.index_in_bucket, ts.offset_in_bucket, grad, micro, options_.micro_batches);
    ts.pushes = count + 1;
    if (micro + 1 == options_.micro_batches) count_push(ts.bucket, step);
  }

  /// Zero-copy hand-over, the alternative to `push_gradient(t, grad)` (needs `micro_batches`
  /// == 1): the pipeline's own buffer for the next gradient of tensor `t`, `tensor_size(t)`
  /// floats. Write the whole gradient into it (for example by the device-to-host copy), then
  /// call `push_gradient_buffer(t)`. Until that call the buffer is the application's; after it,
  /// the pipeline's (writing to it then is a data race). Waits like `push_gradient` when the
  /// application runs ahead (the buffer alternates between two steps: step s - 2 must have
  /// been exchanged). Calling it again before the push returns the same buffer.
  [[nodiscard]] std::span<float> gradient_buffer(std::size_t t) {
    require_started("gradient_buffer");
    require_single_micro_batch("gradient_buffer");
    const auto& ts = tensors().at(t);
    slot_state& slot = slot_for_next_push(ts, "gradient_buffer");
    return {slot.grad.data() + ts.offset_in_bucket, static_cast<std::size_t>(ts.size)};
  }

  /// Hands over the gradient of tensor `t` written into `gradient_buffer(t)` (no copy).
  void push_gradient_buffer(std::size_t t) {
    require_started("push_gradient_buffer");
    require_single_micro_batch("push_gradient_buffer");
    auto& ts = tensors().at(t);
    slot_for_next_push(ts, "push_gradient_buffer").preselected[ts.index_in_bucket] = 0;
    pushed(ts);
  }

  /// Hands over, instead of a dense gradient, a selection made elsewhere (for example on the
  /// GPU with its own error feedback, see pipeline/cuda_bridge.cuh): the compressor is not
  /// called for this tensor and step, and its residual is not touched. The pairs are copied;
  /// their indices must ascend strictly below the tensor's size (checked when packed).
  /// Needs `micro_batches` == 1.
  void push_selection(std::size_t t, sparse_view<const value_t, const index_t> selection) requires
      Exchange::takes_selections {
    require_started("push_selection");
    require_single_micro_batch("push_selection");
    auto& ts = tensors().at(t);
    ts.require_size(selection.dense_size(), "pipeline::push_selection",
                    "the selection's dense size is");
    slot_for_next_push(ts, "push_selection").take_selection(ts.index_in_bucket, ts.size, selection);
    pushed(ts);
  }

  /// Waits until bucket `b` holds every update through `step` (a step below 0 returns at
  /// once). Throws the pipeline's failure, or `errc::timeout` after `options().timeout`.
  void wait_ready(std::size_t b, std::int64_t step) {
    require_started("wait_ready");
    bucket_state& bs = bucket_at(b);
    timed_wait("wait_ready: bucket " + std::to_string(b) + " step " + std::to_string(step),
               [&] { return bs.applied >= step; });
  }

  /// The gate of the next forward pass for bucket `b`: waits for the updates through step
  /// s - 1 - staleness, where s is the number of steps whose gradients were handed over.
  void wait_for_forward(std::size_t b) {
    require_started("wait_for_forward");
    wait_ready(b, steps_pushed() - 1 - options_.staleness);
  }

  /// Copies the parameters of tensor `t` into `out` (out.size() == the tensor's size), as one
  /// consistent snapshot (never half of an update), converted to fp16 / bf16 (rounding to
  /// nearest even) for those overloads. Returns the version copied (for `copy_changes`).
  /// Also after a failure: each tensor then holds the parameters of the last step applied to
  /// it (`step` of the version; tensors of different buckets may differ by a step), nothing
  /// of an exchange that did not complete, so that the application can keep them.
  param_version copy_params(std::size_t t, std::span<float> out) { return copy_as(t, out); }
  param_version copy_params(std::size_t t, std::span<fp16> out) { return copy_as(t, out); }
  param_version copy_params(std::size_t t, std::span<bf16> out) { return copy_as(t, out); }

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
                             std::span<record_value_t> values) requires records_updates {
    require_started("copy_changes");
    return params_.changes(t, held, indices, values);
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
  /// previous step may still be applied at its own learning rate while the next one
  /// computes). Call between steps, when every tensor has been handed over equally often; all
  /// ranks must set the same learning rates at the same steps. The optimizer takes a new one
  /// once every bucket has applied the step before it: the applies of that step's buckets wait
  /// for each other, the exchanges and the application do not. Setting the learning rate in
  /// effect is free. Needs an optimizer with `set_lr(float)`. Errors: `errc::invalid_argument`
  /// for a learning rate that
  /// is negative or not finite, or a call in the middle of a step's hand-overs. A checkpoint
  /// holds the learning rate of the step after it; `load_checkpoint` restores it and drops the
  /// changes that had not taken effect.
  void set_lr(float lr) requires requires(Optimizer& o) { o.set_lr(lr); }
  {
    if (!std::isfinite(lr) || lr < 0) {
      throw_error(
          errc::invalid_argument,
          "pipeline::set_lr: the learning rate must be finite and >= 0, got " + std::to_string(lr));
    }
    std::lock_guard lock(runner_.mutex());
    tensors().require_pushes(static_cast<std::uint64_t>(pushed_steps_) * options_.micro_batches,
                             "pipeline::set_lr: call between steps");
    if (lr_changes_.request(pushed_steps_, lr)) take_lr_changes(pushed_steps_);
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
    std::lock_guard lock(runner_.mutex());
    book_.exclude(seconds);
  }

  /// Steps whose gradients were all handed over.
  [[nodiscard]] std::int64_t steps_pushed() const {
    return locked([&] { return pushed_steps_; });
  }

  /// Totals of this rank's work so far.
  [[nodiscard]] pipeline_stats stats() const {
    return locked([&] { return book_.stats(applied_step_); });
  }

  /// The density the next step selects with.
  [[nodiscard]] double next_density() const {
    return locked([&] { return static_cast<double>(book_.policy().density()); });
  }

  [[nodiscard]] const Policy& policy() const noexcept { return book_.policy(); }

  /// The last measurement handed to the policy and how many steps it observed so far.
  [[nodiscard]] pipeline_observation last_measurement() const {
    return locked([&] { return book_.observation(); });
  }
  /// The optimizer (its master parameters and state). Use only while no step is in flight
  /// (`set_lr` changes the learning rate while steps are).
  [[nodiscard]] Optimizer& optimizer() noexcept { return params_.optimizer(); }
  [[nodiscard]] compressor_type& compressor() noexcept { return exchange_.compressor(); }
  [[nodiscard]] Exchange& exchange() noexcept { return exchange_; }

  // ------------------------------------------------------------------ checkpoints

  /// Writes the whole state (step, parameters and optimizer state, residuals and compressor
  /// state, the policy's state where it has one) in the checked format of
  /// core/saved_state.hpp (kind "STELLPIP", pipeline/detail/checkpoint.hpp). Call after `flush()`
  /// with no hand-over in progress; the blob of each rank holds that rank's state (residuals
  /// differ between ranks).
  [[nodiscard]] std::vector<std::byte> save_checkpoint() {
    flush();
    // The learning rate of the next step goes into the optimizer's state.
    timed_wait("save_checkpoint", [&] { return take_lr_changes(pushed_steps_); });
    std::lock_guard lock(runner_.mutex());
    return detail::write_pipeline_checkpoint(static_cast<std::uint64_t>(pushed_steps_),
                                             tensors().shapes(), book_.policy(), compressor(),
                                             optimizer());
  }

  /// Restores a blob of `save_checkpoint` into a started pipeline with the same tensors and
  /// options. A damaged blob (`errc::checksum_mismatch`, `errc::malformed_message`) or one of
  /// another configuration (`errc::invalid_argument`) throws and changes nothing. The run then
  /// continues exactly as the saved one would have. Call with no step in flight.
  void load_checkpoint(std::span<const std::byte> blob) {
    flush();
    // The exchange threads restart from the restored step, also when the blob is refused.
    const auto paused = runner_.pause_exchanges([&] { return first_unexchanged_step_; });
    std::lock_guard lock(runner_.mutex());
    auto saved = detail::read_pipeline_checkpoint(blob, tensors().shapes(), book_.policy());
    detail::restore_states(saved, compressor(), optimizer(), ex_);
    if (saved.policy) book_.policy() = std::move(*saved.policy);
    lr_changes_.clear();
    const auto s = static_cast<std::int64_t>(saved.steps);
    pushed_steps_ = s;
    applied_step_ = s - 1;
    for (auto& t : tensors()) t.pushes = saved.steps * options_.micro_batches;
    params_.restart(s - 1);
    for (auto& b : buckets_) {
      b->encoded = b->exchanged = b->applied = s - 1;
      for (auto& slot : b->slots) slot.forget();
    }
    first_unexchanged_step_ = s;
    book_.restart(s);
  }

 private:
  using tensor_state = detail::pipeline_tensor<index_t, record_value_t>;

  auto& tensors() noexcept { return params_.tensors(); }
  const auto& tensors() const noexcept { return params_.tensors(); }

  using slot_state = detail::handover_slot<value_t, index_t>;

  struct bucket_state {
    bucket_range range;
    slot_state slots[2];          // by step % 2
    std::int64_t encoded = -1;    // last step the strategy encoded
    std::int64_t exchanged = -1;  // last step exchanged
    std::int64_t applied = -1;    // last step whose update is applied
    bool encode_busy = false;
    bool apply_busy = false;
    // This rank's step reports, written for the encode and for the exchange (which may run
    // at once, for consecutive steps).
    std::vector<std::byte> encode_reports;
    std::vector<std::byte> exchange_reports;
  };

  // `f()` with the lock held.
  template <class F>
  auto locked(F&& f) const {
    std::lock_guard lock(runner_.mutex());
    return f();
  }

  // Tensor `ts` is in for its step (a single micro-batch, lock not held).
  void pushed(tensor_state& ts) {
    const auto step = static_cast<std::int64_t>(ts.pushes);
    ts.pushes = ts.pushes + 1;
    count_push(ts.bucket, step);
  }

  // ---------------------------------------------------------------- schedule (lock held)

  // One more tensor of bucket b is in for `step` (lock not held).
  void count_push(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    slot_state& slot = bs.slots[detail::slot_of(step)];
    std::lock_guard lock(runner_.mutex());
    if (slot.count(step, bs.range.tensor_count)) {
      if (++book_.pushed_buckets(step) == buckets_.size()) {
        book_.handed_over(step);
        pushed_steps_ = step + 1;
      }
      launch_ready(b);
    }
  }

  void launch_ready(std::size_t b) {
    bucket_state& bs = *buckets_[b];
    const std::int64_t next = bs.encoded + 1;
    const slot_state& slot = bs.slots[detail::slot_of(next)];
    if (!bs.encode_busy && slot.complete(next, bs.range.tensor_count) && bs.exchanged >= next - 2) {
      bs.encode_busy = true;
      runner_.schedule(next, b, false);
    }
    const std::int64_t to_apply = bs.applied + 1;
    bool lr_changed = false;
    if (!bs.apply_busy && bs.exchanged >= to_apply && take_lr_changes(to_apply, &lr_changed)) {
      bs.apply_busy = true;
      runner_.schedule(to_apply, b, true);
      // Other buckets' applies of the step may have waited for the new learning rate (these
      // calls change none: this bucket's apply is now busy).
      if (lr_changed) {
        for (std::size_t o = 0; o < buckets_.size(); ++o) {
          if (o != b) launch_ready(o);
        }
      }
    }
  }

  // Puts into effect the learning-rate changes of the steps up to `step` once every bucket
  // has applied the step before each and none is applying; returns whether none of them is
  // left waiting (then `step` may be applied).
  bool take_lr_changes(std::int64_t step, bool* changed = nullptr) {
    return lr_changes_.take(
        step,
        [&](std::int64_t before) {
          for (const auto& b : buckets_) {
            if (b->applied < before || b->apply_busy) return false;
          }
          return true;
        },
        [&](float lr) {
          if constexpr (requires { optimizer().set_lr(lr); }) {
            optimizer().set_lr(lr);  // validated by set_lr
          }
        },
        changed);
  }

  // After an executor task of bucket b (lock held): what it freed may be ready to run.
  void task_done(std::size_t b, bool apply, double cpu) {
    book_.add_cpu(cpu);
    bucket_state& bs = *buckets_[b];
    (apply ? bs.apply_busy : bs.encode_busy) = false;
    if (runner_.failed()) return;
    if (apply && !lr_changes_.empty()) {
      // A learning-rate change waits for every bucket's apply: this one may have been the last.
      for (std::size_t o = 0; o < buckets_.size(); ++o) launch_ready(o);
    } else {
      launch_ready(b);
    }
  }

  // An exchange of bucket b at `step` may start once the strategy encoded it and the slot's
  // buffers of step - 2 are applied (lock held).
  bool exchange_ready(std::size_t b, std::int64_t step) const {
    const bucket_state& bs = *buckets_[b];
    return bs.encoded >= step && bs.applied >= step - 2;
  }

  void abort_links(std::string_view reason) noexcept { exchange_.abort(reason); }

  void require_started(const char* what) const {
    if (!started_)
      throw_error(errc::invalid_argument,
                  std::string("pipeline::") + what + ": call start() first");
    std::lock_guard lock(runner_.mutex());
    runner_.rethrow_if_failed();
  }

  void require_single_micro_batch(const char* what) const {
    if (options_.micro_batches != 1) {
      throw_error(errc::invalid_argument,
                  std::string("pipeline::") + what + ": needs micro_batches == 1");
    }
  }

  // The slot that the next push of `ts` fills (its step's first micro-batch), once the
  // exchange of the step it held before (step - 2) has read it.
  slot_state& slot_for_next_push(const tensor_state& ts, const char* what) {
    bucket_state& b = *buckets_[ts.bucket];
    const auto step = static_cast<std::int64_t>(ts.pushes / options_.micro_batches);
    timed_wait(std::string(what) + ": waiting for the exchange of step " + std::to_string(step - 2),
               [&] { return b.exchanged >= step - 2; });
    return b.slots[detail::slot_of(step)];
  }

  // Waits for `ready` (evaluated under the lock), counting the wait as gate time; throws the
  // failure or a timeout.
  template <class Pred>
  void timed_wait(const std::string& what, Pred&& ready) {
    const double waited = runner_.wait(what, options_.timeout, std::forward<Pred>(ready));
    std::lock_guard lock(runner_.mutex());
    book_.waited(waited);
  }

  // ---------------------------------------------------------------- stages

  // Bucket b's input of `step` to the strategy, with the step's density and this rank's
  // latest reports (written into `scratch`).
  bucket_input<value_t, index_t> input_of(bucket_state& bs, std::int64_t step,
                                          std::vector<std::byte>& scratch) {
    double density;
    std::span<const std::byte> reports;
    {
      std::lock_guard lock(runner_.mutex());
      density = book_.density_of(step);
      reports = book_.own_payload(scratch);
    }
    slot_state& slot = bs.slots[detail::slot_of(step)];
    return {.gradient = std::span<float>(slot.grad.data(), slot.grad.size()),
            .preselected = slot.preselected,
            .selections = slot.selections,
            .rule = {.density = density,
                     .min_k = options_.min_k,
                     .send_all_below = options_.send_all_below},
            .reports = reports};
  }

  void encode_stage(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    const auto in = input_of(bs, step, bs.encode_reports);
    const exchange_traffic t = exchange_.encode(b, step, in, ex_);
    std::lock_guard lock(runner_.mutex());
    bs.encoded = step;
    book_.encoded(step, t, in.rule.density);
  }

  void exchange_stage(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    const auto in = input_of(bs, step, bs.exchange_reports);
    const exchange_traffic t = exchange_.exchange(b, step, in, ex_, reports_in_);
    {
      std::lock_guard lock(runner_.mutex());
      bs.exchanged = step;
      book_.exchanged(step, t);
      launch_ready(b);
    }
    runner_.notify();
  }

  void apply_stage(std::size_t b, std::int64_t step) {
    bucket_state& bs = *buckets_[b];
    exchange_.decode(b, step, ex_, reports_in_);
    for (std::size_t i = 0; i < bs.range.tensor_count; ++i)
      params_.apply(bs.range.first_tensor + i, step, exchange_.update(b, step, i, ex_), ex_);
    std::lock_guard lock(runner_.mutex());
    bs.applied = step;
    if (book_.applied(step)) applied_step_ = std::max(applied_step_, step);
  }

  // Bucket `b`, or `errc::out_of_range`.
  bucket_state& bucket_at(std::size_t b) const {
    if (b >= buckets_.size()) {
      throw_error(errc::out_of_range, "pipeline: bucket " + std::to_string(b) +
                                          " does not exist (" + std::to_string(buckets_.size()) +
                                          " buckets)");
    }
    return *buckets_[b];
  }

  template <class T>
  param_version copy_as(std::size_t t, std::span<T> out) {
    if (!started_) throw_error(errc::invalid_argument, "pipeline::copy_params: call start() first");
    return params_.copy(t, out);
  }

  // Where the strategy hands rank `from`'s reports from its message of `step`.
  struct report_taker {
    pipeline* self;
    void operator()(int from, std::int64_t step, std::span<const std::byte> payload) const {
      self->book_.take(from, step, payload, self->runner_.mutex());
    }
  };

  Exchange exchange_;
  Executor& ex_;
  detail::parameter_store<Optimizer, index_t, Record> params_;  // its tensors: params_.tensors()
  detail::step_book<Policy> book_;  // guarded by runner_.mutex(), like the counters below
  pipeline_options options_;
  int rank_ = 0;
  int ranks_ = 1;
  bool started_ = false;
  std::vector<std::unique_ptr<bucket_state>> buckets_;

  std::int64_t pushed_steps_ = 0;
  std::int64_t applied_step_ = -1;
  std::int64_t first_unexchanged_step_ = 0;
  detail::lr_changes lr_changes_;  // set_lr's, not yet in effect
  report_taker reports_in_{this};
  friend class detail::stage_runner<pipeline, Executor>;
  detail::stage_runner<pipeline, Executor> runner_;  // last: stopped first
};

/// The strategy the first argument picks (`exchange_for`): a transport gives a flat
/// pipeline, `hierarchical_links` a hierarchical one.
template <class L, task_executor E, compressor C, sparse_optimizer O>
pipeline(L&&, E&, C, O) -> pipeline<detail::exchange_of<L, C>, E, O>;
template <class L, task_executor E, compressor C, sparse_optimizer O>
pipeline(L&&, E&, C, O, pipeline_options) -> pipeline<detail::exchange_of<L, C>, E, O>;
template <class L, task_executor E, compressor C, sparse_optimizer O, density_policy P>
pipeline(L&&, E&, C, O, pipeline_options, P) -> pipeline<detail::exchange_of<L, C>, E, O, P>;
template <class L, task_executor E, compressor C, sparse_optimizer O, density_policy P, class R>
pipeline(L&&, E&, C, O, pipeline_options, P, record_updates_t<R>)
    -> pipeline<detail::exchange_of<L, C>, E, O, P, R>;

}  // namespace stellatrain
