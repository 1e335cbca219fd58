#!/usr/bin/env bash
# Sets up and runs the whole test suite (the CUDA simulator part runs in its own process,
# started by tests/backends/cuda/test_cudasim_suite.py, so one pytest summary covers everything).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
python -m pytest -q -p no:cacheprovider "$@" tests/
