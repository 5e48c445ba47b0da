#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Prints the table of the example's summaries (OUT/<method>.json) as Markdown: time to the
target accuracy, final accuracy, bytes per step, bits per parameter and step, rank 0's bytes to
the target and step time per method, and the time to target against dense (method none)."""
import json
import os
import statistics
import sys

METHODS = ("none", "fp16", "powersgd", "stellatrain", "stellatrain-adaptive", "diloco",
           "torchft-diloco", "torchft-streaming-diloco", "stellatrain-local")
NAMES = {"none": "none (dense allreduce)", "fp16": "fp16_compress_hook",
         "powersgd": "PowerSGD", "stellatrain": "stellatrain"}


def describe(s):
    o = s["options"]
    method = s["method"]
    if method == "powersgd":
        return f"{NAMES['powersgd']} rank {o['powersgd_rank']}"
    if method == "stellatrain":
        return f"stellatrain {o['density']:.3g} {o['values']}"
    if method == "diloco":
        return (f"DiLoCo from the paper (LocalSteps fp32), H {o['diloco_steps']}, outer "
                f"Nesterov 0.7/0.9")
    if method == "torchft-diloco":
        return f"torchft DiLoCo (torchft.local_sgd), H {o['diloco_steps']}"
    if method == "torchft-streaming-diloco":
        return (f"torchft Streaming DiLoCo, H {o['diloco_steps']}, 2 fragments, overlap "
                f"{o['streaming_delay']}")
    if method == "stellatrain-local":
        return (f"stellatrain-local, H {o['local_steps']}, {o['local_topk']} of 4096 at "
                f"{o['local_bits']} bits")
    if method == "stellatrain-adaptive":
        warm = s["densities"][o["start_iter"]:] or [o["density"]]
        return (f"stellatrain adaptive {o['min_density']:.3g}..{o['max_density']:.3g} "
                f"{o['values']}, exchange {o['exchange_ratio']:.3g} of compute (median "
                f"{statistics.median(warm):.3g})")
    return NAMES[method]


def main(folder):
    rows = [json.load(open(os.path.join(folder, f"{m}.json")))
            for m in METHODS if os.path.isfile(os.path.join(folder, f"{m}.json"))]
    if not rows:
        sys.exit(f"table.py: no summaries in {folder}")
    dense = next((r for r in rows if r["method"] == "none"), None)
    first = rows[0]
    link = first["emulated_link"] or f"{first['world']} ranks, loopback"
    print(f"{link}; "
          f"at most {first['options']['steps']} steps, target {first['target']:.0%}, "
          f"{first['parameters']:,} parameters\n")
    print("| method | time to target | steps | final accuracy | MB per step and rank | "
          "bits per parameter and step | MB to target (rank 0) | step time | "
          "time to target vs dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ttt = r["time_to_target_s"]
        sent = [b for b in r["bytes_per_step"] if b is not None]
        speedup = "-"
        if dense and dense["time_to_target_s"] and ttt:
            speedup = f"{dense['time_to_target_s'] / ttt:.1f}x"
        # The busiest rank's bytes on its interface (headers included); none on loopback.
        mb = f"{max(sent) / 1e6:.3f}" if sent else "-"
        bits = f"{8 * max(sent) / r['parameters']:.3g}" if sent else "-"
        to_target = r.get("rank0_bytes_to_target")
        to_target = "-" if to_target is None else f"{to_target / 1e6:.1f}"
        print(f"| {describe(r)} | {'not reached' if ttt is None else f'{ttt:.1f} s'} | "
              f"{r['steps_to_target'] or '-'} | {r['final_accuracy']:.2%} | {mb} | {bits} | "
              f"{to_target} | {r['step_time_s'] * 1e3:.0f} ms | {speedup} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/pytorch_ddp")
