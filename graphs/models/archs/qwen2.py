"""The qwen2 architecture (Qwen2, Qwen2.5), built as llama.cpp builds
`general.architecture = qwen2`: llama's layer (graphs/models/archs/dense.py) with biases on the Q, K
and V projections (read where present: llama.cpp loads them as not required), NEOX rope
(llama_model_rope_type), an optional output.bias, and the output tied to the token embedding
when output.weight is absent (the small Qwen2.5 models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ggraph.ops.rope import RopeMode

from ggraph.graphs.models.arch import register_arch
from ggraph.graphs.models.tensor_names import TensorNames
from .dense import DenseDecoder, DenseHParams, DenseSpec


@dataclass(frozen=True)
class Qwen2HParams(DenseHParams):
    """Llama's keys plus attention.key_length; rope over the whole head (llama.cpp asserts
    n_rot == head size for qwen2)."""
    full_rope: ClassVar[bool] = True


@register_arch("qwen2")
class Qwen2Model(DenseDecoder):
    hparams_class = Qwen2HParams
    tensors = TensorNames.of("qwen2")
    spec = DenseSpec(rope_mode=RopeMode.NEOX, qkv_bias=True, output_bias=True)
