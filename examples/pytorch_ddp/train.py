#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A small CNN on Fashion-MNIST trained over Gloo by one method: PyTorch DDP with a
communication hook, none (DDP's dense allreduce), PyTorch's fp16_compress_hook, PyTorch's
PowerSGD, or stellatrain's compression_hook at a fixed density (stellatrain) or an adaptive one
(stellatrain-adaptive); or local steps with stellatrain.torch.LocalSteps: diloco (DiLoCo's
published method written from the paper, not its authors' code: fp32 pseudo-gradients every
--diloco-steps, outer Nesterov SGD 0.7/0.9) and stellatrain-local (every --local-steps, the
chunked codec, --local-topk of every 4096 at --local-bits, error feedback with decay 0.95, a
plain outer SGD of rate 1); or torchft's own DiLoCo and Streaming DiLoCo (torchft.local_sgd
from PyPI, scripts/install-torchft: torchft-diloco, torchft-streaming-diloco, the same H, inner
and outer optimizers as diloco; the streaming one in two fragments, fc1 and the rest, each
synchronised every H steps in turn, --streaming-delay steps of overlap). With clusters
(--clusters, or wan-emu's -c), stellatrain's local-steps methods run DDP inside each cluster and
the outer exchange between the clusters. Every method trains the same model from the same seed
on the same batches with the same (inner) optimizer for the same number of steps; the
local-steps methods are evaluated on the outer parameters.

One process per rank. The rank and world come from torch's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or from wan-emu's (WAN_EMU_RANK, WAN_EMU_SIZE, WAN_EMU_ADDRS: rank
0's address is the master); `--spawn N` starts N ranks on this machine instead (loopback).
Rank 0 writes OUT/METHOD.json: time to the target accuracy (training time only: evaluations are
not counted), final accuracy, step times, and the bytes each rank put on its network
interface per step (under wan-emu, where each rank has its own eth0).

    examples/pytorch_ddp/run.sh            # every method under wan-emu, then the table
    /usr/bin/python3 examples/pytorch_ddp/train.py --spawn 2 --method stellatrain --steps 20
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
LOCAL = ("diloco", "stellatrain-local")
TORCHFT = ("torchft-diloco", "torchft-streaming-diloco")
METHODS = HOOKS + LOCAL + TORCHFT
MEAN, STD = 0.2860, 0.3530  # of Fashion-MNIST's training pixels


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", "--hook", dest="method", choices=METHODS, required=True,
                   help="a DDP hook, or local steps (diloco, stellatrain-local, torchft's)")
    p.add_argument("--steps", type=int, default=400,
                   help="training steps (inner steps) of every method")
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
    p.add_argument("--diloco-steps", type=int, default=32,
                   help="inner steps H of diloco and of torchft's methods")
    p.add_argument("--streaming-delay", type=int, default=1,
                   help="torchft-streaming-diloco: steps its exchange overlaps")
    p.add_argument("--local-steps", type=int, default=8,
                   help="stellatrain-local's inner steps H")
    p.add_argument("--local-topk", type=int, default=64,
                   help="stellatrain-local: elements sent of every 4096")
    p.add_argument("--local-bits", type=int, choices=(1, 2), default=2,
                   help="stellatrain-local: bits per value sent")
    p.add_argument("--clusters", default=None,
                   help="ranks per cluster, e.g. 2,2 (default: wan-emu's -c, else one rank "
                        "per cluster): the local-steps methods run DDP inside each")
    p.add_argument("--target", type=float, default=0.82, help="test accuracy to reach, 0..1")
    p.add_argument("--stop-at-target", action="store_true",
                   help="end at the first evaluation at or above --target")
    p.add_argument("--max-seconds", type=float, default=0,
                   help="end at the first evaluation after this much training time (0: none)")
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
              (a.max_seconds >= 0, "--max-seconds must be >= 0"),
              (1 <= a.eval_samples <= 10000, "--eval-samples must be in 1..10000"),
              (a.spawn >= 0, "--spawn must be >= 0"),
              (a.diloco_steps >= 1, "--diloco-steps must be >= 1"),
              (a.method != "torchft-streaming-diloco" or a.diloco_steps % 2 == 0,
               "--diloco-steps must be even for torchft-streaming-diloco (two fragments)"),
              (0 <= a.streaming_delay < max(1, a.diloco_steps // 2),
               "--streaming-delay must be in [0, H/2)"),
              (a.local_steps >= 1, "--local-steps must be >= 1"),
              (1 <= a.local_topk <= 4096, "--local-topk must be in 1..4096")]
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
    """Registers the hook named by --method (none: DDP's own allreduce); returns stellatrain's
    state, else None."""
    if a.method == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.method == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=max(2, a.start_iter))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif a.method in ("stellatrain", "stellatrain-adaptive"):
        state = st.CompressionState(process_group=None, density=a.density, values=a.values,
                                    start_iter=a.start_iter,
                                    adaptive=a.method == "stellatrain-adaptive",
                                    min_density=a.min_density, max_density=a.max_density,
                                    exchange_ratio=a.exchange_ratio)
        ddp.register_comm_hook(state, st.compression_hook)
        return state
    return None


