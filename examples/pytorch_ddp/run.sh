#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Trains the example once per method (none, fp16, powersgd, stellatrain, stellatrain-adaptive,
# diloco, stellatrain-local, and torchft-diloco, torchft-streaming-diloco where torchft is
# installed) with 4 processes, each in its own network namespace under wan-emu: a 100 Mbit/s link per
# rank, 20 ms RTT between ranks (or, with PYTORCH_DDP_CLUSTERS=2,2, two clusters whose uplinks
# are shaped so). Then prints the table from the summaries in OUT (default out/pytorch_ddp).
#
#   examples/pytorch_ddp/run.sh [OUT] [-- extra train.py options]
#
# Environment: PYTORCH_DDP_METHODS (all of them), PYTORCH_DDP_PYTHON (the interpreter, default
# /usr/bin/python3 with Debian's torch; build/venv-torch/bin/python for torch 2.15 and torchft:
# scripts/install-torchft),
# PYTORCH_DDP_RATE (100mbit), PYTORCH_DDP_DELAY_MS (10, one way), PYTORCH_DDP_CLUSTERS (unset:
# one link per rank), WAN_EMU (default ../shared/tools/wan-emu beside the checkout), WAN_CC
# (reno; "host" keeps the host's congestion control). Needs root and network namespaces; the
# package must be importable (scripts/install-python, or a build: PYTHONPATH=build/ci/python).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../bench/wan/common.sh"
out=${1:-out/pytorch_ddp}
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
extra=("$@")
python=${PYTORCH_DDP_PYTHON:-/usr/bin/python3}
all="none fp16 powersgd stellatrain stellatrain-adaptive diloco stellatrain-local"
$python -c "import torchft" 2>/dev/null && all="$all torchft-diloco torchft-streaming-diloco"
methods=${PYTORCH_DDP_METHODS:-$all}
rate=${PYTORCH_DDP_RATE:-100mbit}
delay=${PYTORCH_DDP_DELAY_MS:-10}
here=$root/examples/pytorch_ddp

wan_preflight "PyTorch DDP example"
if [ -z "${PYTHONPATH:-}" ] && [ -z "${PYTORCH_DDP_PYTHON:-}" ] &&
   [ -d "$root/build/ci/python/stellatrain" ]; then
  export PYTHONPATH=$root/build/ci/python
fi
$python -c "import stellatrain.torch" || {
  echo "PyTorch DDP example: the stellatrain package does not import; run scripts/install-python" >&2
  exit 2
}
if [ -n "${PYTORCH_DDP_CLUSTERS:-}" ]; then
  topology=(-c "$PYTORCH_DDP_CLUSTERS")
  link="clusters $PYTORCH_DDP_CLUSTERS, $rate per uplink, $((2 * delay)) ms RTT between clusters"
else
  topology=(-n 4)
  link="4 ranks, $rate per rank, $((2 * delay)) ms RTT"
fi
export PYTORCH_DDP_LINK=$link  # recorded in the summaries
mkdir -p "$out"
for method in $methods; do
  echo "== $method: $link"
  rm -f "$out/$method.json"  # a summary from an earlier run must not pass for this one's
  bash "$wan_emu" run "${topology[@]}" -r "$rate" -d "$delay" "${cc_args[@]+"${cc_args[@]}"}" \
    --timeout 3600 -- $python "$here/train.py" --method "$method" --out "$out" \
    "${extra[@]+"${extra[@]}"}" | grep -E "^\[r0\]" || true
  [ -f "$out/$method.json" ] || { echo "PyTorch DDP example: $method wrote no summary" >&2; exit 1; }
done
$python "$here/table.py" "$out"
