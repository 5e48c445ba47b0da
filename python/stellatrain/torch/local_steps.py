# SPDX-License-Identifier: Apache-2.0
"""Local steps (DiLoCo's outer loop) around a model and its inner optimizer: every rank trains
its replica for H inner steps, then the ranks exchange their pseudo-gradients (the outer
parameters minus the replica) compressed by stellatrain's chunked low-bit codec with error
feedback, or as fp32 (DiLoCo's own exchange), and an outer optimizer on the CPU steps the
outer parameters, which every replica then takes, bit for bit.

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = stellatrain.torch.LocalSteps(model, inner, inner_steps=32)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                  # the inner step; every H-th also the outer one

Between clusters (a fast LAN inside each, a slow link between them), `clusters()` makes the
process groups: DDP keeps a cluster's replicas equal over its own group, and each rank of a
cluster exchanges one shard of the pseudo-gradient with the ranks of the same index in the
other clusters, so that one selection per cluster and shard crosses the slow link:

    groups = stellatrain.torch.clusters([[0, 1], [2, 3]])
    model = torch.nn.parallel.DistributedDataParallel(model, process_group=groups.cluster)
    opt = stellatrain.torch.LocalSteps(model, inner, clusters=groups, replicas_in_sync=True)

The outer step, on every rank:
  pseudo-gradient = outer parameters - replica                  (fp32, host memory)
  clusters without replicas_in_sync: its mean over the cluster  (all_reduce over the cluster)
  this rank's shard (the whole of it without clusters) ->
    codec "chunked": top `per_chunk` of every 2^chunk_bits elements with error feedback
      (decay `decay`), values as 2-bit codes or 1-bit signs with per-chunk scales: one
      message of stellatrain's wire format (chunked section), all_gather over the peers,
      each message validated, their mean summed in rank order
    codec "fp32": all_reduce of the shard over the peers, divided by their number
  outer optimizer: stellatrain.torch.optim.SGD on the shard (DiLoCo's lr 0.7, momentum 0.9,
    Nesterov by default; SparseLoCo's plain SGD: outer_momentum=0, nesterov=False)
  clusters: all_gather of the shards over the cluster
  replica = outer parameters

Every rank computes the same bits: the messages are summed in rank order and the outer step is
deterministic. With H = 1, an inner SGD of rate lr, codec "fp32" and a plain outer SGD of rate
1 this is the per-step mean of the gradients with SGD of rate lr, up to rounding (tested).

- `min_inner_steps < max_inner_steps`: H is chosen after every outer step from the measured
  inner-step and exchange times (the slowest rank's, agreed by an all_reduce over
  `process_group`), so that the exchange takes about `exchange_share` of the time
  (`inner_steps_for` of pipeline/local_steps.hpp, the C++ outer loop's own rule).
- `state_dict()` / `load_state_dict()`: the outer parameters, the outer optimizer, the codec's
  error feedback (this rank's own), H and the step counts, the inner optimizer's state; the
  model's parameters are saved by the caller (`model.state_dict()`). A resumed run computes
  the same bits as one that did not stop (tested).
- Parameters: float32, on any device; the outer parameters, the pseudo-gradient and the codec
  live in host memory, so a device replica is copied to the host and back once per outer step.
  Only CPU parameters are tested here (no GPU in CI).
- Not here yet: streaming fragments (the C++ `streaming_local_steps` has them) and the
  weighted mean of a batch split across unequal ranks.
"""
import time

import torch
import torch.distributed as dist

from .. import _native
from . import _checks
from .kernels import threads_handle
from .optim import SGD

__all__ = ["Clusters", "LocalSteps", "clusters"]

_CODECS = ("chunked", "fp32")
_VALUES = ("2bit", "1bit")
_FORMAT = "stellatrain.LocalSteps/1"


class Clusters:
    """The process groups of one rank in equal clusters: `cluster` (its cluster's ranks, for
    DDP), `peers` (the ranks of its index in every cluster, for the outer exchange), `index`
    (its place in its cluster) and `size` (ranks per cluster). Made by `clusters()`."""

    def __init__(self, layout, cluster, peers, index):
        self.layout = layout
        self.cluster = cluster
        self.peers = peers
        self.index = index
        self.size = len(layout[0])


