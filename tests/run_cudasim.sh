#!/usr/bin/env bash
# The CUDA backend under numba's CUDA simulator, in its own process: the simulator replaces
# numba.cuda only when NUMBA_ENABLE_CUDASIM=1 is set before numba is first imported.
# Extra pytest arguments pass through (e.g. -x, -k mul_mat); GGRAPH_CUDASIM_ALL=1 runs every
# conformance case of the heavy ops instead of one per type combination.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m cudasim tests/backends/cuda/test_cuda_*.py \
    tests/tools/test_gpu_*.py "$@"
