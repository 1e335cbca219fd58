"""What a kernel is called with, from its node: the numbers each template takes after its
arrays (in the order the CPU and CUDA templates of the op take them), taken from the node's
params dataclass (ggraph.ops) once for every backend, and which copies move stored bytes as
they are. Host-side Python: nothing here is compiled.

Floats go in as Python floats (float64 in the kernels), except k_unary's parameters, which are
float32 like the values they combine with.
"""
from __future__ import annotations

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph.ops.reduce import SortOrder
from ggraph.ops.rope import RopeMode, yarn_corr_dims
from ggraph.ir.tensor import Tensor
from .elementwise import BINARY_CODE, UNARY_CODE


def unary_args(node: Tensor) -> tuple[int, np.float32, np.float32]:
    """k_unary's (op, p0, p1): scale's s and b, clamp's min and max, fill's value."""
    p = node.params
    if node.op == OpKind.SCALE:
        p0, p1 = p.s, p.b
    elif node.op == OpKind.CLAMP:
        p0, p1 = p.min, p.max
    elif node.op == OpKind.FILL:
        p0, p1 = p.value, 0.0
    else:
        p0, p1 = 0.0, 0.0
    return UNARY_CODE[node.op], np.float32(p0), np.float32(p1)


def binary_args(node: Tensor) -> tuple[int]:
    """k_binary's (op,)."""
    return (BINARY_CODE[node.op],)


def norm_args(node: Tensor) -> tuple[float, bool]:
    """k_norm's (eps, rms)."""
    return float(node.params.eps), node.op == OpKind.RMS_NORM


def soft_max_args(node: Tensor) -> tuple[float, float, int, int]:
    """k_soft_max's (scale, max_bias, h0, n_head): n_head 0 means the node's own heads."""
    p = node.params
    return float(p.scale), float(p.max_bias), p.head_offset, p.n_head or node.src[0].ne[2]


def flash_attn_args(node: Tensor) -> tuple[float, float, float, int, int]:
    """k_flash_attn's (scale, max_bias, softcap, h0, n_head); with a softcap the scores are
    softcap * tanh(q.k * scale / softcap), so the kernels take the scale divided by it."""
    p = node.params
    scale = p.scale / p.softcap if p.softcap else p.scale
    return (float(scale), float(p.max_bias), float(p.softcap), p.head_offset,
            p.n_head or node.src[0].ne[2])


def rope_args(node: Tensor) -> tuple[int, bool, float, float, float, float, float, float]:
    """k_rope's (n_dims, neox, freq_base, freq_scale, ext_factor, attn_factor, corr_lo,
    corr_hi): YaRN's correction dims when ext_factor is set, else (0, 0)."""
    p = node.params
    lo, hi = (yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
              if p.ext_factor != 0.0 else (0.0, 0.0))
    return (p.n_dims, p.mode == RopeMode.NEOX, float(p.freq_base), float(p.freq_scale),
            float(p.ext_factor), float(p.attn_factor), float(lo), float(hi))


def argsort_args(node: Tensor) -> tuple[bool, int]:
    """k_argsort's (desc, k): top_k is a descending sort cut at k, argsort a whole row's."""
    if node.op == OpKind.TOP_K:
        return True, node.params.k
    return node.params.order == SortOrder.DESC, node.src[0].ne[0]


def raw_copy(a: Tensor, d: Tensor) -> bool:
    """Whether copying a's elements into d moves stored values as they are: the same type,
    and for quantized types rows of the same length (whole blocks in the same places)."""
    return a.type == d.type and (not a.type.is_quantized or a.ne[0] == d.ne[0])
