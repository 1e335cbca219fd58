#!/usr/bin/env bash
# The CUDA backend in numba's simulator at the GPU's block and tile sizes (256-thread blocks,
# 64x64 tiles, grids up to 65535 blocks), as a GPU would launch its kernels: every conformance
# case of every op (`ggraph gpu-check`'s conformance section, over two processes), then the
# attention graphs and the flash-attention paths (split KV, query tiles) of the simulator
# tests. About 30-60 minutes on 2 cores; CI runs a subset (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export NUMBA_ENABLE_CUDASIM=1 GGRAPH_CUDASIM_GEOMETRY=gpu
python -m ggraph.tools.gpu_check --sections conformance --jobs 2 --json "${1:-/tmp/cudasim_gpu_geometry.json}"
python -m pytest -q -p no:cacheprovider -m cudasim tests/backends/cuda/test_cuda_sim.py \
    -k attention_graph
python -m pytest -q -p no:cacheprovider -m cudasim tests/backends/cuda/test_cuda_flash_attn.py
