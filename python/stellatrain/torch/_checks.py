# SPDX-License-Identifier: Apache-2.0
"""Checks of the tensors handed to the native module, which sees only addresses and sizes.

Every check names the argument; nothing is copied or converted behind the caller's back.
"""
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
