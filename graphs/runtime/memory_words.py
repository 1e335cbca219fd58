"""A runner's memory figures (backends/runner.py: MemoryFigures) in llama.cpp's words: the
lines llama-cli prints when it loads a model (load_tensors, the model, KV cache and compute
buffer sizes per device, the graph's nodes and splits), so that `ggraph run` reads as
llama.cpp does and the lines can be compared with llama.cpp's own."""
from __future__ import annotations

from typing import Sequence

from ggraph.backends.runner import ComputeBuffer, MemoryFigures
from ggraph.ir.types import MIB


def _mib(n: int) -> str:
    return f"{n / MIB:10.2f} MiB"


def compute_line(b: ComputeBuffer, baseline: bool = False) -> str:
    """`<device> compute buffer size = ...`; with `baseline`, ggml-alloc's own size is added
    where the chosen plan differs from it."""
    text = f"{b.device} compute buffer size = {_mib(b.size)}"
    if baseline and b.baseline_size is not None:
        text += f" (ggml-alloc's plan: {b.baseline_size / MIB:.2f} MiB)"
    return text


def memory_lines(fig: MemoryFigures, kv_summary: Sequence[str]) -> list[str]:
    """llama.cpp's lines for `fig`, with the KV cache's own summary lines (the cache words
    itself: `llama_kv_cache: size = ...`) in their place."""
    lines = []
    if fig.offload is not None:
        o = fig.offload
        counts = ", ".join(f"{n} {c}" for n, c in o.per_device)
        lines.append(f"load_tensors: offloaded {o.offloaded}/{o.total} repeating layers "
                     f"(layers per device: {counts}; output layer on {o.output})")
    lines += [f"{name}_Mapped model buffer size = {_mib(n)}" for name, n in fig.mapped]
    lines += [f"{name} model buffer size = {_mib(n)}" for name, n in fig.model]
    lines += list(kv_summary)
    lines += [f"llama_kv_cache: {name} KV buffer size = {_mib(n)}" for name, n in fig.kv]
    lines += [compute_line(b, fig.baseline) for b in fig.compute]
    lines.append(f"graph nodes  = {fig.nodes}")
    if fig.splits is not None:
        lines.append(f"graph splits = {fig.splits}")
    return lines
