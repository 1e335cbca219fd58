"""The llama architecture (GQA), built as llama.cpp builds `general.architecture = llama`.

Per layer: rms_norm * attn_norm, Q/K/V projections, rope (NORMAL), K/V written into the cache
with set_rows, attention (mul_mat + soft_max_ext + mul_mat, or flash_attn_ext; split over head
groups with amb), output projection and residual, rms_norm * ffn_norm, SwiGLU FFN and residual.
Only the requested rows reach the output head (get_rows on out_ids in the last layer); the
output matrix is tied to the token embedding when output.weight is absent. The layer loop is
graphs/models/archs/dense.py's, shared with qwen2 and qwen3; llama's spec adds nothing to it (no
biases, no Q/K norms), so a file with attention biases is refused as having unused tensors.
An Architecture (graphs/models/arch.py) found by the registry as this module of graphs/models/archs/; its
tensors are gguf-py's llama table (graphs/models/tensor_names.py).
"""
from __future__ import annotations

from ggraph.ops.rope import RopeMode

from ggraph.graphs.models.arch import register_arch
from ggraph.graphs.models.hparams import LlamaHParams
from ggraph.graphs.models.tensor_names import TensorNames
from .dense import DenseDecoder, DenseSpec


@register_arch("llama")
class LlamaModel(DenseDecoder):
    hparams_class = LlamaHParams
    tensors = TensorNames.of("llama")
    spec = DenseSpec(rope_mode=RopeMode.NORMAL)
