#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check of the selection part and the pipeline's GPU bridge, for a machine with a CUDA
# GPU and nvcc (about 3-5 minutes on one H200, build included):
#   1. configures a Release build for ONE architecture and builds only test_select_cuda,
#      test_pipeline_cuda and bench_select_cuda;
#   2. runs the GPU tests (selection; the bridge: selection and parameter upload);
#   3. runs the benchmark (exact, bf16, threshold, error feedback; copy baseline in the run);
#   4. times torch.topk(g.abs(), k) on the same sizes if python3 with CUDA torch is there;
#   5. prints one table: N, k, our time, torch time, ratio, passes over the input, then the
#      issue's targets.
# Usage: bench/gpu/device_check.sh [build-dir]
#   CUDA_ARCH=90 (default; the GPU's compute capability without the dot)
#   JOBS=<n> (default: all cores)   BENCH_FILTER=<regex> (default: all BM_select_cuda_*)
# Exit status: 1 when a test failed or a step could not run; the targets are reported, not
# enforced.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
start=$(date +%s)
build=${1:-build/device-check}
arch=${CUDA_ARCH:-90}
jobs=${JOBS:-$(nproc)}
out="$build/device-check"
status=0
stamp() { echo "== $* [$(( $(date +%s) - start ))s]"; }

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null 2>&1 || { echo "device_check: nvcc not found" >&2; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvcc --version | tail -1

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
stamp "configure ($build, sm_$arch)"
cmake -S . -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DSTELLATRAIN_ENABLE_CUDA=ON \
  -DSTELLATRAIN_BUILD_TESTS=ON -DSTELLATRAIN_BUILD_BENCH=ON -DSTELLATRAIN_BUILD_EXAMPLES=OFF \
  -DSTELLATRAIN_INSTALL=OFF >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log"; echo "device_check: configure failed (Catch2, Google Benchmark, xsimd installed? scripts/install-deps)" >&2; exit 1; }
stamp "build test_select_cuda test_pipeline_cuda bench_select_cuda (-j$jobs)"
cmake --build "$build" --target test_select_cuda test_pipeline_cuda bench_select_cuda -j "$jobs" \
  || { echo "device_check: build failed" >&2; exit 1; }
mkdir -p "$out"

stamp "GPU tests"
timeout 300 "$build/tests/test_select_cuda" --durations yes >"$out/tests.log" 2>&1
test_rc=$?
timeout 120 "$build/tests/test_pipeline_cuda" --durations yes >>"$out/tests.log" 2>&1 || test_rc=$?
grep -E "^(All tests passed|test cases:|assertions:)|FAILED|skipped" "$out/tests.log" | head -40
if [ $test_rc -ne 0 ]; then
  echo "device_check: GPU tests FAILED (exit $test_rc); full log: $out/tests.log"
  grep -B5 -A15 "FAILED" "$out/tests.log" | head -150
  status=1
fi

stamp "benchmark"
timeout 300 "$build/bench/bench_select_cuda" --benchmark_min_time=0.1 --benchmark_filter="${BENCH_FILTER:-^BM_select_cuda_}" \
  --benchmark_out="$out/bench.json" --benchmark_out_format=json --benchmark_counters_tabular=true \
  >"$out/bench.log" 2>&1 || { tail -30 "$out/bench.log"; echo "device_check: benchmark failed" >&2; status=1; }

torch_json=()
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  stamp "torch.topk"
  if timeout 180 python3 bench/gpu/torch_topk.py "$out/torch.json" >"$out/torch.log" 2>&1; then
    torch_json=("$out/torch.json")
  else
    tail -20 "$out/torch.log"
  fi
else
  echo "device_check: python3 with CUDA torch not found: no torch column"
fi

stamp "table"
if [ -s "$out/bench.json" ]; then
  python3 bench/gpu/device_table.py "$out/bench.json" "${torch_json[@]}" | tee "$out/table.txt"
fi
stamp "done (tests: $([ $test_rc -eq 0 ] && echo passed || echo FAILED)); logs in $out"
exit $status
