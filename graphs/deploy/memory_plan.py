"""Planning a model's memory without its weights, for every architecture ggraph builds.

`plan_model` builds the worst-case graph as llama.cpp reserves it (n_tokens = min(ctx,
ubatch), n_kv = ctx, every token an output) over a model whose weights are metadata only (a
GGUF header or a preset, graphs/deploy/presets.py), creates its KV cache with the requested types
(no memory is allocated: cache tensors are metadata too) and plans the compute buffer with the
allocator. The result carries the KV cache in llama.cpp's words (the architecture's cache says
them: one line, or two for an iswa cache), the compute buffer and its peak.

Architectures with the MLAPlanner capability (DeepSeek2) add their attention paths: per path
the head groups built per layer under `--amb` and the largest tensor (`path_infos`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ggraph.backends import registry
from ggraph.plan.alloc import Plan, plan_graph
from ggraph.ir.tensor import Context
from ggraph.ir.types import GGMLType

from ggraph.graphs.models.arch import MLAPlanner, supports
from ggraph.graphs.models.kv_cache import stream_size, worst_ubatch

__all__ = ["PathInfo", "PlanResult", "plan_model", "path_infos", "kv_lines", "REPORTED_CACHE_TYPES"]


@dataclass
class PathInfo:
    """One MLA attention path at these sizes."""
    name: str
    iterations: int                 # head groups actually built per layer
    largest: str                    # what the largest per-step tensor is
    largest_bytes: int
    formula_steps: int | None = None   # n_step = ceil(K*Q MiB / amb) (absorbed)
    ik_iterations: int | None = None   # ik_llama.cpp's iteration count (decompress)
    max_heads: int = 0
    unavailable: str | None = None


@dataclass
class PlanResult:
    source: str
    arch: str
    hp: Any
    n_ctx: int
    n_ubatch: int
    n_tokens: int
    n_kv: int
    amb_mib: int
    type_k: GGMLType
    type_v: GGMLType
    flash: bool
    path: str | None                 # the MLA path taken (None: one attention path)
    kv_bytes: int
    kv_lines: list[str]              # the KV cache in llama.cpp's words
    kv_by_type: dict[str, int]       # the cache's bytes in other K/V types (both the same)
    weight_bytes: int
    paths: list[PathInfo]
    plan: Plan
    n_nodes: int
    capacity: int
    strategy: str
    build_s: float
    plan_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def is_mla(self) -> bool:
        return bool(self.paths)


def kv_lines(cache: Any) -> list[str]:
    """The cache's summary in llama.cpp's words, one line per cache (an iswa cache has two)."""
    return list(cache.summary_lines())


# the K/V cache types a plan also reports the cache in, besides the chosen ones
REPORTED_CACHE_TYPES = ("f16", "q8_0", "q4_0")


def plan_model(model: Any, source: str, n_ctx: int, n_ubatch: int = 512, amb_mib: int = 0,
               type_k: str = "f16", type_v: str | None = None, flash: bool = False,
               path: str | None = None, strategy: str = "ggml", weight_bytes: int = 0,
               alignment: int | None = None, swa_full: bool = False, n_seq_max: int = 1,
               kv_unified: bool = True) -> PlanResult:
    """Plan the worst-case graph of `model` (metadata-only weights welcome), in buffers of
    `alignment` (default: the CPU's, as `ggraph plan` sizes the host's compute buffer), with a
    KV cache for n_seq_max sequences (-np): one unified stream of n_ctx cells, or a stream of
    pad256(n_ctx / n_seq_max) cells per sequence, whose worst-case ubatch holds every stream
    (as llama.cpp reserves)."""
    if alignment is None:
        alignment = registry.alignment("cpu")
    hp = model.hp
    if n_ctx <= 0 or n_ubatch <= 0:
        raise ValueError("context and ubatch sizes must be positive")
    if n_ctx > hp.n_ctx_train:
        raise ValueError(f"context {n_ctx} is larger than the model's training context "
                         f"{hp.n_ctx_train} ({source})")
    mla = supports(type(model), MLAPlanner)
    if path is not None and not mla:
        raise ValueError(f"--path chooses an MLA attention path; {model.arch_name} has one "
                         f"attention path")
    tk = GGMLType.parse(type_k)
    tv = GGMLType.parse(type_v if type_v is not None else type_k)
    t0 = time.perf_counter()
    ctx = Context("plan")
    # an iswa cache sizes its window from the ubatch (llama.cpp's rule)
    size = stream_size(n_ctx, n_seq_max, kv_unified)
    cache = model.new_cache(ctx, size, tk, tv, flash, n_ubatch=n_ubatch, swa_full=swa_full,
                            n_seq_max=n_seq_max, unified=kv_unified)
    n_tokens, streams = worst_ubatch(n_ctx, n_ubatch, cache.n_stream)
    kw = {"path": path} if mla else {}
    mg = model.build(ctx, cache, n_tokens, size, n_tokens, flash, amb_mib, streams=streams,
                     **kw)
    t1 = time.perf_counter()
    plan = plan_graph(mg.graph, alignment=alignment, strategy=strategy, name="CPU")
    t2 = time.perf_counter()
    notes: list[str] = []
    paths: list[PathInfo] = []
    if mla:
        kv_by_type = {t: model.cache_bytes(size * cache.n_stream, t) for t in
                      REPORTED_CACHE_TYPES if hp.mla_row % GGMLType.parse(t).block_size == 0}
        paths = path_infos(model, n_tokens, size, amb_mib, tk, cache.n_stream > 1)
        if path is None and flash and mg.path == "absorbed-fa" and n_tokens >= \
                model.decompress_min_tokens:
            notes.append("flash attention without the decompress path: " +
                         str(paths[2].unavailable))
    else:
        kv_by_type = {}
        for t in REPORTED_CACHE_TYPES:
            try:  # a type whose blocks do not fit the rows, or a quantized V without --fa
                other = model.new_cache(Context("kv"), size, t, t, True, n_ubatch=n_ubatch,
                                        swa_full=swa_full, n_seq_max=n_seq_max,
                                        unified=kv_unified)
            except ValueError:
                continue
            kv_by_type[t] = other.nbytes
    return PlanResult(source, model.arch_name, hp, n_ctx, n_ubatch, n_tokens, size, amb_mib,
                      tk, tv, flash, mg.path, cache.nbytes, kv_lines(cache), kv_by_type,
                      weight_bytes, paths, plan, mg.graph.n_nodes, mg.graph.capacity, strategy,
                      t1 - t0, t2 - t1, notes)


def path_infos(model: Any, n_tokens: int, n_kv: int, amb_mib: int,
               cache_type: GGMLType, streams: bool = False) -> list[PathInfo]:
    """Every MLA path's head groups and largest tensor at these sizes (`streams`: a cache
    stream per sequence, which the decompress path does not take)."""
    from ggraph.graphs.models.mla import (
        PATHS,
        absorbed_n_step,
        decompress_supported,
        ik_decompress_niter,
        largest_tensor,
        path_groups,
    )

    s = model.mla_shape(n_tokens, n_kv)
    out = []
    for p in PATHS:
        groups = path_groups(p, s, amb_mib, cache_type)
        what, size = largest_tensor(p, s, amb_mib, cache_type)
        info = PathInfo(p, len(groups), what, size, max_heads=max(n for _, n in groups))
        if p == "absorbed":
            info.formula_steps = absorbed_n_step(s, amb_mib)
            if cache_type.is_quantized:
                info.unavailable = f"a quantized cache ({cache_type}) needs flash attention"
        elif p == "decompress-fa":
            info.ik_iterations = ik_decompress_niter(s, amb_mib)
            info.unavailable = decompress_supported(cache_type, s) or (
                "it takes one unified cache stream (-kvu), not a stream per sequence"
                if streams else None)
        out.append(info)
    return out
