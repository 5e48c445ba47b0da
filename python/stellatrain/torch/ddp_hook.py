# SPDX-License-Identifier: Apache-2.0
"""A DDP communication hook that sends each gradient bucket as a compressed sparse selection
with error feedback, in the shape of PyTorch's PowerSGD hook:

    state = stellatrain.torch.CompressionState(process_group=None, density=0.01)
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(state, stellatrain.torch.compression_hook)

The hook's work is the state's method `CompressionState.hook(bucket)`; `compression_hook(state,
bucket)` calls it, as DDP's `register_comm_hook` expects.

Per bucket and step, on every rank: acc = g + r; the selector picks k = ceil(density * n)
elements of acc; they are packed in stellatrain's wire format (indices in the smallest
encoding, values as fp32, fp16 or bf16, a CRC-32C) and r = acc - sent. The messages of all
ranks are exchanged with one all_gather of uint8 tensors (each message padded to a bound that
every rank computes alike, `message_bound`; its header gives its length), validated, and their
mean written into the bucket, summed in rank order: every rank gets the same bits.

Semantics: the step's update is the mean over ranks of what each rank sent; what a rank did
not send stays in its residual and is sent in later steps, so over the steps nothing is lost
(the sum of everything sent plus the residuals equals the sum of all gradients). With
density 1 and fp32 values the hook returns the mean of the gradients, as the allreduce hook
does (up to the order of the float sums).

- `start_iter`: steps before it run the dense allreduce (no residual), as PowerSGD's warm-up.
- Bucket rebuilds (DDP regroups parameters after its first step) and checkpoints: the
  residual of every parameter follows it into its new bucket.
- `state_dict()` / `load_state_dict()` carry the step count and each parameter's residual
  (parameters are numbered in the order the buckets first show them, which is the same in
  every run of one model); the threshold selectors re-estimate their bound after a restore.
- `adaptive=True`: the density follows the link, chosen per step by stellatrain's adaptive
  density controller (pipeline/density_controller.hpp) within [min_density, max_density],
  starting from `density`: the largest density whose exchange takes about the step's compute
  (forward, backward and optimizer, from one step's last gradient exchange to the next
  step's last bucket), the latency of the link fitted from the steps' own times. Each rank
  sends its last step's times in its messages, as the step-reports control section of the
  wire format (docs/wire-format.md), written and read by the C++ pipeline's own code; every
  rank combines the ranks' reports of a step as the pipeline does (the mean over ranks of
  exchange + compute, less the slowest compute: `measurement`) and feeds its controller, so
  every rank picks the same density for the same step. A step without the hook (a `no_sync`
  micro-batch) counts as compute of the next one.
- Tensors: CPU fp32 buckets. A bucket of another dtype or device raises TypeError /
  ValueError naming it (this build has no CUDA path).
"""
import math
import time

import torch
import torch.distributed as dist

from .. import _native
from . import _checks
from ._checks import fp32_cpu_buffer
from .kernels import _SELECTORS, _VALUES, threads_handle

__all__ = ["CompressionState", "compression_hook"]


def message_bound(n, k, values, reports=0):
    """Bytes of the largest message `compression_hook` can send for a bucket of n elements, k
    pairs and `reports` step reports (0: no step-reports section): the wire format's headers
    plus raw indices (the encoding chosen is never larger) and the values, computed by the
    native module from the wire format's constants."""
    fixed, pair = _native.message_bound(n, values, reports)
    return fixed + k * pair


class _StepTimes:
    """One step's exchange as this rank saw it, for the adaptive density."""

    def __init__(self, step):
        self.step = step
        self.first_launch = None  # the first bucket's all_gather launched
        self.last_hook = None     # the last bucket handed to the hook (backward done)
        self.last_done = None     # the last bucket's mean written
        self.link_bytes = 0       # what the all_gathers carried per link
        self.elements = 0
        self.pair_bytes = 0.0     # sum over buckets of elements * bytes per pair
        self.header_bytes = 0
        self.compute = None       # from the step before's last_done to last_hook

    def add_bucket(self, world, bound, b):
        """One bucket's padded message of `bound` bytes, sent to the other ranks."""
        self.link_bytes += (world - 1) * bound
        self.elements += b.n
        self.pair_bytes += b.n * b.pair_bytes
        self.header_bytes += b.fixed_bytes

    def report(self, world):
        """The step's report (the pipeline's `rank_report`), once the step is complete."""
        return _native.StepReport(
            step=self.step, exchange_seconds=self.last_done - self.first_launch,
            compute_seconds=self.compute, link_bytes=self.link_bytes,
            bytes_per_element=self.pair_bytes / max(1, self.elements),
            latency_rounds=float(world - 1))


