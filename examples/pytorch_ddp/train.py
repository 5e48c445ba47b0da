#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A small CNN on Fashion-MNIST trained with PyTorch DDP over Gloo, with one communication
hook: none (DDP's dense allreduce), PyTorch's fp16_compress_hook, PyTorch's PowerSGD, or
stellatrain's compression_hook at a fixed density (stellatrain) or an adaptive one
(stellatrain-adaptive). Every hook trains the same model from the same seed on the
same batches with the same optimizer for the same number of steps.

One process per rank. The rank and world come from torch's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or from wan-emu's (WAN_EMU_RANK, WAN_EMU_SIZE, WAN_EMU_ADDRS: rank
0's address is the master); `--spawn N` starts N ranks on this machine instead (loopback).
Rank 0 writes OUT/HOOK.json: time to the target accuracy (training time only: evaluations are
not counted), final accuracy, step times, and the bytes each rank put on its network
interface per step (under wan-emu, where each rank has its own eth0).

    examples/pytorch_ddp/run.sh            # every hook under wan-emu, then the table
    /usr/bin/python3 examples/pytorch_ddp/train.py --spawn 2 --hook stellatrain --steps 20
"""
import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time

# One thread per rank for torch and the BLAS under it (read when they load): the ranks of one
# machine share its cores, and oversubscribed BLAS threads slow every step down many times.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402 (after the thread settings)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: E402

import stellatrain  # noqa: E402
import stellatrain.torch as st  # noqa: E402

HOOKS = ("none", "fp16", "powersgd", "stellatrain", "stellatrain-adaptive")
MEAN, STD = 0.2860, 0.3530  # of Fashion-MNIST's training pixels


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hook", choices=HOOKS, required=True)
    p.add_argument("--steps", type=int, default=400, help="training steps of every hook")
    p.add_argument("--batch", type=int, default=32, help="examples per rank and step")
    p.add_argument("--hidden", type=int, default=4096, help="width of the hidden layer")
    p.add_argument("--bucket-mb", type=float, default=32,
                   help="DDP's bucket size, its first bucket's included (one bucket for the "
                        "default model)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam's learning rate")
    p.add_argument("--density", type=float, default=0.01,
                   help="stellatrain's density (stellatrain-adaptive: its first)")
    p.add_argument("--min-density", type=float, default=1e-3,
                   help="stellatrain-adaptive's lowest density")
    p.add_argument("--max-density", type=float, default=0.1,
                   help="stellatrain-adaptive's highest density")
    p.add_argument("--exchange-ratio", type=float, default=0.95,
                   help="stellatrain-adaptive's exchange time as a share of the compute")
    p.add_argument("--values", choices=("fp32", "fp16", "bf16"), default="bf16",
                   help="stellatrain's value type on the wire")
    p.add_argument("--powersgd-rank", type=int, default=1,
                   help="PowerSGD's matrix_approximation_rank")
    p.add_argument("--start-iter", type=int, default=10,
                   help="dense steps before PowerSGD and stellatrain compress")
    p.add_argument("--target", type=float, default=0.82, help="test accuracy to reach, 0..1")
    p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    p.add_argument("--eval-samples", type=int, default=2000,
                   help="test examples per evaluation (the final one uses all 10000)")
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                   help="folder of the four idx .gz files (Debian's dataset-fashion-mnist)")
    p.add_argument("--out", default="out/pytorch_ddp", help="folder of the summaries")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spawn", type=int, default=0,
                   help="start this many ranks on this machine (loopback) instead of one")
    a = p.parse_args(argv)
    checks = [(a.steps >= 1, "--steps must be >= 1"),
              (a.batch >= 1, "--batch must be >= 1"),
              (a.hidden >= 1, "--hidden must be >= 1"),
              (a.bucket_mb > 0, "--bucket-mb must be > 0"),
              (a.lr > 0, "--lr must be > 0"),
              (0 < a.density <= 1, "--density must be in (0, 1]"),
              (0 < a.min_density <= a.max_density <= 1,
               "--min-density and --max-density must satisfy 0 < min <= max <= 1"),
              (0 < a.exchange_ratio < float("inf"), "--exchange-ratio must be > 0"),
              (a.powersgd_rank >= 1, "--powersgd-rank must be >= 1"),
              (a.start_iter >= 0, "--start-iter must be >= 0"),
              (0 < a.target <= 1, "--target must be in (0, 1]"),
              (a.eval_every >= 1, "--eval-every must be >= 1"),
              (1 <= a.eval_samples <= 10000, "--eval-samples must be in 1..10000"),
              (a.spawn >= 0, "--spawn must be >= 0")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    for name in ("train-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        if not os.path.isfile(os.path.join(a.data, name)):
            p.error(f"--data: no {name} in {a.data} (apt-get install dataset-fashion-mnist)")
    return a


def read_idx(path, dims):
    """An idx file's contents as a uint8 array of `dims` dimensions (its magic checked)."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x800 + dims:
        raise ValueError(f"{path}: not an idx file of {dims} dimensions (magic {magic:#x})")
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes of data, the header says {shape}")
    return data.reshape(shape)


def load(folder, split):
    images = read_idx(os.path.join(folder, f"{split}-images-idx3-ubyte.gz"), 3)
    labels = read_idx(os.path.join(folder, f"{split}-labels-idx1-ubyte.gz"), 1)
    x = (torch.from_numpy(images.astype(np.float32)) / 255 - MEAN) / STD
    return x.unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


class Net(nn.Module):
    """Two small convolutions and a wide hidden layer: most of the parameters (and so of the
    traffic) are in the dense layer, as in the classifiers of larger vision models."""

    def __init__(self, hidden):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5, padding=2)
        self.conv2 = nn.Conv2d(8, 16, 5, padding=2)
        self.fc1 = nn.Linear(16 * 7 * 7, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def accuracy(model, x, y, batch=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / len(y)


def tx_bytes():
    """Bytes this rank's eth0 has sent, or None outside wan-emu (loopback is shared)."""
    if "WAN_EMU_RANK" not in os.environ:
        return None
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def register(ddp, a):
    """Registers the hook named by --hook (none: DDP's own allreduce); returns stellatrain's
    state, else None."""
    if a.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=max(2, a.start_iter))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif a.hook in ("stellatrain", "stellatrain-adaptive"):
        state = st.CompressionState(process_group=None, density=a.density, values=a.values,
                                    start_iter=a.start_iter,
                                    adaptive=a.hook == "stellatrain-adaptive",
                                    min_density=a.min_density, max_density=a.max_density,
                                    exchange_ratio=a.exchange_ratio)
        ddp.register_comm_hook(state, st.compression_hook)
        return state
    return None


def train(rank, world, a):
    torch.set_num_threads(1)
    x_train, y_train = load(a.data, "train")
    x_test, y_test = load(a.data, "t10k")
    torch.manual_seed(a.seed)
    model = Net(a.hidden)
    # PowerSGD's hook starts its second all-reduce of a bucket from a callback, so with
    # several buckets the ranks can issue their collectives in different orders, which Gloo
    # does not survive (a size mismatch aborts a rank). Every hook gets the same buckets: the
    # first bucket as large as the others (PyTorch reads this variable for that purpose).
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(a.bucket_mb * 2**20)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    state = register(ddp, a)
    opt = st.optim.Adam(ddp.parameters(), lr=a.lr)

    # Every rank draws the same permutation per epoch and takes its own stride of it, as
    # DistributedSampler does: no example twice within an epoch.
    per_epoch = len(y_train) // (a.batch * world)
    step_times, evals, densities = [], [], []
    train_time, time_to_target, steps_to_target = 0.0, None, None
    # Bytes and step times are those of the steady state: after the dense warm-up and a few
    # steps more.
    steady_from = min(a.steps - 1, a.start_iter + 5)
    for step in range(a.steps):
        if step == steady_from:
            tx0 = tx_bytes()
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(
                a.seed * 1000 + epoch))
        rows = order[(i * world + rank) * a.batch:(i * world + rank + 1) * a.batch]
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(ddp(x_train[rows]), y_train[rows]).backward()
        opt.step()
        # The step ends when every rank has its update: DDP waits for the exchange in
        # backward(), so the step time is what the slowest rank sees.
        dt = time.perf_counter() - t0
        step_times.append(dt)
        train_time += dt
        if state is not None:
            densities.append(state.density)  # of the next step
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            acc = accuracy(model, x_test[:a.eval_samples], y_test[:a.eval_samples]) \
                if rank == 0 else 0.0
            evals.append((step + 1, train_time, acc))
            if rank == 0 and time_to_target is None and acc >= a.target:
                time_to_target, steps_to_target = train_time, step + 1
            dist.barrier()  # evaluations stay out of the next step's time
    tx1 = tx_bytes()
    final = accuracy(model, x_test, y_test) if rank == 0 else 0.0

    # Per rank: bytes on the wire per step, and the median step time, of the steady state.
    sent = float("nan") if tx0 is None else (tx1 - tx0) / (a.steps - steady_from)
    mine = torch.tensor([sent, statistics.median(step_times[steady_from:])],
                        dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        summary = {
            "hook": a.hook, "world": world, "target": a.target,
            "time_to_target_s": time_to_target, "steps_to_target": steps_to_target,
            "final_accuracy": final, "train_time_s": train_time, "steps": a.steps,
            "step_time_s": max(float(t[1]) for t in everyone),
            "bytes_per_step": [None if np.isnan(float(t[0])) else float(t[0])
                               for t in everyone],
            "parameters": sum(p.numel() for p in model.parameters()),
            "evaluations": evals,
            "densities": densities,
            "options": {k: v for k, v in vars(a).items() if k != "spawn"},
            "versions": {"torch": torch.__version__, "stellatrain": stellatrain.__version__,
                         "python": platform.python_version()},
            "emulated_link": os.environ.get("PYTORCH_DDP_LINK"),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"{a.hook}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        ttt = "not reached" if time_to_target is None else f"{time_to_target:.1f} s"
        print(f"{a.hook}: {a.steps} steps in {train_time:.1f} s, target {a.target:.0%} "
              f"{ttt}, final accuracy {final:.2%}", flush=True)


def rank_entry(rank, world, a, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        train(rank, world, a)
        dist.barrier()  # destroy right after training can hang a rank otherwise
    finally:
        dist.destroy_process_group()


def main():
    a = parse_args()
    if a.spawn:
        import tempfile
        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(rank_entry, args=(a.spawn, a, f"file://{folder}/store"), nprocs=a.spawn)
        return
    env = os.environ
    if "WAN_EMU_RANK" in env:
        rank, world = int(env["WAN_EMU_RANK"]), int(env["WAN_EMU_SIZE"])
        master = env["WAN_EMU_ADDRS"].split()[0]
        env.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        init_method = f"tcp://{master}:{env.get('MASTER_PORT', '29500')}"
    elif "RANK" in env:
        rank, world, init_method = int(env["RANK"]), int(env["WORLD_SIZE"]), "env://"
    else:
        sys.exit("train.py: no rank given: set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, run "
                 "under wan-emu, or use --spawn N")
    rank_entry(rank, world, a, init_method)


if __name__ == "__main__":
    main()
