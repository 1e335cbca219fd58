#!/usr/bin/env bash
# ggraph against the real libggml: every conformance op case on ggraph's CPU backend and on
# ggml's CPU backend (NMSE within the case tolerances), and ggraph's `ggml` allocator strategy
# against ggml_gallocr's buffer size on 30+ graphs (random DAGs, attention, SmolLM2).
#
#   benchmarks/compare_ggml.sh [extra ggml-compare options, e.g. --no-model or -q]
#
# libggml comes from llama-cpp-python (its wheel ships libggml-base/-cpu in llama_cpp/lib); it
# is installed here when missing: pip builds it from source, which takes minutes. Set
# GGRAPH_LIBGGML to a directory holding libggml-base.so and libggml-cpu.so to use another
# build. Figures land in benchmarks/results/ggml_compare.json; the exit status is 1 when a case
# fails or a buffer size differs (the JSON is written either way).
set -euo pipefail
cd "$(dirname "$0")/.."

python -c "import ggraph" 2>/dev/null || python -m pip install -q --disable-pip-version-check -e .
python -c "import cffi" 2>/dev/null || python -m pip install -q --disable-pip-version-check "cffi>=1.16"
if [[ -z "${GGRAPH_LIBGGML:-}" ]] && ! python -c "import importlib.util, sys; \
sys.exit(importlib.util.find_spec('llama_cpp') is None)"; then
    echo "compare_ggml: installing llama-cpp-python (builds llama.cpp and ggml from source," \
         "a few minutes) ..." >&2
    python -m pip install --disable-pip-version-check llama-cpp-python
fi

mkdir -p benchmarks/results
exec ggraph ggml-compare --json benchmarks/results/ggml_compare.json "$@"