def clusters(layout):
    """The process groups of `layout`, a list of clusters, each a list of global ranks: every
    rank of the default group in exactly one cluster, the clusters of one size. A collective:
    every rank calls it with the same layout."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("clusters(): torch.distributed is not initialised")
    world = dist.get_world_size()
    layout = [list(c) for c in _checks.nonempty(layout, "layout")]
    size = len(layout[0])
    if size == 0 or any(len(c) != size for c in layout):
        raise ValueError(f"clusters(): the clusters must have one size >= 1, got sizes "
                         f"{[len(c) for c in layout]}")
    ranks = sorted(r for c in layout for r in c)
    if ranks != list(range(world)):
        raise ValueError(f"clusters(): the clusters must hold every rank 0..{world - 1} once, "
                         f"got {layout}")
    me = dist.get_rank()
    cluster = peers = None
    index = None
    # new_group is collective: every rank makes every group, in one order.
    for c in layout:
        g = dist.new_group(c)
        if me in c:
            cluster, index = g, c.index(me)
    for j in range(size):
        g = dist.new_group([c[j] for c in layout])
        if j == index:
            peers = g
    return Clusters(layout, cluster, peers, index)


class LocalSteps:
    """The outer loop of local steps around `model` (a torch.nn.Module, DDP-wrapped or not)
    and `inner_optimizer` (any torch optimizer over the model's parameters); see the module's
    documentation. Every rank of `process_group` (default: the default group) makes one with
    the same arguments, `clusters` from `clusters()` or None."""

    def __init__(self, model, inner_optimizer, *, inner_steps=32, outer_lr=0.7,
                 outer_momentum=0.9, nesterov=True, codec="chunked", values="2bit",
                 chunk_bits=12, per_chunk=64, decay=1.0, process_group=None, clusters=None,
                 replicas_in_sync=False, min_inner_steps=0, max_inner_steps=0,
                 exchange_share=0.1, threads=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LocalSteps: torch.distributed is not initialised")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        self.inner_steps = _checks.count(inner_steps, "inner_steps", 1)
        self.min_inner_steps = _checks.count(min_inner_steps, "min_inner_steps")
        self.max_inner_steps = _checks.count(max_inner_steps, "max_inner_steps")
        if self.min_inner_steps or self.max_inner_steps:
            _checks.count(min_inner_steps, "min_inner_steps", 1)
            _checks.ordered(min_inner_steps, "min_inner_steps", max_inner_steps,
                            "max_inner_steps")
        self.exchange_share = _checks.fraction(exchange_share, "exchange_share")
        if exchange_share == 1:
            raise ValueError("exchange_share must be below 1, got 1")
        self.codec = _checks.choice(codec, "codec", _CODECS)
        self.values = _checks.choice(values, "values", _VALUES)
        self.chunk_bits = _checks.count(chunk_bits, "chunk_bits", 1)
        if chunk_bits > 16:
            raise ValueError(f"chunk_bits must be in [1, 16], got {chunk_bits}")
        self.per_chunk = _checks.count(per_chunk, "per_chunk", 1)
        if per_chunk > 1 << chunk_bits:
            raise ValueError(f"per_chunk must be at most 2^chunk_bits = {1 << chunk_bits}, got "
                             f"{per_chunk}")
        self.decay = _checks.fraction(decay, "decay")
        self.replicas_in_sync = bool(replicas_in_sync)
        if threads is None:
            threads = torch.get_num_threads()
        self._threads = threads_handle(_checks.threads(threads))

        self.model = model
        self.inner_optimizer = inner_optimizer
        self._params = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dtype != torch.float32:
                raise TypeError(f"LocalSteps: parameter {name!r} must be torch.float32, got "
                                f"{p.dtype}")
            if p.layout != torch.strided:
                raise TypeError(f"LocalSteps: parameter {name!r} must be dense (strided)")
            self._params.append(p)
        if not self._params:
            raise ValueError("LocalSteps: the model has no parameter that requires a gradient")

        self._world = process_group if process_group is not None else dist.group.WORLD
        if clusters is None:
            self._cluster = None
            self._peers = self._world
            index, size = 0, 1
        else:
            if not isinstance(clusters, Clusters):
                raise TypeError(f"clusters must come from stellatrain.torch.clusters(), got "
                                f"{type(clusters).__name__}")
            self._cluster, self._peers = clusters.cluster, clusters.peers
            index, size = clusters.index, clusters.size
        self._layout = None if clusters is None else clusters.layout
        self.elements = sum(p.numel() for p in self._params)
        if self.elements < size:
            raise ValueError(f"LocalSteps: {self.elements} parameters cannot be cut into "
                             f"{size} shards")
        # Shards of one length (the outer buffer is padded with zeros that stay zero): the
        # cluster's all_gather needs equal pieces.
        self._shard_size = -(-self.elements // size)
        self._cluster_size = size
        self._lo = index * self._shard_size
        self._outer = torch.zeros(size * self._shard_size, dtype=torch.float32)
        self._replica = torch.zeros_like(self._outer)
        self._delta = torch.zeros_like(self._outer)
        self._load_replica(self._outer)
        shard = self._outer[self._lo:self._lo + self._shard_size]
        self._shard = torch.nn.Parameter(shard.clone())
        self._shard.grad = torch.zeros_like(self._shard)
        self._outer_optimizer = SGD([self._shard], lr=outer_lr, momentum=outer_momentum,
                                    nesterov=nesterov, threads=threads)
        self._peer_count = dist.get_world_size(self._peers)
        if self.codec == "chunked":
            self._codec = _native.Codec("chunked", self.values, 0, self._threads,
                                        chunk_bits=self.chunk_bits, decay=float(self.decay))
            self._codec.add(0, self._shard_size, 0)
            self._k = self._k_for(self._shard_size)
        self._send = None
        self._received = None

        self.steps = 0         # inner steps done
        self.outer_steps = 0   # outer steps done
        self._since_outer = 0  # inner steps since the last outer step
        self.wire_bytes = 0    # what this rank contributed to the outer exchanges
        self.last_exchange_seconds = None
        self.last_inner_step_seconds = None
        self._outer_done_at = time.perf_counter()

    # ------------------------------------------------------------------ the torch optimizer face
    def zero_grad(self, set_to_none=True):
        """The inner optimizer's zero_grad."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step (the inner optimizer's), and the outer step after every H-th; returns
        what the inner step returned."""
        loss = self.inner_optimizer.step() if closure is None else \
            self.inner_optimizer.step(closure)
        self.steps += 1
        self._since_outer += 1
        if self._since_outer >= self.inner_steps:
            self._outer_step()
        return loss

    @property
    def outer_parameters(self):
        """A copy of the outer parameters, flat (the model's parameters in their order)."""
        return self._outer[:self.elements].clone()

    def bits_per_parameter_and_step(self):
        """What this rank contributed to the outer exchanges so far, in bits per model
        parameter and inner step (0 before the first outer step)."""
        if self.steps == 0:
            return 0.0
        return 8.0 * self.wire_bytes / (self.elements * self.steps)

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self):
        """This rank's outer state (see the module's documentation)."""
        state = {
            "format": _FORMAT,
            "options": self._options(),
            "inner_steps": self.inner_steps,
            "steps": self.steps,
            "outer_steps": self.outer_steps,
            "since_outer": self._since_outer,
            "wire_bytes": self.wire_bytes,
            "outer": self._outer.clone(),
            "outer_optimizer": self._outer_optimizer.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
        }
        if self.codec == "chunked":
            state["codec"] = torch.frombuffer(bytearray(self._codec.save_state()),
                                              dtype=torch.uint8)
        return state

    def load_state_dict(self, state_dict):
        """Restores `state_dict()` of a LocalSteps with the same options and model shape;
        the model's parameters come from the caller. Nothing changes when it raises."""
        who = "LocalSteps.load_state_dict"
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise ValueError(f"{who}: not a state saved by LocalSteps.state_dict()")
        keys = ["options", "inner_steps", "steps", "outer_steps", "since_outer", "wire_bytes",
                "outer", "outer_optimizer", "inner_optimizer"]
        if self.codec == "chunked":
            keys.append("codec")
        _checks.entries(state_dict, keys, who)
        saved, current = state_dict["options"], self._options()
        for key in current:
            _checks.same_option(saved.get(key), current[key], key, who)
        outer = _checks.flat_fp32(state_dict["outer"], "outer", who)
        if outer.numel() != self._outer.numel():
            raise ValueError(f"{who}: {outer.numel()} outer parameters, this one has "
                             f"{self._outer.numel()}")
        inner_steps = _checks.count(state_dict["inner_steps"], "inner_steps", 1)
        before = self.state_dict()
        try:
            if self.codec == "chunked":
                codec = _checks.byte_tensor(state_dict["codec"], "codec", who)
                self._codec.load_state(bytes(codec.numpy()))
            self._outer_optimizer.load_state_dict(state_dict["outer_optimizer"])
            self.inner_optimizer.load_state_dict(state_dict["inner_optimizer"])
        except BaseException:
            if self.codec == "chunked":
                self._codec.load_state(bytes(before["codec"].numpy()))
            self._outer_optimizer.load_state_dict(before["outer_optimizer"])
            self.inner_optimizer.load_state_dict(before["inner_optimizer"])
            raise
        self._outer.copy_(outer)
        with torch.no_grad():
            self._shard.copy_(self._outer[self._lo:self._lo + self._shard_size])
        self.inner_steps = inner_steps
        self.steps = state_dict["steps"]
        self.outer_steps = state_dict["outer_steps"]
        self._since_outer = state_dict["since_outer"]
        self.wire_bytes = state_dict["wire_bytes"]

    # ----------------------------------------------------------------------------- the outer step
    def _options(self):
        return {"codec": self.codec, "values": self.values, "chunk_bits": self.chunk_bits,
                "per_chunk": self.per_chunk, "decay": self.decay, "elements": self.elements,
                "clusters": self._layout, "replicas_in_sync": self.replicas_in_sync}

    def _k_for(self, n):
        # The native codec takes k for the whole tensor and sends ceil(k 2^b / n) per chunk:
        # this k gives exactly `per_chunk` wherever n >= 2^b.
        chunk = 1 << self.chunk_bits
        return max(1, self.per_chunk * n // chunk)

    def _load_replica(self, out):
        """Copies the model's parameters, flat and in order, into `out`."""
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                out[offset:offset + n].copy_(p.detach().reshape(-1))
                offset += n

    def _store_replica(self):
        """Copies the outer parameters into the model's parameters."""
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                p.copy_(self._outer[offset:offset + n].view_as(p))
                offset += n

    def _outer_step(self):
        started = time.perf_counter()
        compute = (started - self._outer_done_at) / self._since_outer
        tag = self.outer_steps
        lo, s = self._lo, self._shard_size
        with torch.no_grad():
            self._load_replica(self._replica)
            torch.sub(self._outer, self._replica, out=self._delta)
            if self._cluster is not None and not self.replicas_in_sync:
                dist.all_reduce(self._delta, group=self._cluster)
                self._delta.div_(self._cluster_size)
            shard_delta = self._delta[lo:lo + s]
            mean = self._shard.grad
            if self.codec == "fp32":
                mean.copy_(shard_delta)
                dist.all_reduce(mean, group=self._peers)
                mean.div_(self._peer_count)
                self.wire_bytes += 4 * s
            else:
                nbytes = self._codec.compress(0, shard_delta.data_ptr(), s, self._k, tag)
                if self._send is None or self._send.numel() != nbytes:
                    # Every rank's message has this size: the chunked section's is fixed by
                    # the shard's length, b, k and the value bits.
                    self._send = torch.empty(nbytes, dtype=torch.uint8)
                    self._received = [torch.empty(nbytes, dtype=torch.uint8)
                                      for _ in range(self._peer_count)]
                self._codec.write(self._send.data_ptr(), nbytes)
                dist.all_gather(self._received, self._send, group=self._peers)
                self._codec.reduce(0, s, [(m.data_ptr(), m.numel()) for m in self._received],
                                   mean.data_ptr(), True, "stellatrain: LocalSteps")
                self.wire_bytes += nbytes
            self._outer_optimizer.step()
            if self._cluster is None:
                self._outer.copy_(self._shard)
            else:
                pieces = list(self._outer.view(self._cluster_size, s).unbind(0))
                dist.all_gather(pieces, self._shard.detach(), group=self._cluster)
            self._store_replica()
        self.outer_steps += 1
        self._since_outer = 0
        done = time.perf_counter()
        self.last_exchange_seconds = done - started
        self.last_inner_step_seconds = compute
        if self.min_inner_steps < self.max_inner_steps:
            # The slowest rank's times, the same on every rank, so that every rank picks one H.
            t = torch.tensor([compute, self.last_exchange_seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._world)
            self.inner_steps = _native.inner_steps_for(
                float(t[1]), float(t[0]), float(self.exchange_share), self.min_inner_steps,
                self.max_inner_steps, self.inner_steps)
        self._outer_done_at = time.perf_counter()
