#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Scenarios, each a set of runs of the end-to-end trainer (4 in-process ranks, their uplinks
shaped by the library), summed up in one table per scenario: the holistic configuration's two
(heterogeneous, fluctuating: one rank per cluster), and every mode side by side in 2 clusters
of 2 (modes, home).

heterogeneous: rank 3 computes 2x slower than the others. Every rank emulates a device of a
  given speed (--device-rate): it computes its forward and backward for real, then waits until
  its batch over the device's rate has passed, so the four ranks do not measure each other's
  share of this machine's cores; rank 3's device has half the rate. The equal split against
  the holistic split (by the ranks' measured compute, agreed after 3 steps, then every 5).
fluctuating: the uplinks change 500 -> 50 -> 200 Mbit/s during training; the adaptive density
  against fixed densities of 0.1%, 0.3%, 1% and 3%.
modes: every mode of the trainer (dense, dense-hier, diloco, stellatrain, stellatrain-hier,
  stellatrain-local) in one run, 2 clusters of 2, uplinks of 100 Mbit/s and 20 ms RTT (the
  demo's network): time to target, final accuracy, the bytes over each uplink to the target
  and bits per parameter and step.
home: the same at 10 Mbit/s (a home connection), each mode ending at its target
  (--stop-at-target: dense needs about 9 s per step there); the final accuracy is then the
  one at the target, on the whole test set.

Writes <out>/<scenario>/<run>/{summary.json,curve.csv,curve.png} and <out>/<scenario>.json;
prints the table.

  scripts/scenarios.py SCENARIO --trainer PATH [--out DIR] [--seeds 1,2,3] [-- trainer options]
  scripts/scenarios.py SCENARIO --list-variants   (what bench/wan/run.sh runs)

Trainer options after -- go to every run, in place of the scenario's own where they name the
same option (-- --epochs 0.3 for a quick look).

--seeds runs the whole scenario once per seed of the trainer (its initial parameters and data
order), into <out>/<scenario>/seed-<seed>/<run>, prints each seed's table and then the medians
over the seeds, from which the scenario's ratios are taken. Near its end a run's test accuracy
moves by about a point from one evaluation to the next, so the step at which one run crosses
the target is a noisy draw; a single run per configuration compares draws, the medians compare
configurations.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

# The heterogeneous scenario's devices: 2048 examples/s (rank 3: 1024), 256 examples per
# rank and step on average.
DEVICE_RATE = 2048.0
SLOW_FACTOR = 2.0
HETEROGENEOUS = [
    "--mode", "stellatrain", "--batch", "256", "--epochs", "1", "--target", "0.82",
    "--device-rate", str(DEVICE_RATE), "--slow-rank", f"3:{SLOW_FACTOR}", "--split-interval", "5",
]
FLUCTUATING = ["--mode", "stellatrain", "--epochs", "1.5", "--target", "0.86"]
FIXED_DENSITIES = [0.001, 0.003, 0.01, 0.03]
# Each scenario's runs: a name and the trainer options of that run, the network aside.
VARIANTS = {
    "heterogeneous": [(split, HETEROGENEOUS + ["--split", split])
                      for split in ("equal", "holistic")],
    "fluctuating": [("adaptive", FLUCTUATING + ["--min-density", "0.001", "--max-density", "0.03"])]
    + [(f"fixed-{d}", FLUCTUATING + ["--min-density", str(d), "--max-density", str(d)])
       for d in FIXED_DENSITIES],
    "modes": [("all", ["--mode", "all"])],
    "home": [("all", ["--mode", "all", "--stop-at-target"])],
}
# The network in process: 4 ranks, one per cluster; the fluctuating scenario's uplinks at 500
# Mbit/s, 50 from 5 s of training on, 200 from 10 s on (the model reaches its target in about
# 10 s here, so the phases are that much shorter than 20 s). Under wan-emu (bench/wan/run.sh)
# the emulated network replaces these.
PHASES = "5:50,10:200"
NETWORK = {
    "heterogeneous": ["--clusters", "1,1,1,1"],
    "fluctuating": ["--clusters", "1,1,1,1", "--bandwidth", "500", "--bandwidth-schedule", PHASES],
    "modes": ["--clusters", "2,2", "--bandwidth", "100", "--rtt", "20"],
    "home": ["--clusters", "2,2", "--bandwidth", "10", "--rtt", "20"],
}


def merged(args, extra):
    """The scenario's options (each a name and one value, or a flag) without those that
    `extra` gives again, then `extra`."""
    given = {a.split("=")[0] for a in extra if a.startswith("--")}
    kept = []
    i = 0
    while i < len(args):
        n = 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        if args[i] not in given:
            kept += args[i:i + n]
        i += n
    return kept + extra


def train_all(trainer, out, name, args, extra):
    """One run of the trainer: its summary.json."""
    run_dir = out / name
    command = [trainer, *merged(args, extra), "--out", str(run_dir)]
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        sys.exit(f"scenarios: {name} failed with exit status {done.returncode}")
    return json.loads((run_dir / "summary.json").read_text())


def train(trainer, out, name, args, extra):
    return train_all(trainer, out, name, args, extra)["modes"]["stellatrain"]


def median_slowest(values):
    """The median, a missing value (a target not reached) counting as the slowest (inf)."""
    return statistics.median([v if v is not None else float("inf") for v in values])


def fmt_time(t):
    return "not reached" if t is None else f"{t:.2f} s"


def heterogeneous(trainer, out, extra):
    runs = {name: train(trainer, out, name, NETWORK["heterogeneous"] + args, extra)
            for name, args in VARIANTS["heterogeneous"]}
    ranks = len(runs["equal"]["curve"][0]["batches"])
    rates = [DEVICE_RATE / (SLOW_FACTOR if r == 3 else 1.0) for r in range(ranks)]
    global_batch = sum(runs["equal"]["curve"][0]["batches"])
    ideal_compute = global_batch / sum(rates)

    def steady(mode):
        # The points after the first split decision (the full test set's has no step time).
        points = [p for p in mode["curve"][1:] if p["step_seconds"] > 0]
        step = statistics.median(p["step_seconds"] for p in points)
        compute = statistics.median(max(p["compute_seconds"]) for p in points)
        return step, compute, points[-1]["batches"]

    # The exposed exchange of a run: its step time beyond its slowest rank's compute.
    rows = []
    for split, mode in runs.items():
        step, compute, batches = steady(mode)
        exposed = max(0.0, step - compute)
        rows.append({
            "split": split, "batches": batches, "step_s": step, "slowest_compute_s": compute,
            "exposed_exchange_s": exposed, "ideal_step_s": ideal_compute + exposed,
            "step_over_ideal": step / (ideal_compute + exposed),
            "time_to_target_s": mode["time_to_target_s"], "steps_to_target": mode["steps_to_target"],
            "final_accuracy": mode["final_accuracy"], "split_changes": mode["split_changes"],
        })
    # Stricter: against the least exposed exchange of the two runs.
    least = min(r["exposed_exchange_s"] for r in rows)
    for r in rows:
        r["step_over_ideal_least_exposed"] = r["step_s"] / (ideal_compute + least)
    eq, ho = rows
    speedup = None
    if eq["time_to_target_s"] and ho["time_to_target_s"]:
        speedup = eq["time_to_target_s"] / ho["time_to_target_s"]
    print(f"\nheterogeneous: 4 ranks, devices of {DEVICE_RATE:g} examples/s, rank 3's of "
          f"{DEVICE_RATE / SLOW_FACTOR:g}; global batch {global_batch}; ideal compute = "
          f"{global_batch} / {sum(rates):g} examples/s = {ideal_compute * 1e3:.1f} ms; ideal "
          f"step = ideal compute + the run's exposed exchange (in brackets: + the least exposed "
          f"exchange of the two runs)\n")
    print("| split | batches | step (ms) | slowest compute (ms) | exposed exchange (ms) "
          "| step / ideal | time to target | steps | final acc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['split']} | {','.join(map(str, r['batches']))} | {r['step_s'] * 1e3:.1f} | "
              f"{r['slowest_compute_s'] * 1e3:.1f} | {r['exposed_exchange_s'] * 1e3:.1f} | "
              f"{r['step_over_ideal']:.3f} ({r['step_over_ideal_least_exposed']:.3f}) | "
              f"{fmt_time(r['time_to_target_s'])} | {r['steps_to_target'] or '-'} | "
              f"{r['final_accuracy'] * 100:.2f}% |")
    if speedup:
        print(f"\ntime to target, equal / holistic: {speedup:.2f}x; final accuracy difference "
              f"{(ho['final_accuracy'] - eq['final_accuracy']) * 100:+.2f} points")
    return {"ideal_compute_s": ideal_compute, "rows": rows,
            "time_to_target_speedup": speedup}


def recovery(timeline):
    """For each change of the link rate: the new rate, its steady step time (the median of the
    phase's steps after its first 10) and the steps until the mean of five in a row is within
    1.2x of it (the mean, as every fifth step also waits for an evaluation's drain)."""
    times = [b["seconds"] - a["seconds"] for a, b in zip(timeline, timeline[1:])]
    rates = [p["link_mbps"] for p in timeline[1:]]
    changes = [i for i in range(1, len(rates)) if rates[i] != rates[i - 1]]
    out = []
    for n, start in enumerate(changes):
        end = changes[n + 1] if n + 1 < len(changes) else len(times)
        phase = times[start:end]
        if len(phase) < 20:
            out.append({"link_mbps": rates[start], "steps_in_phase": len(phase)})
            continue
        steady = statistics.median(phase[10:])
        k = next((k for k in range(len(phase) - 4)
                  if statistics.fmean(phase[k:k + 5]) <= 1.2 * steady), None)
        out.append({"link_mbps": rates[start], "steady_step_s": steady, "steps_to_steady": k,
                    "steps_in_phase": len(phase)})
    return out


def fluctuating(trainer, out, extra):
    names = ["adaptive"] + [f"fixed {d * 100:g}%" for d in FIXED_DENSITIES]
    runs = {label: train(trainer, out, name, NETWORK["fluctuating"] + args, extra)
            for label, (name, args) in zip(names, VARIANTS["fluctuating"])}
    rows = []
    for name, mode in runs.items():
        rows.append({"run": name, "time_to_target_s": mode["time_to_target_s"],
                     "steps_to_target": mode["steps_to_target"],
                     "final_accuracy": mode["final_accuracy"],
                     "wan_mb_per_cluster": mode["wan_bytes_per_cluster"] / 1e6,
                     "phases": recovery(mode["timeline"])})
    fixed = [r["time_to_target_s"] for r in rows[1:]]
    reached = [t for t in fixed if t is not None]
    best = min(reached) if reached else None
    # A fixed density that never reaches the target counts as slower than every one that does.
    median = median_slowest(fixed)
    adaptive = rows[0]["time_to_target_s"]
    print(f"\nfluctuating: 4 ranks, uplinks 500 Mbit/s, then {PHASES} (seconds:Mbit/s of "
          f"training time)\n")
    print("| run | time to target | steps | final acc | WAN MB/cluster | steady step (ms) "
          "at 50 / 200 Mbit/s | steps to steady |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        steady = " / ".join(f"{p['steady_step_s'] * 1e3:.1f}" if "steady_step_s" in p else "-"
                            for p in r["phases"])
        k = " / ".join(str(p.get("steps_to_steady", "-")) for p in r["phases"])
        print(f"| {r['run']} | {fmt_time(r['time_to_target_s'])} | {r['steps_to_target'] or '-'} "
              f"| {r['final_accuracy'] * 100:.2f}% | {r['wan_mb_per_cluster']:.1f} | {steady} "
              f"| {k} |")
    result = {"rows": rows, "best_fixed_s": best, "median_fixed_s": median}
    if adaptive is not None and best is not None:
        result["adaptive_over_best"] = adaptive / best
        result["median_over_adaptive"] = median / adaptive
        print(f"\nadaptive / best fixed: {adaptive / best:.2f}x; median fixed / adaptive: "
              + (f"{median / adaptive:.2f}x" if median != float("inf") else
                 "the median fixed density does not reach the target"))
    return result


def modes(scenario):
    """The modes scenario or the home one: every mode in one run of the trainer."""
    def run(trainer, out, extra):
        name, args = VARIANTS[scenario][0]
        summary = train_all(trainer, out, name, NETWORK[scenario] + args, extra)
        o = summary["options"]
        network = (f"clusters {o['clusters']}, uplinks {o['bandwidth_mbps']:g} Mbit/s, "
                   f"{o['rtt_ms']:g} ms RTT")
        rows = []
        for mode, m in summary["modes"].items():
            to_target = m.get("wan_bytes_per_cluster_to_target")
            rows.append({"mode": mode, "time_to_target_s": m["time_to_target_s"],
                         "steps_to_target": m["steps_to_target"],
                         "final_accuracy": m["final_accuracy"], "steps": m["steps"],
                         "wan_mb_to_target": None if to_target is None else to_target / 1e6,
                         "bits_per_parameter_and_step": m["wan_bits_per_parameter_and_step"]})
        print_modes(rows, scenario, network, "")
        return {"network": network, "rows": rows}
    return run


def fmt_number(v, pattern):
    return "-" if v is None else pattern.format(v)


def print_modes(rows, scenario, network, title):
    print(f"\n{scenario}{title}: {network}; WAN figures per cluster; bits per parameter and "
          "(inner) step over the uplinks\n")
    print("| mode | time to target | steps to target | final acc | WAN MB to target | "
          "bits/param/step | vs dense |")
    print("|---|---|---|---|---|---|---|")
    dense = next((r["time_to_target_s"] for r in rows if r["mode"] == "dense"), None)
    for r in rows:
        t = r["time_to_target_s"]
        ratio = f"{dense / t:.1f}x" if dense and t else "-"
        print(f"| {r['mode']} | {fmt_time(t)} | {fmt_number(r['steps_to_target'], '{:g}')} | "
              f"{r['final_accuracy'] * 100:.2f}% | {fmt_number(r['wan_mb_to_target'], '{:.2f}')} | "
              f"{r['bits_per_parameter_and_step']:.4f} | {ratio} |")


def over_seeds_modes(scenario):
    def combine(results):
        rows = []
        for i, first in enumerate(results[0]["rows"]):
            runs = [r["rows"][i] for r in results]
            rows.append({"mode": first["mode"],
                         "times_s": [r["time_to_target_s"] for r in runs],
                         "time_to_target_s": median_or_none([r["time_to_target_s"] for r in runs]),
                         "steps_to_target": median_or_none([r["steps_to_target"] for r in runs]),
                         "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
                         "wan_mb_to_target": median_or_none([r["wan_mb_to_target"] for r in runs]),
                         "bits_per_parameter_and_step": statistics.median(
                             r["bits_per_parameter_and_step"] for r in runs)})
        print_modes(rows, scenario, results[0]["network"], ", medians over the seeds (a missed "
                    "target counts as the slowest)")
        print("\ntime to target per seed: " + "; ".join(
            f"{r['mode']} " + ", ".join(fmt_number(t, "{:.2f}") for t in r["times_s"])
            for r in rows))
        return {"rows": rows}
    return combine


def median_or_none(values):
    """median_slowest, None where that is a missing value."""
    m = median_slowest(values)
    return None if m == float("inf") else m


def over_seeds_heterogeneous(results):
    rows = []
    for i, first in enumerate(results[0]["rows"]):
        runs = [r["rows"][i] for r in results]
        rows.append({"split": first["split"],
                     "time_to_target_s": median_or_none([r["time_to_target_s"] for r in runs]),
                     "step_over_ideal": statistics.median(r["step_over_ideal"] for r in runs),
                     "final_accuracy": statistics.median(r["final_accuracy"] for r in runs)})
    speedups = [r["time_to_target_speedup"] for r in results]
    eq, ho = rows
    print("\nmedians over the seeds:\n")
    print("| split | time to target | step / ideal | final acc |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['split']} | {fmt_time(r['time_to_target_s'])} | "
              f"{r['step_over_ideal']:.3f} | {r['final_accuracy'] * 100:.2f}% |")
    out = {"rows": rows, "per_seed_speedup": speedups}
    if eq["time_to_target_s"] and ho["time_to_target_s"]:
        out["time_to_target_speedup"] = eq["time_to_target_s"] / ho["time_to_target_s"]
        print(f"\ntime to target, equal / holistic, of the medians: "
              f"{out['time_to_target_speedup']:.2f}x (per seed: "
              + ", ".join("-" if x is None else f"{x:.2f}x" for x in speedups) + ")")
    return out


def over_seeds_fluctuating(results):
    rows = []
    for i, first in enumerate(results[0]["rows"]):
        runs = [r["rows"][i] for r in results]
        rows.append({"run": first["run"],
                     "times_s": [r["time_to_target_s"] for r in runs],
                     "time_to_target_s": median_or_none([r["time_to_target_s"] for r in runs]),
                     "steps_to_target": median_or_none([r["steps_to_target"] for r in runs]),
                     "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
                     "most_steps_to_steady": max(
                         (p.get("steps_to_steady") for r in runs for p in r["phases"]
                          if p.get("steps_to_steady") is not None), default=None)})
    print("\nmedians over the seeds (a run that misses the target counts as the slowest):\n")
    print("| run | time to target: median (each seed) | steps | final acc | most steps to "
          "steady |")
    print("|---|---|---|---|---|")
    for r in rows:
        each = ", ".join("-" if t is None else f"{t:.2f}" for t in r["times_s"])
        steps = "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:g}"
        print(f"| {r['run']} | {fmt_time(r['time_to_target_s'])} ({each}) | {steps} | "
              f"{r['final_accuracy'] * 100:.2f}% | {r['most_steps_to_steady']} |")
    fixed = rows[1:]
    reached = [r for r in fixed if r["time_to_target_s"] is not None]
    out = {"rows": rows,
           "per_seed_adaptive_over_best": [r.get("adaptive_over_best") for r in results],
           "per_seed_median_over_adaptive": [r.get("median_over_adaptive") for r in results]}
    adaptive = rows[0]["time_to_target_s"]
    if reached and adaptive is not None:
        best = min(reached, key=lambda r: r["time_to_target_s"])
        median = median_slowest([r["time_to_target_s"] for r in fixed])
        out.update({"best_fixed": best["run"], "best_fixed_s": best["time_to_target_s"],
                    "median_fixed_s": median,
                    "adaptive_over_best": adaptive / best["time_to_target_s"],
                    "median_over_adaptive": median / adaptive})
        print(f"\nof the medians: adaptive / best fixed ({best['run']}): "
              f"{out['adaptive_over_best']:.2f}x; median fixed / adaptive: "
              f"{out['median_over_adaptive']:.2f}x")
        print("per seed, against that seed's best and median fixed: "
              + ", ".join(f"{a:.2f}x / {m:.2f}x" for a, m in
                          zip(out["per_seed_adaptive_over_best"],
                              out["per_seed_median_over_adaptive"]) if a and m))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=["heterogeneous", "fluctuating", "modes", "home"])
    parser.add_argument("--trainer", help="the train_fashion_mnist executable")
    parser.add_argument("--out", default="out/scenarios", help="folder of the runs' outputs")
    parser.add_argument("--seeds", default="",
                        help="comma-separated trainer seeds: the scenario once per seed, then "
                             "the medians over them (default: one run, the trainer's seed)")
    parser.add_argument("--list-variants", action="store_true",
                        help="print each run as NAME|OPTIONS (the network aside) and exit")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.list_variants:
        for name, options in VARIANTS[args.scenario]:
            print(f"{name}|{' '.join(options)}")
        return
    if not args.trainer:
        parser.error("--trainer is required")
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else []
    except ValueError:
        parser.error(f"--seeds: '{args.seeds}' is not a comma-separated list of integers")
    if any(x < 0 for x in seeds) or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds: '{args.seeds}' holds a negative or repeated seed")
    if seeds and any(a.split("=")[0] == "--seed" for a in extra):
        parser.error("--seeds and a trainer --seed after -- exclude each other")
    out = Path(args.out) / args.scenario
    out.mkdir(parents=True, exist_ok=True)
    run = {"heterogeneous": heterogeneous, "fluctuating": fluctuating,
           "modes": modes("modes"), "home": modes("home")}[args.scenario]
    if len(seeds) <= 1:
        result = run(args.trainer, out, extra + (["--seed", str(seeds[0])] if seeds else []))
    else:
        per_seed = []
        for seed in seeds:
            print(f"\n==== seed {seed}", flush=True)
            per_seed.append(run(args.trainer, out / f"seed-{seed}",
                                extra + ["--seed", str(seed)]))
        combine = {"heterogeneous": over_seeds_heterogeneous,
                   "fluctuating": over_seeds_fluctuating,
                   "modes": over_seeds_modes("modes"),
                   "home": over_seeds_modes("home")}[args.scenario]
        result = {"seeds": seeds, "per_seed": per_seed, "over_seeds": combine(per_seed)}
    (Path(args.out) / f"{args.scenario}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {Path(args.out) / (args.scenario + '.json')}")


if __name__ == "__main__":
    main()
