"""The qwen3 architecture (dense Qwen3), built as llama.cpp builds
`general.architecture = qwen3`: llama's layer (graphs/models/archs/dense.py) with per-head RMS norms
on Q and K (attn_q_norm, attn_k_norm, one weight of head size shared by the heads) before
NEOX rope, no biases in the released models (Q/K/V biases are still read where present, as
llama.cpp does), and a head size from attention.key_length (Qwen3-0.6B: 128 while
n_embd / n_head is 64).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ggraph.ops.rope import RopeMode

from ggraph.graphs.models.arch import register_arch
from ggraph.graphs.models.tensor_names import TensorNames
from .dense import DenseDecoder, DenseHParams, DenseSpec


@dataclass(frozen=True)
class Qwen3HParams(DenseHParams):
    """Llama's keys plus attention.key_length (the head size); rope over the whole head
    (llama.cpp asserts n_rot == head size for qwen3)."""
    full_rope: ClassVar[bool] = True


@register_arch("qwen3")
class Qwen3Model(DenseDecoder):
    hparams_class = Qwen3HParams
    tensors = TensorNames.of("qwen3")
    spec = DenseSpec(rope_mode=RopeMode.NEOX, qkv_bias=True, qk_norm=True)