def cluster_sizes(a, world):
    """Ranks per cluster from --clusters or wan-emu's -c; None for one rank per cluster."""
    text = a.clusters or os.environ.get("WAN_EMU_CLUSTERS", "")
    if "," not in text:
        return None
    sizes = [int(x) for x in text.split(",")]
    if sum(sizes) != world:
        sys.exit(f"train.py: clusters {text} hold {sum(sizes)} ranks, the world {world}")
    return sizes


def local_steps(model, a, world):
    """The local-steps method named by --method around `model`: (the network to train, the
    LocalSteps optimizer)."""
    sizes = cluster_sizes(a, world)
    groups = None
    if sizes:
        if len(set(sizes)) != 1:
            sys.exit(f"train.py: the local-steps methods need clusters of one size, got {sizes}")
        first = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = st.clusters([list(range(f, f + n)) for f, n in zip(first, sizes)])
    net = model if groups is None else \
        nn.parallel.DistributedDataParallel(model, process_group=groups.cluster,
                                            bucket_cap_mb=a.bucket_mb)
    inner = st.optim.Adam(net.parameters(), lr=a.lr)
    common = dict(clusters=groups, replicas_in_sync=groups is not None, threads=1)
    if a.method == "diloco":
        opt = st.LocalSteps(net, inner, inner_steps=a.diloco_steps, codec="fp32", outer_lr=0.7,
                            outer_momentum=0.9, nesterov=True, **common)
    else:
        opt = st.LocalSteps(net, inner, inner_steps=a.local_steps, codec="chunked",
                            values=f"{a.local_bits}bit", chunk_bits=12, per_chunk=a.local_topk,
                            decay=0.95, outer_lr=1.0, outer_momentum=0.0, nesterov=False,
                            **common)
    return net, opt


def fragments_of(model, method):
    """The model in the fragments torchft synchronises: one, or (streaming) two."""
    if method == "torchft-diloco":
        return [model]
    return [model.fc1, nn.ModuleList([model.conv1, model.conv2, model.fc2])]


