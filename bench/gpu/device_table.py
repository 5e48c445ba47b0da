#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prints the table of the GPU device check from bench_select_cuda's JSON output and, when
given, torch_topk.py's: N, k, our time, torch time, ratio (torch / ours), passes over the input
(2 x time / time of a device-to-device copy of the input). Then the issue's targets:
  exact top-k at N = 1e8, k = 1%: <= 3 passes;
  >= 2x faster than torch.topk(g.abs(), k) for N >= 1e7;
  fused error feedback + selection <= 1.5x a kernel that reads g and residual, writes residual.

  device_table.py BENCH.json [TORCH.json]
"""
import json
import re
import sys

UNITS = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def load_bench(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rows = {}
    for b in data.get("benchmarks", []):
        if b.get("error_occurred") or b.get("run_type", "iteration") != "iteration":
            continue
        m = re.match(r"(BM_\w+)/n:(\d+)(?:/permille:(\d+))?", b["name"])
        if not m:
            continue
        key = (m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else None)
        b["us"] = b["real_time"] * UNITS[b.get("time_unit", "ns")]
        rows[key] = b
    return rows


def fmt(v, spec):
    return format(v, spec) if v is not None else "-"


def main():
    bench = load_bench(sys.argv[1])
    torch_rows = {}
    torch_note = "torch: not measured (python3 with CUDA-enabled torch not found)"
    if len(sys.argv) > 2:
        with open(sys.argv[2], encoding="utf-8") as f:
            t = json.load(f)
        torch_note = f"torch {t['torch']} on {t['device']}"
        torch_rows = {(r["n"], r["permille"]): r["mean_us"] for r in t["rows"]}

    sizes = sorted({k[1] for k in bench if k[0] == "BM_select_cuda_topk"})
    print("exact top-k, fp32 (select_topk) vs torch.topk(g.abs(), k); " + torch_note)
    print(f"{'N':>11} {'k':>10} {'ours_us':>10} {'torch_us':>10} {'torch/ours':>10} {'passes':>7}")
    results = {"passes_1e8_1pct": None, "speedups": [], "feedback": []}
    for n in sizes:
        for permille in (1, 10, 100):
            b = bench.get(("BM_select_cuda_topk", n, permille))
            if b is None:
                continue
            ours = b["us"]
            torch_us = torch_rows.get((n, permille))
            ratio = torch_us / ours if torch_us else None
            passes = b.get("passes")
            print(f"{n:>11} {n * permille // 1000:>10} {ours:>10.1f} {fmt(torch_us, '>10.1f'):>10} "
                  f"{fmt(ratio, '>10.2f'):>10} {fmt(passes, '>7.2f'):>7}")
            if n == 100_000_000 and permille == 10:
                results["passes_1e8_1pct"] = passes
            if n >= 10_000_000 and ratio is not None:
                results["speedups"].append((n, permille, ratio))

    for name, title in (("BM_select_cuda_topk_bf16", "exact top-k, bf16"),
                        ("BM_select_cuda_threshold", "threshold top-k (persistent threshold, steady state), fp32"),
                        ("BM_select_cuda_feedback", "fused error feedback + exact top-k, fp32"),
                        ("BM_select_cuda_feedback_threshold", "fused error feedback + threshold top-k, fp32")):
        keys = sorted(k for k in bench if k[0] == name)
        if not keys:
            continue
        print()
        print(title)
        feedback = "feedback" in name
        print(f"{'N':>11} {'k':>10} {'us':>10} {'passes':>7}" + (f" {'x_bound':>8}" if feedback else ""))
        for key in keys:
            b = bench[key]
            line = f"{key[1]:>11} {key[1] * key[2] // 1000:>10} {b['us']:>10.1f} {fmt(b.get('passes'), '>7.2f'):>7}"
            if feedback:
                line += f" {fmt(b.get('x_baseline'), '>8.2f'):>8}"
                if name == "BM_select_cuda_feedback" and key[1] == 100_000_000:
                    results["feedback"].append((key[2], b.get("x_baseline")))
            print(line)

    print()
    print("targets (issue 4):")
    p = results["passes_1e8_1pct"]
    print(f"  exact top-k N=1e8 k=1%: {fmt(p, '.2f')} passes (<= 3): "
          f"{'met' if p is not None and p <= 3 else 'NOT met' if p is not None else 'not measured'}")
    if results["speedups"]:
        worst = min(results["speedups"], key=lambda r: r[2])
        print(f"  vs torch.topk, N >= 1e7: worst {worst[2]:.2f}x at N={worst[0]} permille={worst[1]} (>= 2x): "
              f"{'met' if worst[2] >= 2 else 'NOT met'}")
    else:
        print("  vs torch.topk, N >= 1e7: not measured")
    for permille, x in results["feedback"]:
        print(f"  error feedback + selection N=1e8 permille={permille}: {fmt(x, '.2f')}x the bound (<= 1.5): "
              f"{'met' if x is not None and x <= 1.5 else 'NOT met' if x is not None else 'not measured'}")


if __name__ == "__main__":
    main()
