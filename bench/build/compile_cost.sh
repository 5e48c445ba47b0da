#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What one translation unit that uses the headers costs to compile, one at a time:
#   (a) examples/quickstart: a 2-rank in-process training step (compressor, packer, transport,
#       pipeline, optimizer);
#   (b) examples/train_fashion_mnist/training.cpp: the trainer's training, which instantiates
#       the pipeline (and a dense all-reduce) over one transport, the metered any_transport;
# and, for the whole trainer, its two other translation units: the options, backends (in-process,
# MPI, ZeroMQ, as the build directory has them) and report, and the Eigen model.
# Each is compiled with the exact command of the build directory's compile_commands.json (the
# ci preset: -O2, warnings as errors), `runs` times, and the fastest wall and CPU time printed.
#   bench/build/compile_cost.sh [build-dir] [runs]     # default build/ci, 1
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/ci}
runs=${2:-1}
[ -f "$build/compile_commands.json" ] || { echo "compile_cost: configure $build first (cmake --preset ci)" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

command_of() {  # the compile command of source $1, writing its object to $out/tu.o
  python3 - "$build/compile_commands.json" "$1" "$out/tu.o" <<'PY'
import json, shlex, sys
db, source, obj = sys.argv[1:4]
for e in json.load(open(db)):
    if not e["file"].endswith(source):
        continue
    args, skip = [], False
    for a in shlex.split(e["command"]):
        if skip:
            skip = False
        elif a in ("-MF", "-MT", "-o"):  # dependency files are not wanted; the object goes to obj
            skip = True
            if a == "-o":
                args += ["-o", obj]
        elif a != "-MD":
            args.append(a)
    print(shlex.join(args))
    sys.exit(0)
sys.exit("compile_cost: no command for " + source)
PY
}

measure() {  # label, command
  local best_wall="" best_cpu=""
  for _ in $(seq "$runs"); do
    /usr/bin/time -o "$out/time" -f "%e %U %S" bash -c "$2" >"$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
    read -r wall user sys <"$out/time"
    local cpu
    cpu=$(python3 -c "print(f'{$user + $sys:.1f}')")
    if [ -z "$best_wall" ] || python3 -c "import sys; sys.exit(0 if $wall < $best_wall else 1)"; then best_wall=$wall; fi
    if [ -z "$best_cpu" ] || python3 -c "import sys; sys.exit(0 if $cpu < $best_cpu else 1)"; then best_cpu=$cpu; fi
  done
  printf '%-52s %8s s wall %8s s CPU\n' "$1" "$best_wall" "$best_cpu"
}

quick=$(command_of examples/quickstart/quickstart.cpp)
training=$(command_of examples/train_fashion_mnist/training.cpp)
main=$(command_of examples/train_fashion_mnist/train_fashion_mnist.cpp)
model=$(command_of examples/train_fashion_mnist/mlp.cpp)
echo "compile_cost: $(c++ --version | head -1), $(nproc) cores, build $build, fastest of $runs"
measure "(a) examples/quickstart" "$quick"
measure "(b) train_fashion_mnist/training.cpp" "$training"
measure "    train_fashion_mnist/train_fashion_mnist.cpp" "$main"
measure "    train_fashion_mnist/mlp.cpp" "$model"
