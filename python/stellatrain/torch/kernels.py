# SPDX-License-Identifier: Apache-2.0
"""stellatrain's compression kernels on CPU torch tensors, one at a time, for users who write
their own communication hooks (`stellatrain.torch.compression_hook` composes them per bucket).

    idx, val = kernels.select_topk(grad, k)                 # exact top k by magnitude
    ef = kernels.ErrorFeedback(selector="threshold", values="bf16")
    idx, val = ef.compress(0, grad, k)                      # acc = g + r; send top k; keep rest
    msg = kernels.pack(idx, val, grad.numel(), values_as="bf16")  # uint8 wire message
    idx, val = kernels.unpack(msg, grad.numel())            # validated: bad bytes raise
    mean = kernels.merge([(idx0, val0), (idx1, val1)], grad.numel())  # dense mean

Tensors are 1-D (any contiguous shape is read flat): values torch.float32, indices torch.int64
in strictly ascending order. A tensor of another dtype, device or layout, or a non-contiguous
one, raises an error that names the argument; nothing is copied or converted silently.
"""
import torch

from .. import _native
from . import _checks
from ._checks import choice, count, cpu_buffer, fp32_cpu_buffer

__all__ = ["select_topk", "pack", "unpack", "merge", "ErrorFeedback"]

_VALUES = ("fp32", "fp16", "bf16")
_SELECTORS = ("exact", "threshold", "sampled_threshold", "block", "random")
_threads = {}


def threads_handle(threads):
    """The native thread pool of `threads` threads (one per count, shared)."""
    _checks.threads(threads)
    if threads not in _threads:
        _threads[threads] = _native.Threads(threads)
    return _threads[threads]


def select_topk(x, k, *, threads=1):
    """The k elements of largest magnitude of `x` (float32, read flat): (indices int64
    ascending, values float32). Ties go to the lower index; NaN ranks above infinities."""
    fp32_cpu_buffer(x, "x")
    n = x.numel()
    k = min(count(k, "k"), n)
    indices = torch.empty(k, dtype=torch.int64)
    values = torch.empty(k, dtype=torch.float32)
    _native.select_topk(x.data_ptr(), n, k, indices.data_ptr(), values.data_ptr(),
                        threads_handle(threads))
    return indices, values


def pack(indices, values, size, *, values_as="fp32", tensor_id=0, tag=0, threads=1):
    """One wire message (uint8 tensor) holding the pairs of a tensor of `size` elements, values
    sent as fp32, fp16 or bf16 (rounded to nearest even). Indices must ascend strictly and lie
    below `size` (ValueError / IndexError otherwise)."""
    _checks.selection(indices, values)
    choice(values_as, "values_as", _VALUES)
    data = _native.pack(count(tensor_id, "tensor_id"), count(size, "size"), indices.data_ptr(),
                        values.data_ptr(), indices.numel(), values_as, count(tag, "tag"),
                        threads_handle(threads))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack(message, size, *, tensor_id=0, threads=1):
    """The pairs of a message from `pack` for tensor `tensor_id` of `size` elements: (indices
    int64, values float32). Every byte is validated first: a truncated, corrupted or foreign
    message raises ValueError saying what and where."""
    cpu_buffer(message, "message", torch.uint8)
    u = _native.Unpacker(threads_handle(threads))
    pairs = u.parse(count(tensor_id, "tensor_id"), count(size, "size"), message.data_ptr(),
                    message.numel())
    indices = torch.empty(pairs, dtype=torch.int64)
    values = torch.empty(pairs, dtype=torch.float32)
    u.decode_into(indices.data_ptr(), values.data_ptr(), pairs)
    return indices, values


def merge(selections, size, *, mean=True, threads=1):
    """The dense sum (or mean over the selections, `mean=True`) of sparse selections
    [(indices int64 ascending, values float32), ...] of a tensor of `size` elements, summed in
    list order."""
    inputs = []
    for i, (idx, val) in enumerate(selections):
        _checks.selection(idx, val, f"selections[{i}]")
        inputs.append((idx.data_ptr(), val.data_ptr(), idx.numel()))
    _checks.nonempty(inputs, "selections")
    out = torch.empty(count(size, "size"), dtype=torch.float32)
    _native.merge_dense(inputs, size, out.data_ptr(), bool(mean), threads_handle(threads))
    return out


class ErrorFeedback:
    """Error-feedback compression of tensors identified by an int id: per call, acc = g + r,
    the selector picks k elements of acc, they are sent as `values` (fp32, fp16 or bf16) and
    r = acc - sent, so nothing is lost over the steps. `selector`: 'exact' (top k),
    'threshold' (persistent per-tensor bound), 'sampled_threshold', 'block' (whole 64-byte
    blocks) or 'random'."""

    def __init__(self, selector="exact", values="fp32", *, seed=0, threads=1):
        choice(selector, "selector", _SELECTORS)
        choice(values, "values", _VALUES)
        self._codec = _native.Codec(selector, values, count(seed, "seed"),
                                    threads_handle(threads))
        self._sizes = {}

    def compress(self, tensor_id, grad, k):
        """One step of tensor `tensor_id` (registered on first use with grad's size; later
        calls must pass the same size): (indices int64, values float32 as sent)."""
        fp32_cpu_buffer(grad, "grad")
        n = grad.numel()
        self._register(count(tensor_id, "tensor_id"), n)
        self._codec.compress(tensor_id, grad.data_ptr(), n, count(k, "k"), 0)
        pairs, _ = self._codec.last_selection()
        indices = torch.empty(pairs, dtype=torch.int64)
        values = torch.empty(pairs, dtype=torch.float32)
        self._codec.selection_into(indices.data_ptr(), values.data_ptr(), pairs)
        return indices, values

    def residual(self, tensor_id):
        """A copy of the residual of `tensor_id` (flat float32)."""
        if tensor_id not in self._sizes:
            raise KeyError(f"tensor {tensor_id} has not been compressed yet")
        return torch.frombuffer(bytearray(self._codec.residual(tensor_id)), dtype=torch.float32)

    def _register(self, tensor_id, n):
        known = self._sizes.get(tensor_id)
        if known is None:
            self._codec.add(tensor_id, n, 0)
            self._sizes[tensor_id] = n
        elif known != n:
            raise ValueError(f"tensor {tensor_id} was registered with {known} elements, grad "
                             f"has {n}")
