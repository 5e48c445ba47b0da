# SPDX-License-Identifier: Apache-2.0
"""A DDP communication hook that sends each gradient bucket as a compressed sparse selection
with error feedback, in the shape of PyTorch's PowerSGD hook:

    state = stellatrain.torch.CompressionState(process_group=None, density=0.01)
    model = torch.nn.parallel.DistributedDataParallel(model)
    model.register_comm_hook(state, stellatrain.torch.compression_hook)

Per bucket and step, on every rank: acc = g + r; the selector picks k = ceil(density * n)
elements of acc; they are packed in stellatrain's wire format (indices in the smallest
encoding, values as fp32, fp16 or bf16, a CRC-32C) and r = acc - sent. The messages of all
ranks are exchanged with one all_gather of uint8 tensors (each padded to a bound that every
rank computes alike, its true length in front), validated, and their mean written into the
bucket, summed in rank order: every rank gets the same bits.

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
- Tensors: CPU fp32 buckets. A bucket of another dtype or device raises TypeError /
  ValueError naming it (this build has no CUDA path).
"""
import math
import struct

import torch
import torch.distributed as dist

from .. import _native
from ._checks import fp32_cpu_buffer
from .kernels import _SELECTORS, _VALUES, _choice, _count, threads_handle

__all__ = ["CompressionState", "compression_hook"]

_VALUE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_LENGTH_BYTES = 8  # the true message length in front of each padded message


def message_bound(n, k, values):
    """Bytes of the largest message `compression_hook` can send for a bucket of n elements
    and k pairs: the wire format's headers plus raw indices (the encoding chosen is never
    larger) and the values."""
    index_bytes = 2 if n <= 1 << 16 else (4 if n <= 1 << 32 else 8)
    # message header 32 + trailer 4 + section header 40 + directory entry 16, and up to 8
    # bytes of alignment for each of the two payloads.
    return 32 + 4 + 40 + 16 + 16 + k * (index_bytes + _VALUE_BYTES[values])


class _Bucket:
    """What the state knows of one bucket index: its layout and the codec tensor behind it."""

    def __init__(self, codec_id, numbers, offsets, sizes, n):
        self.codec_id = codec_id
        self.numbers = numbers  # parameter numbers, in the bucket's order
        self.offsets = offsets  # their element offsets in the bucket
        self.sizes = sizes
        self.n = n


class CompressionState:
    """The state of `compression_hook` for one DDP model.

    Args:
        process_group: the group to exchange over (None: the default group).
        density: fraction of each bucket's elements sent per step, in (0, 1].
        selector: 'exact' (top k, the default), 'threshold' (persistent bound, one pass),
            'sampled_threshold', 'block' (whole 64-byte blocks) or 'random'.
        values: 'fp32', 'fp16' or 'bf16' (default): the type of the values on the wire.
        start_iter: steps that run the dense allreduce first (PowerSGD's warm-up).
        threads: threads of the native kernels (default 1; the backward pass runs beside).
        seed: seed of the 'random' selector.
    """

    def __init__(self, process_group=None, density=0.01, selector="exact", values="bf16",
                 start_iter=0, threads=1, seed=0):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or \
                not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        _choice(selector, "selector", _SELECTORS)
        _choice(values, "values", _VALUES)
        _count(start_iter, "start_iter")
        self.process_group = process_group
        self.density = float(density)
        self.selector = selector
        self.values = values
        self.start_iter = start_iter
        self.seed = seed
        self.iter = 0
        self._threads = threads_handle(threads)
        self._reset()
        # Bytes this rank put on the wire (padded messages) and steps done, for reports.
        self.bytes_sent = 0

    def _reset(self):
        self._codec = _native.Codec(self.selector, self.values, self.seed, self._threads)
        self._next_id = 0
        self._buckets = {}        # bucket index -> _Bucket
        self._numbers = {}        # id(parameter) -> its number
        self._params = []         # the parameters, by number (keeps the ids valid)
        self._homes = {}          # parameter number -> (codec id, offset, size)
        self._carry = {}          # parameter number -> residual to add before its next send

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
        b = _Bucket(codec_id, numbers, offsets, sizes, n)
        self._buckets[bucket.index()] = b
        return b

    def residual(self, parameter):
        """A copy of the residual of `parameter` (flat; zeros before its first send)."""
        number = self._numbers.get(id(parameter))
        r = None if number is None else self._residual_of(number)
        return torch.zeros(parameter.numel()) if r is None else r

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
        return {"iter": self.iter, "density": self.density, "selector": self.selector,
                "values": self.values, "start_iter": self.start_iter, "residuals": residuals}

    def load_state_dict(self, state_dict):
        """Restores `state_dict()`: the step count and the residuals, which each parameter's
        next send adds. The options stay this state's; a dict of another selector or value
        type raises ValueError."""
        for key in ("iter", "selector", "values", "residuals"):
            if key not in state_dict:
                raise ValueError(f"load_state_dict: the dict has no {key!r} entry")
        for key in ("selector", "values"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(f"load_state_dict: saved with {key}={state_dict[key]!r}, this "
                                 f"state has {getattr(self, key)!r}")
        residuals = {}
        for number, r in state_dict["residuals"].items():
            if not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or r.dim() != 1:
                raise ValueError(f"load_state_dict: residual {number} is not a 1-D float32 "
                                 f"tensor")
            residuals[int(number)] = r.clone()
        self._reset()
        self._carry = residuals
        self.iter = int(state_dict["iter"])


def _allreduce_mean(group, world, grad):
    fut = dist.all_reduce(grad, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def compression_hook(state, bucket):
    """The DDP communication hook (see the module's documentation)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    grad = bucket.buffer()
    fp32_cpu_buffer(grad, f"bucket {bucket.index()}")
    step = state.iter
    if bucket.is_last():
        state.iter += 1
    if step < state.start_iter:
        return _allreduce_mean(group, world, grad)

    n = grad.numel()
    k = min(n, max(1, math.ceil(state.density * n)))
    b = state._bucket_for(bucket, grad)
    for number, offset, size in zip(b.numbers, b.offsets, b.sizes):
        carry = state._carry.pop(number, None)
        if carry is not None:
            grad[offset:offset + size].add_(carry)

    bound = message_bound(n, k, state.values)
    nbytes = state._codec.compress(b.codec_id, grad.data_ptr(), n, k, step)
    if nbytes > bound:
        raise RuntimeError(f"stellatrain: bucket {bucket.index()}: message of {nbytes} bytes "
                           f"exceeds its bound {bound}")
    out = torch.empty(_LENGTH_BYTES + bound, dtype=torch.uint8)
    out[:_LENGTH_BYTES] = torch.frombuffer(bytearray(struct.pack("<Q", nbytes)),
                                           dtype=torch.uint8)
    state._codec.write(out.data_ptr() + _LENGTH_BYTES, bound)
    state.bytes_sent += out.numel()
    gathered = [torch.empty_like(out) for _ in range(world)]
    fut = dist.all_gather(gathered, out, group=group, async_op=True).get_future()
    codec, codec_id = state._codec, b.codec_id

    def reduce(_):
        messages = []
        for r, m in enumerate(gathered):
            (length,) = struct.unpack("<Q", m[:_LENGTH_BYTES].numpy().tobytes())
            if length > bound:
                raise ValueError(f"stellatrain: bucket {bucket.index()}: rank {r} announced a "
                                 f"message of {length} bytes, the bound is {bound}")
            messages.append((m.data_ptr() + _LENGTH_BYTES, length))
        codec.reduce(codec_id, n, messages, grad.data_ptr(), True)
        return grad

    return fut.then(reduce)
