"""Models without weights, for planning: named presets and GGUF headers.

A preset is an architecture name and its published hyperparameters (DeepSeek2HParams).
`preset_model` turns it into the GGUF keys and a tensor table of metadata-only weights (no
data, `buffer = "model"`, shapes from the architecture's `weight_shapes`), so the registered
builder (graphs/arch.py) builds the same graph it would build from a file. `header_model` does
the same from a GGUF file's header (no tensor data is read, any tensor type is fine). Both need
an architecture with the MLAPlanner capability.
Weight tensors in these graphs carry placeholder types (Q8_0 where rows fit its blocks, else
F32): the compute buffer does not depend on weight types, and weight memory is reported
separately, from a bytes-per-weight figure (a ggml type's size, or any number for the
formats ggraph cannot compute with, e.g. Q2_K's 84 bytes per 256 weights).

`plan_deepseek2` builds the worst-case graph as llama.cpp reserves it (n_tokens =
min(ctx, ubatch), n_kv = ctx, every token an output) and plans its compute buffer.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

from gguf.constants import Keys

from ggraph.alloc import Plan, plan_graph
from ggraph.tensor import Context, Tensor
from ggraph.types import GGMLType

from .arch import MLAPlanner, architectures_with, model_class, supports
from .gguf_file import GGUFError, GGUFModel
from .hparams import DeepSeek2HParams

GIB = 1 << 30

# bytes per weight of ggml's formats (block bytes / block size), for weight-memory figures
BYTES_PER_WEIGHT: dict[str, float] = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q6_k": 210 / 256,
    "q5_k": 176 / 256, "q5_0": 22 / 32, "q4_k": 144 / 256, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "q3_k": 110 / 256, "q2_k": 84 / 256, "iq2_xxs": 66 / 256, "iq1_s": 50 / 256,
}

DEEPSEEK_V3 = DeepSeek2HParams(
    n_layer=61, n_embd=7168, n_ctx_train=163840, n_head=128, n_head_kv=1, kv_lora_rank=512,
    n_rot=64, n_ff=18432, key_length=576, value_length=512, key_length_mla=192,
    value_length_mla=128, q_lora_rank=1536, rms_eps=1e-6, rope_freq_base=10000.0,
    rope_scaling_type="yarn", rope_scaling_factor=40.0, rope_scaling_orig_ctx=4096,
    rope_yarn_log_mul=0.1, n_layer_dense_lead=3, n_expert=256, n_expert_used=8,
    n_expert_shared=1, n_ff_exp=2048, expert_weights_scale=2.5, expert_weights_norm=True,
    expert_gating_func=2, n_expert_groups=8, n_group_used=4, n_vocab=129280)

DEEPSEEK_V2_LITE = DeepSeek2HParams(
    n_layer=27, n_embd=2048, n_ctx_train=163840, n_head=16, n_head_kv=1, kv_lora_rank=512,
    n_rot=64, n_ff=10944, key_length=576, value_length=512, key_length_mla=192,
    value_length_mla=128, q_lora_rank=0, rms_eps=1e-6, rope_freq_base=10000.0,
    rope_scaling_type="yarn", rope_scaling_factor=40.0, rope_scaling_orig_ctx=4096,
    rope_yarn_log_mul=0.0707, n_layer_dense_lead=1, n_expert=64, n_expert_used=6,
    n_expert_shared=2, n_ff_exp=1408, expert_weights_scale=1.0, expert_weights_norm=False,
    expert_gating_func=1, n_vocab=102400)

# name -> (general.architecture, hyperparameters, default weight format for the weight-memory
# figure)
PRESETS: dict[str, tuple[str, DeepSeek2HParams, str]] = {
    "deepseek-v3": ("deepseek2", DEEPSEEK_V3, "q2_k"),
    "deepseek-r1": ("deepseek2", DEEPSEEK_V3, "q2_k"),        # the same architecture and sizes
    "deepseek-v2-lite": ("deepseek2", DEEPSEEK_V2_LITE, "q8_0"),
}


def bytes_per_weight(spec: str | float) -> float:
    """A number, or a format name from BYTES_PER_WEIGHT (case-insensitive)."""
    if isinstance(spec, (int, float)):
        return float(spec)
    try:
        return float(spec)
    except ValueError:
        pass
    v = BYTES_PER_WEIGHT.get(spec.strip().lower())
    if v is None:
        raise ValueError(f"unknown weight format {spec!r}; give bytes per weight as a number "
                         f"or one of {', '.join(BYTES_PER_WEIGHT)}")
    return v


# -- models over metadata-only weights -----------------------------------------------------

def hparams_metadata(hp: Any, arch: str) -> dict[str, Any]:
    """The GGUF keys of `hp`, through the same table the loader reads (a value equal to its
    field's default is left out, as a converter leaves out an absent feature)."""
    meta: dict[str, Any] = {Keys.General.ARCHITECTURE: arch}
    for f in fields(hp):
        k = f.metadata.get("gguf")
        v = getattr(hp, f.name)
        if k is not None and v != f.default:
            meta[k.format(arch=arch)] = v
    return meta


def _placeholder(ctx: Context, name: str, ne: tuple[int, ...]) -> Tensor:
    t_type = GGMLType.Q8_0 if ne[0] % 32 == 0 and len(ne) > 1 else GGMLType.F32
    t = ctx.new_tensor(t_type, ne, name=name)
    t.buffer = "model"            # pre-allocated elsewhere: never planned, never touched
    return t


def planner_class(arch: str, path: str) -> type[Any]:
    """The registered builder of `arch`, which must declare the MLAPlanner capability."""
    cls = model_class(arch, path)
    if not supports(cls, MLAPlanner):
        raise GGUFError(f"{path}: architecture {arch!r} has no MLA planner; ggraph plan covers "
                        f"{', '.join(architectures_with(MLAPlanner))}")
    return cls


def preset_model(name: str, weights: str | float | None = None) -> tuple[Any, int]:
    """(the preset's model over metadata-only weights, weight bytes) for a named preset;
    weights is a format name or bytes per weight for matrices (vectors count as F32)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    arch, hp, default_fmt = PRESETS[key]
    cls = planner_class(arch, f"preset:{key}")
    bpw = bytes_per_weight(default_fmt if weights is None else weights)
    ctx = Context(f"preset:{key}")
    shapes = cls.weight_shapes(hp)
    tensors = {n: _placeholder(ctx, n, ne) for n, ne in shapes.items()}
    sizes = {}
    for name, ne in shapes.items():
        n = 1
        for x in ne:
            n *= x
        sizes[name] = int(n * bpw) if len(ne) > 1 else 4 * n
    total = sum(sizes.values())
    gguf = GGUFModel(f"preset:{key}", hparams_metadata(hp, arch), tensors, ctx, 0, 0, total,
                     sizes=sizes)
    return cls(gguf), total


def header_model(path: str | os.PathLike) -> tuple[Any, int]:
    """(the file's model over metadata-only weights, weight bytes) from a GGUF header; nothing
    of the tensor data is read, and tensors of types ggraph cannot compute with are fine."""
    from .gguf_reader import read_header

    hdr = read_header(path)
    ctx = Context(os.path.basename(path))
    tensors: dict[str, Tensor] = {}
    sizes: dict[str, int] = {}
    for info in hdr.tensors:
        tensors[info.name] = _placeholder(ctx, info.name, info.ne)
        sizes[info.name] = info.nbytes
    total = sum(sizes.values())
    model = GGUFModel(path, hdr.metadata, tensors, ctx, hdr.file_size, hdr.data_offset, total,
                      kv_types=hdr.kv_types, sizes=sizes)
    built = planner_class(model.arch, os.fspath(path))(model)
    model.check_all_used()
    return built, total


# -- planning ---------------------------------------------------------------------------------

@dataclass
class PathInfo:
    name: str
    iterations: int                 # head groups actually built per layer
    largest: str                    # what the largest per-step tensor is
    largest_bytes: int
    formula_steps: int | None = None   # the facts page's n_step (absorbed)
    ik_iterations: int | None = None   # ik_llama.cpp's divisor search (decompress)
    max_heads: int = 0
    unavailable: str | None = None


@dataclass
class PlanResult:
    source: str
    hp: DeepSeek2HParams
    n_ctx: int
    n_ubatch: int
    n_tokens: int
    n_kv: int
    amb_mib: int
    type_k: GGMLType
    flash: bool
    path: str
    kv_bytes: int
    kv_by_type: dict[str, int]
    weight_bytes: int
    paths: list[PathInfo]
    plan: Plan
    n_nodes: int
    capacity: int
    strategy: str
    build_s: float
    plan_s: float
    notes: list[str] = field(default_factory=list)


def path_infos(model: Any, n_tokens: int, n_kv: int, amb_mib: int,
               cache_type: GGMLType) -> list[PathInfo]:
    from .mla import (
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
            info.unavailable = decompress_supported(cache_type, s)
        out.append(info)
    return out


def plan_deepseek2(model: Any, source: str, n_ctx: int, n_ubatch: int = 512, amb_mib: int = 0,
                   type_k: str = "f16", flash: bool = False, path: str | None = None,
                   strategy: str = "ggml", weight_bytes: int = 0,
                   alignment: int = 32) -> PlanResult:
    """Plan the worst-case graph of `model` (metadata-only weights welcome)."""
    hp = model.hp
    if n_ctx <= 0 or n_ubatch <= 0:
        raise ValueError("context and ubatch sizes must be positive")
    if n_ctx > hp.n_ctx_train:
        raise ValueError(f"context {n_ctx} is larger than the model's training context "
                         f"{hp.n_ctx_train} ({source})")
    tk = GGMLType.parse(type_k)
    n_tokens = min(n_ctx, n_ubatch)
    t0 = time.perf_counter()
    ctx = Context("plan")
    cache = model.new_cache(ctx, n_ctx, tk, flash_attn=flash)
    mg = model.build(ctx, cache, n_tokens, n_ctx, n_tokens, flash, amb_mib, path=path)
    t1 = time.perf_counter()
    plan = plan_graph(mg.graph, alignment=alignment, strategy=strategy, name="CPU")
    t2 = time.perf_counter()
    kv_by_type = {t: model.cache_bytes(n_ctx, t) for t in ("f16", "q8_0", "q4_0")
                  if hp.mla_row % GGMLType.parse(t).block_size == 0}
    notes = []
    if path is None and flash and mg.path == "absorbed-fa" and n_tokens >= \
            model.decompress_min_tokens:
        notes.append("flash attention without the decompress path: " +
                     str(path_infos(model, n_tokens, n_ctx, amb_mib, tk)[2].unavailable))
    return PlanResult(source, hp, n_ctx, n_ubatch, n_tokens, n_ctx, amb_mib, tk, flash, mg.path,
                      cache.nbytes, kv_by_type, weight_bytes,
                      path_infos(model, n_tokens, n_ctx, amb_mib, tk), plan, mg.graph.n_nodes,
                      mg.graph.capacity, strategy, t1 - t0, t2 - t1, notes)
