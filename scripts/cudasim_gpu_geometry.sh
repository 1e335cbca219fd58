#!/usr/bin/env bash
# The CUDA backend's whole simulator suite at the GPU's block and tile sizes: every conformance
# case (GGRAPH_CUDASIM_ALL=1, heavy ops included) and every attention graph, as a GPU would
# launch them (256-thread blocks, 64x64 tiles, grids up to 65535 blocks). Slow: 20-40 minutes
# on 2 cores, where CI runs a subset (tests/conftest.py). Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob
GGRAPH_CUDASIM_GEOMETRY=gpu GGRAPH_CUDASIM_ALL=1 NUMBA_ENABLE_CUDASIM=1 \
    python -m pytest -q -p no:cacheprovider -m cudasim tests/test_cuda_*.py tests/test_gpu_*.py "$@"
