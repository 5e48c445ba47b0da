#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The end-to-end trainer over a real network stack: under wan-emu, 4 ranks (one process
# each, in its own network namespace) in 2 clusters of 2 train in every mode (dense and
# stellatrain, each flat and hierarchical, diloco and stellatrain-local), over MPI and over
# ZeroMQ, first with each
# cluster's uplink at 100 Mbit/s and 20 ms RTT between the clusters, then at 1 Gbit/s and
# 10 ms. The links are shaped by the kernel (HTB) and wan-emu's delay line, not by the
# library; the LAN inside a cluster is unshaped. Each run prints rank 0's table; summaries land
# in out/wan/<backend>-<rate>/.
#
#   bench/wan/run.sh [BUILD_DIR] [-- extra trainer options]
#       BUILD_DIR: a build with the trainer (default build/demo: cmake --preset demo && cmake --build --preset demo)
#
# A benchmark, not a CI test: needs root, network namespaces, iproute2 and python3, and says
# so when they are missing. Environment: WAN_EMU (default ../shared/tools/wan-emu beside the
# checkout), WAN_BACKENDS ("mpi zmq"), WAN_LINKS ("100mbit:10 1gbit:5": rate:one-way ms),
# WAN_CLUSTERS ("2,2": wan-emu's -c), WAN_CC (reno; "host" keeps the host's default
# congestion control), WAN_SCHEDULE (wan-emu's --schedule: every uplink's rate over the run's
# wall time, e.g. 20:50mbit,40:200mbit; the holistic configuration's fluctuating link).
# WAN_SCENARIO=modes|home runs every mode in 2 clusters of 2 at 100 or 10 Mbit/s per uplink
# (20 ms RTT; home: each mode ends at its target), into out/wan/<scenario>/<backend>-<rate>/all/.
# WAN_SCENARIO=heterogeneous|fluctuating runs the variants of that scenario of
# scripts/scenarios.py over the kernel's shaping (its options; the trainer options given here
# must be others): heterogeneous the equal and the holistic split (defaults WAN_CLUSTERS
# 1,1,1,1, WAN_LINKS 100mbit:10), fluctuating the adaptive density and fixed 0.1%, 0.3%, 1%,
# 3% (WAN_LINKS 500mbit:10, WAN_SCHEDULE 6:50mbit,11:200mbit: the phases count from the start
# of the processes); WAN_BACKENDS defaults to zmq for both. The scenarios run the direct
# all-gather, as in process (one round of latency per exchange; their messages are small:
# the ring's 3 rounds of 10 ms would be most of an exchange). Summaries land in
# out/wan/<scenario>/<backend>-<rate>/<variant>/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
build=${1:-$root/build/demo}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
extra=("$@")
scenario=${WAN_SCENARIO:-}
# Each variant: a name and its trainer options (no spaces inside an option); a scenario's come
# from scripts/scenarios.py, which runs them in process.
variants=("default|")
case "$scenario" in
  "") ;;
  heterogeneous) : "${WAN_CLUSTERS:=1,1,1,1}" "${WAN_LINKS:=100mbit:10}" "${WAN_BACKENDS:=zmq}" ;;
  modes) : "${WAN_LINKS:=100mbit:10}" ;;
  home) : "${WAN_LINKS:=10mbit:10}" ;;
  fluctuating)
    : "${WAN_CLUSTERS:=1,1,1,1}" "${WAN_LINKS:=500mbit:10}" "${WAN_BACKENDS:=zmq}"
    : "${WAN_SCHEDULE:=6:50mbit,11:200mbit}" ;;
  *) echo "WAN training benchmark: WAN_SCENARIO is modes, home, heterogeneous or fluctuating, not '$scenario'" >&2
     exit 2 ;;
esac
if [ -n "$scenario" ]; then
  mapfile -t variants < <(python3 "$root/scripts/scenarios.py" "$scenario" --list-variants)
  [ ${#variants[@]} -gt 0 ] || { echo "WAN training benchmark: no variants of $scenario" >&2; exit 2; }
fi
# The holistic scenarios' messages are small: one round of latency per exchange.
direct=()
case "$scenario" in heterogeneous|fluctuating) direct=(--allgather direct) ;; esac
backends=${WAN_BACKENDS:-mpi zmq}
links=${WAN_LINKS:-100mbit:10 1gbit:5}
clusters=${WAN_CLUSTERS:-2,2}
schedule_args=()
if [ -n "${WAN_SCHEDULE:-}" ]; then schedule_args=(--schedule "$WAN_SCHEDULE"); fi
ranks=0
for c in ${clusters//,/ }; do ranks=$((ranks + c)); done
trainer="$build/examples/train_fashion_mnist/train_fashion_mnist"

wan_preflight "WAN training benchmark"
[ -x "$trainer" ] || { echo "WAN training benchmark: $trainer is missing (build with examples first)" >&2; exit 2; }

for link in $links; do
  rate=${link%%:*}
  delay=${link##*:}
  for backend in $backends; do
    for variant in "${variants[@]}"; do
      name=${variant%%|*}
      read -r -a options <<<"${variant#*|}"
      if [ -n "$scenario" ]; then
        out="$root/out/wan/$scenario/$backend-$rate/$name"
      else
        out="$root/out/wan/$backend-$rate"
      fi
      mkdir -p "$out"
      echo
      echo "== $backend, clusters $clusters, $rate per uplink, $((2 * delay)) ms RTT between clusters${scenario:+, $scenario: $name}"
      # No shaping by the library: the emulated network is the link.
      args=(--transport "$backend" --clusters "$clusters" --bandwidth 0 --rtt 0 --out "$out"
            "${direct[@]+"${direct[@]}"}" "${options[@]+"${options[@]}"}"
            "${extra[@]+"${extra[@]}"}")
      if [ "$backend" = mpi ]; then
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
          bash "$wan_emu" run -c "$clusters" -r "$rate" -d "$delay" "${cc_args[@]+"${cc_args[@]}"}" \
          "${schedule_args[@]+"${schedule_args[@]}"}" --rank0 --timeout 1800 -- \
          mpirun -np "$ranks" -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM "$trainer" "${args[@]}"
      else
        bash "$wan_emu" run -c "$clusters" -r "$rate" -d "$delay" "${cc_args[@]+"${cc_args[@]}"}" \
          "${schedule_args[@]+"${schedule_args[@]}"}" --timeout 1800 -- sh -c '
          export STELLATRAIN_RANK=$WAN_EMU_RANK
          peers=""; for a in $WAN_EMU_ADDRS; do peers="$peers,tcp://$a:5555"; done
          export STELLATRAIN_ZMQ_PEERS=${peers#,}
          exec "$0" "$@"' "$trainer" "${args[@]}" | grep -E "^\[r0\]"
      fi
    done
  done
done
