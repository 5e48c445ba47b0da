# SPDX-License-Identifier: Apache-2.0
"""stellatrain on torch tensors: the DDP communication hook (`CompressionState`,
`compression_hook`), CPU optimizers (`stellatrain.torch.optim`) and the compression kernels
one at a time (`stellatrain.torch.kernels`)."""
from . import kernels, optim
from .ddp_hook import CompressionState, compression_hook

__all__ = ["CompressionState", "compression_hook", "kernels", "optim"]