def torchft_method(model, inner, a, rank, world):
    """torchft's DiLoCo (one fragment) or Streaming DiLoCo (two) around `model` and `inner`,
    one replica group per rank: (the DiLoCo context, what to close at the end). Rank 0 runs the
    lighthouse; each rank advertises its own address (wan-emu's, else loopback)."""
    from datetime import timedelta

    from torchft._torchft import LighthouseServer
    from torchft.checkpointing import HTTPTransport
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    host = os.environ.get("WAN_EMU_ADDR", "127.0.0.1")
    master = os.environ["WAN_EMU_ADDRS"].split()[0] if "WAN_EMU_ADDRS" in os.environ \
        else "127.0.0.1"
    lighthouse, port = None, torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world,
                                      join_timeout_ms=60000, heartbeat_timeout_ms=5000)
        port[0] = int(lighthouse.address().rsplit(":", 1)[1])
    dist.broadcast(port, 0)
    # torchft's Manager connects to a store it does not start; it must live as long as training.
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)

    class Transport(HTTPTransport):
        # torchft advertises socket.gethostname(), which is no address of a wan-emu rank.
        def address(self):
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    timeout = timedelta(seconds=600)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
        min_replica_size=world, use_async_quorum=False, replica_id=f"replica_{rank}",
        lighthouse_addr=f"http://{master}:{int(port)}", hostname=host, port=0,
        store_addr=host, store_port=store.port, rank=0, world_size=1,
        init_sync=False,  # every rank starts from the same seed
        checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
        max_retries=1,  # a failed exchange raises instead of training on unsynchronised
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=60))
    fragments = fragments_of(model, a.method)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in fragments]
    streaming = {} if a.method == "torchft-diloco" else \
        {"fragment_sync_delay": a.streaming_delay, "fragment_update_alpha": 0.0}
    store_alive = [store]
    diloco = DiLoCo(manager, fragments, inner, outer if len(outer) > 1 else outer[0],
                    sync_every=a.diloco_steps, backup_device=torch.device("cpu"),
                    pin_memory=False, **streaming)

    def close():
        del store_alive[:]
        manager.shutdown(wait=False)
        if lighthouse is not None:
            lighthouse.shutdown()
    return diloco, close


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
    state, close = None, None
    if a.method in TORCHFT:
        ddp = model
        opt = st.optim.Adam(model.parameters(), lr=a.lr)
        diloco, close = torchft_method(model, opt, a, rank, world)
        diloco.__enter__()  # torchft's hooks on opt.step(): every H-th step synchronises
        evaluated = Net(a.hidden)

        def evaluation_model():
            # The fragments' global parameters, as torchft last synchronised them.
            evaluated.load_state_dict(model.state_dict())
            for mine, theirs in zip(fragments_of(evaluated, a.method), diloco._fragments):
                for name, t in theirs.original_parameters.items():
                    mine.get_parameter(name).data.copy_(t)
            return evaluated
    elif a.method in LOCAL:
        ddp, opt = local_steps(model, a, world)
        evaluated = Net(a.hidden)  # the outer parameters, at each evaluation

        def evaluation_model():
            nn.utils.vector_to_parameters(opt.outer_parameters, evaluated.parameters())
            return evaluated
    else:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
        state = register(ddp, a)
        opt = st.optim.Adam(ddp.parameters(), lr=a.lr)

        def evaluation_model():
            return model

    # Every rank draws the same permutation per epoch and takes its own stride of it, as
    # DistributedSampler does: no example twice within an epoch.
    per_epoch = len(y_train) // (a.batch * world)
    step_times, evals, densities = [], [], []
    train_time, time_to_target, steps_to_target, bytes_to_target = 0.0, None, None, None
    tx_start = tx_bytes()
    # Bytes and step times are those of the steady state: after the dense warm-up and a few
    # steps more.
    steady_from = min(a.steps - 1, a.start_iter + 5)
    tx0, ran = None, a.steps
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
        # backward(), so the step time is what the slowest rank sees (local steps: an outer
        # step waits for the exchange in opt.step()).
        dt = time.perf_counter() - t0
        step_times.append(dt)
        train_time += dt
        if state is not None:
            densities.append(state.density)  # of the next step
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            acc = accuracy(evaluation_model(), x_test[:a.eval_samples],
                           y_test[:a.eval_samples]) if rank == 0 else 0.0
            evals.append((step + 1, train_time, acc))
            if rank == 0 and time_to_target is None and acc >= a.target:
                time_to_target, steps_to_target = train_time, step + 1
                if tx_start is not None:
                    bytes_to_target = tx_bytes() - tx_start
            # Rank 0 decides whether to end here; the broadcast also keeps the evaluation out
            # of the next step's time on every rank.
            stop = torch.tensor([int(rank == 0 and (
                (a.stop_at_target and time_to_target is not None) or
                (a.max_seconds > 0 and train_time >= a.max_seconds)))])
            dist.broadcast(stop, 0)
            if stop.item():
                ran = step + 1
                break
    tx1 = tx_bytes()
    if close is not None:
        diloco.__exit__(None, None, None)
    final = accuracy(evaluation_model(), x_test, y_test) if rank == 0 else 0.0

    # Per rank: bytes on the wire per step, and the median step time, of the steady state.
    sent = float("nan") if tx0 is None else (tx1 - tx0) / (ran - steady_from)
    mine = torch.tensor([sent, statistics.median(step_times[min(steady_from, ran - 1):])],
                        dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if close is not None:
        close()
    if rank == 0:
        summary = {
            "method": a.method, "world": world, "target": a.target,
            "time_to_target_s": time_to_target, "steps_to_target": steps_to_target,
            "rank0_bytes_to_target": bytes_to_target,
            "final_accuracy": final, "train_time_s": train_time, "steps": ran,
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
        with open(os.path.join(a.out, f"{a.method}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        ttt = "not reached" if time_to_target is None else f"{time_to_target:.1f} s"
        print(f"{a.method}: {ran} steps in {train_time:.1f} s, target {a.target:.0%} "
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
