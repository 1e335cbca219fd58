"""Models without weights, for planning: named presets and GGUF headers.

A preset is an architecture name and its published hyperparameters, as the GGUF keys a
converter would write. `preset_model` turns it into a model over metadata-only weights (no
data, `buffer = "model"`), so the registered builder (graphs/models/arch.py) builds the same graph it
would build from a file:
- architectures with the MLAPlanner capability list their weights (`weight_shapes`, with the
  MLA layout choices);
- every other architecture asks for its weights by name and shape as it does from a file, and a
  `ShapeOnlyModel` answers with a placeholder of exactly that shape (optional tensors exist
  when the preset says so: an untied output matrix, say).
`header_model` does the same from a GGUF file's header (no tensor data is read, any tensor type
is fine). Weight tensors in these graphs carry placeholder types (Q8_0 where rows fit its
blocks, else F32): the compute buffer does not depend on weight types, and weight memory is
reported separately, from a bytes-per-weight figure (a ggml type's size, or any number for the
formats ggraph cannot compute with).

Planning itself (the worst-case graph, the KV cache, the compute buffer) is
graphs/deploy/memory_plan.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from gguf.constants import Keys

from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.models.arch import MLAPlanner, model_class, supports
from ggraph.graphs.gguf.gguf_file import GGUFModel
from ggraph.graphs.models.hparams import DeepSeek2HParams

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


@dataclass(frozen=True)
class Preset:
    """A published model: its architecture, the default weight format for the weight-memory
    figure, and its hyperparameters, either as GGUF keys without the architecture prefix
    (`block_count`) or as the architecture's hparams dataclass (MLA planners list their
    weights from it). `optional`: the optional tensors it has (names without the `blk.N.`
    prefix, e.g. `output.weight` for an untied output matrix)."""
    arch: str
    weights: str
    keys: dict[str, Any] = field(default_factory=dict)
    hparams: Any = None
    optional: frozenset[str] = field(default_factory=frozenset)

    def metadata(self) -> dict[str, Any]:
        if self.hparams is not None:
            return hparams_metadata(self.hparams, self.arch)
        meta: dict[str, Any] = {Keys.General.ARCHITECTURE: self.arch}
        meta.update({f"{self.arch}.{k}": v for k, v in self.keys.items()})
        return meta


# Qwen2-7B (the second seed's model): config.json of Qwen/Qwen2-7B as the converter writes it
QWEN2_7B = {
    "block_count": 28, "embedding_length": 3584, "context_length": 32768,
    "feed_forward_length": 18944, "attention.head_count": 28, "attention.head_count_kv": 4,
    "rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6,
    "vocab_size": 152064,
}

PRESETS: dict[str, Preset] = {
    "deepseek-v3": Preset("deepseek2", "q2_k", hparams=DEEPSEEK_V3),
    "deepseek-r1": Preset("deepseek2", "q2_k", hparams=DEEPSEEK_V3),  # the same sizes
    "deepseek-v2-lite": Preset("deepseek2", "q8_0", hparams=DEEPSEEK_V2_LITE),
    "qwen2-7b": Preset("qwen2", "q4_k", QWEN2_7B, optional=frozenset({"output.weight"})),
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


class ShapeOnlyModel(GGUFModel):
    """A model without a file: each weight the architecture asks for (by name and shape)
    exists as a placeholder of that shape; optional ones only when listed in `optional`."""

    def __init__(self, path: str, metadata: dict[str, Any], bpw: float,
                 optional: frozenset[str] = frozenset()) -> None:
        super().__init__(path, metadata, {}, Context(path), 0, 0, 0)
        self.bpw = bpw
        self.optional = optional

    def find(self, name: str, ne: tuple[int, ...], optional: bool) -> Tensor | None:
        t = self.tensors.get(name)
        if t is None:
            parts = name.split(".")
            logical = ".".join(parts[2:] if parts[0] == "blk" else parts)  # attn_q.bias
            if optional and logical not in self.optional:
                return None
            t = self.tensors[name] = _placeholder(self.ctx, name, ne)
            n = 1
            for x in ne:
                n *= x
            self.sizes[name] = int(n * self.bpw) if len(ne) > 1 else 4 * n
            self.tensor_bytes += self.sizes[name]
        self.used.add(name)
        return t


def preset_model(name: str, weights: str | float | None = None) -> tuple[Any, int]:
    """(the preset's model over metadata-only weights, weight bytes) for a named preset;
    weights is a format name or bytes per weight for matrices (vectors count as F32)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    preset = PRESETS[key]
    cls = model_class(preset.arch, f"preset:{key}")
    bpw = bytes_per_weight(preset.weights if weights is None else weights)
    if not supports(cls, MLAPlanner):
        gguf = ShapeOnlyModel(f"preset:{key}", preset.metadata(), bpw, preset.optional)
        return cls(gguf), gguf.tensor_bytes
    hp = preset.hparams
    ctx = Context(f"preset:{key}")
    shapes = cls.weight_shapes(hp)
    tensors = {n: _placeholder(ctx, n, ne) for n, ne in shapes.items()}
    sizes = {}
    for tname, ne in shapes.items():
        n = 1
        for x in ne:
            n *= x
        sizes[tname] = int(n * bpw) if len(ne) > 1 else 4 * n
    total = sum(sizes.values())
    gguf = GGUFModel(f"preset:{key}", preset.metadata(), tensors, ctx, 0, 0, total,
                     sizes=sizes)
    return cls(gguf), total


def header_model(path: str | os.PathLike) -> tuple[Any, int]:
    """(the file's model over metadata-only weights, weight bytes) from a GGUF header; nothing
    of the tensor data is read, and tensors of types ggraph cannot compute with are fine."""
    from ggraph.graphs.gguf.gguf_reader import read_header

    hdr = read_header(path)
    ctx = Context(os.path.basename(path))
    tensors: dict[str, Tensor] = {}
    sizes: dict[str, int] = {}
    for info in hdr.tensors:
        tensors[info.name] = _placeholder(ctx, info.name, info.ne)
        sizes[info.name] = info.nbytes
    total = sum(sizes.values())
    model = GGUFModel(os.fspath(path), hdr.metadata, tensors, ctx, hdr.file_size,
                      hdr.data_offset, total, kv_types=hdr.kv_types, sizes=sizes)
    built = model_class(model.arch, os.fspath(path))(model)
    model.check_all_used()
    return built, total
