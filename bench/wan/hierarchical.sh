#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# WAN test of the hierarchical pipeline under wan-emu: 4 ranks in 2 clusters of 2, each
# cluster behind one shared uplink of 100 Mbit/s, 20 ms round trip between the clusters, the
# LAN inside a cluster unshaped. With MPI and with ZeroMQ it trains 10M parameters (one
# bucket) on synthetic gradients at a fixed 5% density for 8 steps after 2 (reduce-scatter
# inside the cluster, top-k of each owner's shard, sparse exchange between clusters; about
# 1.6 MB out of each uplink per step), then checks that every rank ends with the same parameters as the same run
# in one process (bench/wan/hierarchical_perf prints their checksum), and prints the uplink
# utilisation during the exchanges between clusters against the target (85%). Fails when a run
# fails or a checksum differs; with --enforce also when a utilisation is below the target (a
# performance check: the emulator shares the CPU with the ranks, so CI runs it without).
#
#   bench/wan/hierarchical.sh [--enforce] [BUILD_DIR]   # default build/ci
#
# Needs root, working network namespaces, iproute2 and python3; without them it says why and
# exits 0 (skipped). wan-emu is looked up beside the checkout (../shared/tools/wan-emu) unless
# WAN_EMU names it. Environment: WAN_RATE (100mbit), WAN_DELAY_MS (10, one way), WAN_TARGET
# (0.85), WAN_BACKENDS ("mpi zmq"), WAN_CLUSTERS ("2,2"), WAN_CC (reno; "host" keeps the
# host's default congestion control), HIER_ARGS (more hierarchical_perf options, e.g.
# "--density 0.01").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
wan_test_options "$@"
backends=${WAN_BACKENDS:-mpi zmq}
clusters=${WAN_CLUSTERS:-2,2}
ranks=0
for c in ${clusters//,/ }; do ranks=$((ranks + c)); done
perf="$build/bench/wan/hierarchical_perf"
read -r -a more <<<"${HIER_ARGS:-}"

wan_preflight "hierarchical WAN test"
[ -x "$perf" ] || { echo "hierarchical WAN test: $perf is missing (build the ci preset first)" >&2; exit 2; }

mbit=$(wan_mbit "$rate")
args=(--clusters "$clusters" --uplink-mbit "$mbit" "${more[@]+"${more[@]}"}")
log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "hierarchical WAN test: clusters $clusters, $rate per uplink, ${delay} ms one way between clusters, TCP congestion control $cc"

run_inproc() { "$perf" --backend inproc "$@"; }
run_zmq() {
  bash "$wan_emu" run -c "$clusters" -r "$rate" -d "$delay" "${cc_args[@]+"${cc_args[@]}"}" --timeout 600 -- sh -c '
    export STELLATRAIN_RANK=$WAN_EMU_RANK
    peers=""; for a in $WAN_EMU_ADDRS; do peers="$peers,tcp://$a:5555"; done
    export STELLATRAIN_ZMQ_PEERS=${peers#,}
    exec "$0" --backend zmq "$@"' "$perf" "$@"
}
run_mpi() {
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    bash "$wan_emu" run -c "$clusters" -r "$rate" -d "$delay" "${cc_args[@]+"${cc_args[@]}"}" --rank0 --timeout 600 -- \
    mpirun -np "$ranks" -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "$perf" --backend mpi "$@"
}

status=0
for backend in inproc $backends; do
  echo "== $backend"
  if ! "run_$backend" "${args[@]}" 2>&1 | tee -a "$log"; then
    echo "hierarchical WAN test: the $backend run failed" >&2
    status=1
  fi
done

echo
echo "== parameters against the in-process run; uplink utilisation ($rate, target >= $target)"
verdict=0
python3 - "$log" "$target" <<'PY' || verdict=$?
import re, sys
runs = {}
for line in open(sys.argv[1]):
    m = dict(re.findall(r"(\w+)=(\S+)", line))
    if "params_crc" in m:
        runs[m["backend"]] = m
if "inproc" not in runs:
    print("no in-process run")
    sys.exit(1)
ref, wrong, below = runs["inproc"]["params_crc"], 0, 0
for name, m in runs.items():
    same = m["params_crc"] == ref and m["identical"] == "1"
    wrong += 0 if same else 1
    use = ""
    if name != "inproc":
        u = float(m["utilization"])
        below += 0 if u >= float(sys.argv[2]) else 1
        use = "utilization %.1f%% (median exchange %.1f%%, %s s, %s MB out of each uplink per step)" % (
            100 * u, 100 * float(m["median_utilization"]), m["exchange_s"], m["wan_MB_per_cluster_step"])
    print("%-7s params %s %s  %s" % (name, m["params_crc"], "same" if same else "DIFFERENT", use))
if len(runs) == 1:
    print("no WAN run")
    sys.exit(1)
sys.exit(1 if wrong else (3 if below else 0))
PY
case $verdict in
  0) ;;
  3)
    echo "hierarchical WAN test: a utilisation is below the target"
    [ "$enforce" = 1 ] && status=1
    ;;
  *)
    echo "hierarchical WAN test: parameters differ from the in-process run (or a run is missing)" >&2
    status=1
    ;;
esac
exit "$status"
