# SPDX-License-Identifier: Apache-2.0
"""Runs a function on W processes joined by a Gloo process group (a FileStore in a temporary
folder, so nothing listens on a port), with a deadline: a rank that hangs or dies fails the
test instead of stalling it. Each rank's return value comes back through a file."""
import os
import pickle
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, folder, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        dist.barrier()  # destroy right after training can hang a rank otherwise
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"result.{rank}"), "wb") as f:
        pickle.dump(result, f)


def run(fn, world, *args, timeout=120):
    """fn(rank, world, *args) on `world` processes; returns the list of their results."""
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_entry, args=(world, folder, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"the world of {world} ranks did not finish in {timeout} s")
        results = []
        for r in range(world):
            with open(os.path.join(folder, f"result.{r}"), "rb") as f:
                results.append(pickle.load(f))
        return results
