#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Times torch.topk(g.abs(), k) on the sizes of bench_select_cuda (CUDA events, mean of 20
calls after 3 warm-up calls) and writes a JSON list of {n, permille, k, mean_us}.

  torch_topk.py OUT.json
"""
import json
import sys

import torch


def main():
    out_path = sys.argv[1]
    rows = []
    for n in (10**6, 10**7, 10**8):
        g = torch.randn(n, device="cuda", dtype=torch.float32)
        for permille in (1, 10, 100):
            k = n * permille // 1000
            for _ in range(3):
                torch.topk(g.abs(), k)
            torch.cuda.synchronize()
            total_ms = 0.0
            calls = 20
            for _ in range(calls):
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                torch.topk(g.abs(), k)
                stop.record()
                stop.synchronize()
                total_ms += start.elapsed_time(stop)
            rows.append({"n": n, "permille": permille, "k": k, "mean_us": total_ms / calls * 1000.0})
        del g
        torch.cuda.empty_cache()
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()
