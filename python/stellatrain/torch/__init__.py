# SPDX-License-Identifier: Apache-2.0
"""stellatrain on torch tensors: the DDP communication hook (`CompressionState`,
`compression_hook`), local steps with a compressed outer exchange (`LocalSteps`, `clusters`),
CPU optimizers (`stellatrain.torch.optim`) and the compression kernels
one at a time (`stellatrain.torch.kernels`)."""
from . import kernels, optim
from .ddp_hook import CompressionState, compression_hook
from .local_steps import Clusters, LocalSteps, clusters

__all__ = ["Clusters", "CompressionState", "LocalSteps", "clusters", "compression_hook", "kernels",
           "optim"]
