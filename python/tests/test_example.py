# SPDX-License-Identifier: Apache-2.0
"""examples/pytorch_ddp: a few steps of every method with 2 processes on loopback, and its
table. The example's figures come from its run under wan-emu (examples/pytorch_ddp/run.sh);
this keeps the program working."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_ddp")
DATA = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(not os.path.isfile(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
                    reason="dataset-fashion-mnist is not installed")
def test_every_method_trains_and_the_table_lists_them(tmp_path):
    for method in ("none", "fp16", "powersgd", "stellatrain", "stellatrain-adaptive", "diloco",
                   "stellatrain-local"):
        subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), "--spawn", "2",
                        "--method", method, "--steps", "12", "--start-iter", "3",
                        "--eval-every", "4", "--eval-samples", "500", "--hidden", "256",
                        "--diloco-steps", "4", "--local-steps", "4", "--local-topk", "1024",
                        "--out", str(tmp_path)], check=True, timeout=300)
        s = json.loads((tmp_path / f"{method}.json").read_text())
        assert s["method"] == method and s["world"] == 2 and s["steps"] == 12
        assert [e[0] for e in s["evaluations"]] == [4, 8, 12]
        # 12 steps of 64 examples lift a 10-class model well above chance.
        assert s["final_accuracy"] > 0.4
        assert s["bytes_per_step"] == [None, None]  # loopback: no interface of its own
        assert s["step_time_s"] > 0
        if method in ("stellatrain", "stellatrain-adaptive"):
            assert len(s["densities"]) == 12
    table = subprocess.run([sys.executable, os.path.join(EXAMPLE, "table.py"), str(tmp_path)],
                           check=True, capture_output=True, text=True, timeout=60).stdout
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    names = [r.split(" | ")[0] for r in rows]
    assert names[:4] == ["| none (dense allreduce)", "| fp16_compress_hook",
                         "| PowerSGD rank 1", "| stellatrain 0.01 bf16"]
    assert len(names) == 7 and names[4].startswith(
        "| stellatrain adaptive 0.001..0.1 bf16, exchange 0.95 of compute (median ")
    assert names[5:] == ["| DiLoCo from the paper (LocalSteps fp32), H 4, outer Nesterov 0.7/0.9",
                         "| stellatrain-local, H 4, 1024 of 4096 at 2 bits"]


def test_bad_options_are_refused_before_any_work():
    for args, message in ((["--method", "gzip"], "invalid choice"),
                          (["--method", "diloco", "--diloco-steps", "0"],
                           "--diloco-steps must be >= 1"),
                          (["--method", "stellatrain-local", "--local-topk", "5000"],
                           "--local-topk must be in 1..4096"),
                          (["--method", "none", "--density", "0"], "--density must be in (0, 1]"),
                          (["--method", "stellatrain-adaptive", "--min-density", "0.2",
                            "--max-density", "0.1"], "--min-density and --max-density"),
                          (["--method", "none", "--steps", "0"], "--steps must be >= 1"),
                          (["--method", "none", "--data", "/nonexistent"], "--data: no")):
        r = subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


@pytest.mark.skipif(not os.path.isfile(os.path.join(DATA, "train-images-idx3-ubyte.gz")),
                    reason="dataset-fashion-mnist is not installed")
def test_diloco_from_local_steps_trains_as_torchfts_diloco(tmp_path):
    # The same algorithm from two codes: LocalSteps (fp32) and torchft's DiLoCo, on the same
    # seed, batches, inner Adam and outer Nesterov SGD.
    pytest.importorskip("torchft", reason="torchft is not installed (scripts/install-torchft)")
    runs = {}
    for method in ("diloco", "torchft-diloco", "torchft-streaming-diloco"):
        subprocess.run([sys.executable, os.path.join(EXAMPLE, "train.py"), "--spawn", "2",
                        "--method", method, "--steps", "24", "--diloco-steps", "8",
                        "--eval-every", "8", "--eval-samples", "500", "--hidden", "256",
                        "--out", str(tmp_path)], check=True, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs[method] = json.loads((tmp_path / f"{method}.json").read_text())
    ours, theirs = runs["diloco"], runs["torchft-diloco"]
    assert [e[0] for e in ours["evaluations"]] == [8, 16, 24]
    # Within one test example of 500 (of 10000 at the end): fp32 rounding may move one.
    for a, b in zip(ours["evaluations"], theirs["evaluations"]):
        assert abs(a[2] - b[2]) <= 0.002, (a, b)
    assert abs(ours["final_accuracy"] - theirs["final_accuracy"]) <= 0.002
    assert ours["final_accuracy"] > 0.6
    assert runs["torchft-streaming-diloco"]["final_accuracy"] > 0.6
