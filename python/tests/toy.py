# SPDX-License-Identifier: Apache-2.0
"""The small model and the per-rank batches the distributed tests train."""
import torch


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 30),
                               torch.nn.ReLU(), torch.nn.Linear(30, 5))


def batch(rank, step):
    """Rank `rank`'s batch of step `step`: 16 examples of 20 features, 5 classes."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