class _Bucket:
    """What the state knows of one bucket index: its layout, the codec tensor behind it and the
    bound of its messages (fixed bytes plus bytes per pair)."""

    def __init__(self, codec_id, numbers, offsets, sizes, n, bound):
        self.codec_id = codec_id
        self.numbers = numbers  # parameter numbers, in the bucket's order
        self.offsets = offsets  # their element offsets in the bucket
        self.sizes = sizes
        self.n = n
        self.fixed_bytes, self.pair_bytes = bound


class CompressionState:
    """The state of `compression_hook` for one DDP model; `hook(bucket)` is the hook's work.

    Args:
        process_group: the group to exchange over (None: the default group).
        density: fraction of each bucket's elements sent per step, in (0, 1].
        selector: 'exact' (top k, the default), 'threshold' (persistent bound, one pass),
            'sampled_threshold', 'block' (whole 64-byte blocks) or 'random'.
        values: 'fp32', 'fp16' or 'bf16' (default): the type of the values on the wire.
        start_iter: steps that run the dense allreduce first (PowerSGD's warm-up).
        threads: threads of the native kernels (default 1; the backward pass runs beside).
        seed: seed of the 'random' selector.
        adaptive: choose the density per step from the measured link and compute (see the
            module's documentation), starting from `density`.
        min_density, max_density: the adaptive density's bounds, 0 < min <= max <= 1.
        exchange_ratio: the exchange time the adaptive density aims at, as a share of the
            step's compute (the C++ controller's `target_ratio`). The hook's exchange adds to
            the step (it overlaps at most the rest of the backward pass), so a ratio r makes
            a step up to 1 + r times its compute: lower ratios buy shorter steps with fewer
            elements sent.

    Public fields, as PowerSGDState has them: `process_group`, `iter` (steps begun), the
    options above (`density` is the density of the next step, with `adaptive` the
    controller's choice), `bytes_sent` (bytes this rank put on the wire, padded messages) and
    `measurement`, the last combination of the ranks' step reports the adaptive density
    observed (a `StepReport`: step, exchange_seconds, compute_seconds, link_bytes,
    bytes_per_element, latency_rounds; None before the first). `bandwidth()`, `latency()`
    are the controller's estimates.
    """

    def __init__(self, process_group=None, density=0.01, selector="exact", values="bf16",
                 start_iter=0, threads=1, seed=0, adaptive=False, min_density=1e-4,
                 max_density=0.1, exchange_ratio=0.95):
        _checks.fraction(density, "density")
        _checks.choice(selector, "selector", _SELECTORS)
        _checks.choice(values, "values", _VALUES)
        _checks.count(start_iter, "start_iter")
        _checks.fraction(min_density, "min_density")
        _checks.fraction(max_density, "max_density")
        _checks.ordered(min_density, "min_density", max_density, "max_density")
        _checks.positive_finite(exchange_ratio, "exchange_ratio")
        self.process_group = process_group
        self.adaptive = bool(adaptive)
        self._controller = None
        if self.adaptive:
            self._controller = _native.DensityController(
                min_density=float(min_density), max_density=float(max_density),
                initial_density=float(density), target_ratio=float(exchange_ratio),
                latency_seconds=0.0)
            density = self._controller.density
        self._times = None       # _StepTimes of the step in progress
        self._reported = None    # _StepTimes of this rank's last complete step
        self._report = None      # its StepReport, which this rank's messages carry
        self._last_done = None   # when the step before the one in progress finished
        self.measurement = None
        self.density = float(density)
        self.selector = selector
        self.values = values
        self.start_iter = start_iter
        self.seed = seed
        self.iter = 0
        self._threads = threads_handle(threads)
        self._reset()
        self.bytes_sent = 0

    def _reset(self):
        self._codec = _native.Codec(self.selector, self.values, self.seed, self._threads)
        self._next_id = 0
        self._buckets = {}        # bucket index -> _Bucket
        self._numbers = {}        # id(parameter) -> its number
        self._params = []         # the parameters, by number (keeps the ids valid)
        self._homes = {}          # parameter number -> (codec id, offset, size)
        self._carry = {}          # parameter number -> residual to add before its next send

    # ------------------------------------------------------------------ the hook

    def hook(self, bucket):
        """The hook's work for one DDP bucket (`compression_hook` calls it): error feedback,
        selection and packing of the bucket, one all_gather of every rank's message; returns
        the future of the bucket holding the mean over ranks of what they sent."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        grad = bucket.buffer()
        fp32_cpu_buffer(grad, f"bucket {bucket.index()}")
        step = self.iter
        last = bucket.is_last()
        if last:
            self.iter += 1
        if step < self.start_iter:
            return _allreduce_mean(group, world, grad)

        n = grad.numel()
        k = min(n, max(1, math.ceil(self.density * n)))
        times = self._time_bucket(step, last, world) if self.adaptive else None
        b = self._bucket_for(bucket, grad)
        for number, offset, size in zip(b.numbers, b.offsets, b.sizes):
            carry = self._carry.pop(number, None)
            if carry is not None:
                grad[offset:offset + size].add_(carry)

        bound = b.fixed_bytes + k * b.pair_bytes
        codec = self._codec
        reports = [self._report] if times is not None and self._report is not None else []
        nbytes = codec.compress(b.codec_id, grad.data_ptr(), n, k, step, reports)
        if nbytes > bound:
            raise RuntimeError(f"stellatrain: bucket {bucket.index()}: message of {nbytes} bytes "
                               f"exceeds its bound {bound}")
        out = torch.empty(bound, dtype=torch.uint8)
        codec.write(out.data_ptr(), bound)
        self.bytes_sent += bound
        if times is not None:
            times.add_bucket(world, bound, b)
        gathered = [torch.empty_like(out) for _ in range(world)]
        fut = dist.all_gather(gathered, out, group=group, async_op=True).get_future()
        observes = times is not None and last
        who = f"stellatrain: bucket {bucket.index()}"

        def reduce(_):
            combined = codec.reduce(b.codec_id, n, [(m.data_ptr(), m.numel()) for m in gathered],
                                    grad.data_ptr(), True, who)
            if times is not None:
                times.last_done = max(times.last_done or 0.0, time.perf_counter())
            if observes and combined is not None:
                self._observe(combined, world)
            return grad

        return fut.then(reduce)

    # ------------------------------------------------------------------ residuals

    def _number_of(self, p):
        number = self._numbers.get(id(p))
        if number is None:
            number = len(self._params)
            self._numbers[id(p)] = number
            self._params.append(p)
        return number

    def _layout(self, bucket, grad):
        """(numbers, offsets, sizes) of the bucket's parameters, from the gradient views."""
        numbers, offsets, sizes = [], [], []
        base = grad.data_ptr()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            numbers.append(self._number_of(p))
            offsets.append((g.data_ptr() - base) // 4)
            sizes.append(g.numel())
        return tuple(numbers), tuple(offsets), tuple(sizes)

    def _residual_of(self, number):
        """The unsent residual of parameter `number` (flat copy), or None."""
        if number in self._carry:
            return self._carry[number].clone()
        home = self._homes.get(number)
        if home is None:
            return None
        codec_id, offset, size = home
        r = torch.frombuffer(bytearray(self._codec.residual(codec_id)), dtype=torch.float32)
        return r[offset:offset + size].clone()

    def _bucket_for(self, bucket, grad):
        """The codec tensor of this bucket; on a new layout, registers one and moves each
        parameter's residual into the carry that its next send adds to the gradient."""
        numbers, offsets, sizes = self._layout(bucket, grad)
        n = grad.numel()
        b = self._buckets.get(bucket.index())
        if b is not None and b.numbers == numbers and b.offsets == offsets and b.n == n:
            return b
        # Residuals are read from the old codec tensors before any home moves.
        residuals = {}
        for number, size in zip(numbers, sizes):
            r = self._residual_of(number)
            if r is not None:
                if r.numel() != size:
                    raise ValueError(f"parameter {number} had {r.numel()} elements, its bucket "
                                     f"now gives it {size}")
                residuals[number] = r
        codec_id = self._next_id
        self._next_id += 1
        self._codec.add(codec_id, n, 0)
        for number, offset, size in zip(numbers, offsets, sizes):
            self._homes[number] = (codec_id, offset, size)
            if number in residuals:
                self._carry[number] = residuals[number]
        # With `adaptive` every message has room for one step report, whether or not this
        # rank has one yet: the bound is the same on every rank.
        b = _Bucket(codec_id, numbers, offsets, sizes, n,
                    _native.message_bound(n, self.values, 1 if self.adaptive else 0))
        self._buckets[bucket.index()] = b
        return b

    def residual(self, parameter):
        """A copy of the residual of `parameter` (flat; zeros before its first send)."""
        number = self._numbers.get(id(parameter))
        r = None if number is None else self._residual_of(number)
        return torch.zeros(parameter.numel()) if r is None else r

    # ------------------------------------------------------------------ adaptive density

    def bandwidth(self):
        """The adaptive controller's bandwidth estimate in bytes/s (0 before it has one, and
        without `adaptive`)."""
        return self._controller.bandwidth if self._controller else 0.0

    def latency(self):
        """The adaptive controller's one-way latency estimate in seconds (0 without one)."""
        return self._controller.latency if self._controller else 0.0

    def _time_bucket(self, step, last, world):
        """The times of `step`, which this bucket's exchange joins."""
        now = time.perf_counter()
        if self._times is None or self._times.step != step:
            self._begin_step(step, now, world)
        times = self._times
        if last:
            times.last_hook = now
        return times

    def _begin_step(self, step, now, world):
        """The first bucket of `step`: the last step's times become this rank's report."""
        prev = self._times
        self._reported = self._report = None
        if prev is not None and prev.step == step - 1 and None not in (
                prev.first_launch, prev.last_hook, prev.last_done):
            if self._last_done is not None:
                prev.compute = max(0.0, prev.last_hook - self._last_done)
                self._reported = prev
                self._report = prev.report(world)
            self._last_done = prev.last_done
        else:
            self._last_done = None
        self._times = _StepTimes(step)
        self._times.first_launch = now

    def _observe(self, combined, world):
        """The ranks' reports of one step, combined alike on every rank by the native reduce
        (every rank reported that step; otherwise there is no `combined`, on every rank
        alike): the controller's next density, observed as the C++ pipeline observes it."""
        mine = self._reported
        if combined.bytes_per_element > 0:
            self._controller.set_model(elements=mine.elements, ranks=world,
                                       bytes_per_element=combined.bytes_per_element,
                                       header_bytes=mine.header_bytes, latency_rounds=world - 1)
        self._controller.observe_report(combined)
        self.measurement = combined
        self.density = self._controller.density

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self):
        """The step count, the options and every parameter's residual (by number)."""
        residuals = {}
        for number in range(len(self._params)):
            r = self._residual_of(number)
            if r is not None:
                residuals[number] = r
        for number, r in self._carry.items():
            residuals.setdefault(number, r.clone())
        out = {"iter": self.iter, "density": self.density, "selector": self.selector,
               "values": self.values, "start_iter": self.start_iter, "residuals": residuals}
        if self._controller is not None:
            out["controller"] = self._controller.save_state()
        return out

    def load_state_dict(self, state_dict):
        """Restores `state_dict()`: the step count and the residuals, which each parameter's
        next send adds, and with `adaptive` the controller's estimates and density (a dict
        without them, saved by a fixed density, leaves the controller as it starts). The
        options stay this state's; a dict of another selector or value type raises
        ValueError."""
        who = "load_state_dict"
        _checks.entries(state_dict, ("iter", "selector", "values", "residuals"), who)
        for key in ("selector", "values"):
            _checks.same_option(state_dict[key], getattr(self, key), key, who)
        residuals = {}
        for number, r in state_dict["residuals"].items():
            residuals[int(number)] = _checks.flat_fp32(r, f"residual {number}", who).clone()
        if self._controller is not None and "controller" in state_dict:
            self._controller.load_state(state_dict["controller"])
            self.density = self._controller.density
        self._reset()
        self._carry = residuals
        self.iter = int(state_dict["iter"])
        self._times = self._reported = self._report = self._last_done = None
        self.measurement = None


def _allreduce_mean(group, world, grad):
    fut = dist.all_reduce(grad, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def compression_hook(state, bucket):
    """The DDP communication hook (see the module's documentation): `state.hook(bucket)`."""
    return state.hook(bucket)
