# SPDX-License-Identifier: Apache-2.0
"""Every check of the package's arguments: the tensors handed to the native module, which sees
only addresses and sizes, and the options of the hook, the kernels and the optimizers.

Every check names the argument; nothing is copied or converted behind the caller's back. Each
returns the value it accepted.
"""
import math

import torch


def fp32_cpu_buffer(tensor, what):
    """Raises unless `tensor` is a dense, contiguous fp32 tensor in CPU memory."""
    return cpu_buffer(tensor, what, torch.float32)


def cpu_buffer(tensor, what, dtype):
    """Raises unless `tensor` is a dense, contiguous tensor of `dtype` in CPU memory."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what} must be in CPU memory, got device {tensor.device}")
    if tensor.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous (strides {tensor.stride()} for shape "
                         f"{tuple(tensor.shape)}); pass tensor.contiguous() explicitly")
    return tensor


def selection(indices, values, what=None):
    """Raises unless `indices` (int64) and `values` (fp32) are CPU buffers of one length; `what`
    names the pair (None: the arguments `indices` and `values`)."""
    cpu_buffer(indices, "indices" if what is None else f"{what} indices", torch.int64)
    fp32_cpu_buffer(values, "values" if what is None else f"{what} values")
    if indices.numel() != values.numel():
        if what is None:
            raise ValueError(f"indices has {indices.numel()} elements, values {values.numel()}")
        raise ValueError(f"{what}: {indices.numel()} indices, {values.numel()} values")
    return indices, values


def nonempty(value, name):
    """Raises unless the sequence `value` has an element."""
    if not value:
        raise ValueError(f"{name} is empty")
    return value


def count(value, name, at_least=0):
    """Raises unless `value` is an int (not a bool) >= `at_least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ValueError(f"{name} must be an int >= {at_least}, got {value!r}")
    return value


def threads(value):
    """Raises unless `value` is a thread count: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"threads must be an int >= 1, got {value!r}")
    return value


def choice(value, name, allowed):
    """Raises unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _real(value):
    return not isinstance(value, bool) and isinstance(value, (int, float))


def fraction(value, name):
    """Raises unless `value` is a number in (0, 1]."""
    if not _real(value) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def positive_finite(value, name):
    """Raises unless `value` is a finite number > 0."""
    if not _real(value) or not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def ordered(low, low_name, high, high_name):
    """Raises unless low <= high."""
    if low > high:
        raise ValueError(f"{low_name} {low} exceeds {high_name} {high}")
    return low, high


def number(value, name):
    """`value` as a float; raises TypeError naming it when it is not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def betas(value):
    """(beta1, beta2) as floats from a pair of numbers."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {value!r}")
    return number(value[0], "betas[0]"), number(value[1], "betas[1]")


def entries(state_dict, keys, who):
    """Raises unless the dict `state_dict` has every one of `keys`."""
    for key in keys:
        if key not in state_dict:
            raise ValueError(f"{who}: the dict has no {key!r} entry")
    return state_dict


def same_option(saved, current, key, who):
    """Raises unless the option `key` saved in a dict equals the one in force."""
    if saved != current:
        raise ValueError(f"{who}: saved with {key}={saved!r}, this state has {current!r}")
    return saved


def flat_fp32(tensor, what, who):
    """Raises unless `tensor` is a 1-D float32 tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 or tensor.dim() != 1:
        raise ValueError(f"{who}: {what} is not a 1-D float32 tensor")
    return tensor


def gradient_of(parameter, what):
    """The gradient of `parameter` (named `what`), checked: an fp32 CPU buffer of its shape."""
    grad = fp32_cpu_buffer(parameter.grad, f"the gradient of {what}")
    if grad.shape != parameter.shape:
        raise ValueError(f"the gradient of {what} has shape {tuple(grad.shape)}, the parameter "
                         f"{tuple(parameter.shape)}")
    return grad


def optimizer_state(state_dict, who):
    """Raises unless `state_dict` carries the native states of a stellatrain optimizer."""
    if "stellatrain" not in state_dict:
        raise ValueError(f"{who}: the dict holds no 'stellatrain' entry (it was not saved by a "
                         f"stellatrain optimizer: keys {sorted(state_dict)})")
    return state_dict


def byte_tensor(value, what, who):
    """Raises unless `value` is a uint8 tensor."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8:
        raise ValueError(f"{who}: {what} is not a uint8 tensor")
    return value
