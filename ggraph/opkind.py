"""The OpKind enum: every operation the IR can record.

The enum is the key of the op registry (ggraph.ops) and of every backend's kernel table.
Leaf tensors (weights, inputs, caches) have no op: `Tensor.op is None`.
"""
from __future__ import annotations

from enum import Enum


class OpKind(Enum):
    # views: no computation, the result aliases its source's memory
    VIEW = "view"
    RESHAPE = "reshape"
    PERMUTE = "permute"
    TRANSPOSE = "transpose"
    # copies and conversions
    CPY = "cpy"
    CONT = "cont"
    GET_ROWS = "get_rows"
    SET_ROWS = "set_rows"
    CONCAT = "concat"
    REPEAT = "repeat"
    # matrix products and attention
    MUL_MAT = "mul_mat"
    MUL_MAT_ID = "mul_mat_id"
    SOFT_MAX = "soft_max"
    FLASH_ATTN_EXT = "flash_attn_ext"
    ROPE = "rope"
    # normalisation
    RMS_NORM = "rms_norm"
    NORM = "norm"
    # element-wise
    ADD = "add"
    MUL = "mul"
    DIV = "div"
    SCALE = "scale"
    CLAMP = "clamp"
    FILL = "fill"
    SILU = "silu"
    GELU = "gelu"
    SIGMOID = "sigmoid"
    SWIGLU = "swiglu"
    # reductions and selection
    SUM_ROWS = "sum_rows"
    ARGSORT = "argsort"
    TOP_K = "top_k"

    def __str__(self) -> str:
        return self.value

    @property
    def is_view(self) -> bool:
        return self in VIEW_OPS


VIEW_OPS = frozenset({OpKind.VIEW, OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE})
