# SPDX-License-Identifier: Apache-2.0
# Sourced by the scripts in this folder: repository root, CUDA on PATH, dependency install.
set -euo pipefail
STELLATRAIN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$STELLATRAIN_ROOT"

# The CUDA toolkit installs nvcc under /usr/local/cuda/bin, which is often not on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# Seconds since the script started, for progress lines.
STELLATRAIN_T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - STELLATRAIN_T0 ))s"; }
