"""Softmax and attention: soft_max_ext (mask, scale, ALiBi, sinks) and flash_attn_ext;
soft_max_ext_back (ggml's softmax gradient) and soft_max's backward rule. flash_attn_ext has
no backward rule: training takes the unfused path (mul_mat, soft_max_ext, mul_mat).

soft_max_ext runs in place on its input in ggml-alloc, which is how softmax(K*Q) reuses the
K*Q buffer. flash_attn_ext reads K and V of every KV cache type (the records with kv=True:
F16, Q8_0, Q5_0, IQ4_NL, ...) and returns [Dv, H, T, S]: heads and tokens swapped relative to q.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import kv_types
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import KV, TOL_MATMUL, TOL_SOFTMAX, Case, case
from .registry import (FLOATS, GGMLMap, GGMLProbe, OpDef, ggml_fn, new_node, register, require,
                       require_type, types_ok)

SOFT_MAX = OpKind.define("soft_max", Family.ATTENTION)
FLASH_ATTN_EXT = OpKind.define("flash_attn_ext", Family.ATTENTION)
SOFT_MAX_BACK = OpKind.define("soft_max_back", Family.ATTENTION)

KV_TYPES = kv_types()  # the types whose record says kv=True (the KV cache types)
MASK_TYPES = (GGMLType.F16, GGMLType.F32)


@dataclass(frozen=True)
class SoftMaxParams:
    scale: float = 1.0
    max_bias: float = 0.0
    # ALiBi for a slice of heads (split attention): the slice's first head and the model's
    # head count, so each head keeps its true slope. 0 means "a.ne[2] heads from head 0".
    head_offset: int = 0
    n_head: int = 0


@dataclass(frozen=True)
class SoftMaxBackParams:
    scale: float = 1.0
    max_bias: float = 0.0


@dataclass(frozen=True)
class FlashAttnParams:
    scale: float = 1.0
    max_bias: float = 0.0
    softcap: float = 0.0
    head_offset: int = 0  # as in SoftMaxParams
    n_head: int = 0


def alibi_slopes(n: int, max_bias: float, head_offset: int = 0, n_head: int = 0) -> np.ndarray:
    """Slopes of heads head_offset .. head_offset+n-1 of a model with n_head heads
    (n_head 0: n). All 1 when max_bias is 0."""
    total = n_head or n
    return np.array([alibi_slope(head_offset + h, total, max_bias) for h in range(n)])


def alibi_slope(h: int, n_head: int, max_bias: float) -> float:
    """Slope of head h among n_head heads (1 when max_bias is 0), as ggml computes it."""
    if max_bias <= 0.0:
        return 1.0
    n_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    return m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1)


def soft_max_ext(a: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                 max_bias: float = 0.0, sinks: Tensor | None = None, head_offset: int = 0,
                 n_head: int = 0, name: str = "") -> Tensor:
    """Row softmax of a*scale + slope(head)*mask; optional per-head sinks join each row."""
    op = "soft_max_ext"
    require_type(op, "a", a, (GGMLType.F32,))
    require(a.is_contiguous(), op, "a must be contiguous", a=a)
    # the softmax of an empty row divides by an empty sum
    require(a.ne[0] > 0 or a.nrows == 0, op, "rows must hold at least one value (ne[0] >= 1)",
            a=a)
    if mask is not None:
        require_type(op, "mask", mask, MASK_TYPES)
        require(mask.is_contiguous(), op, "mask must be contiguous", mask=mask)
        require(mask.ne[0] == a.ne[0], op, f"mask.ne[0]={mask.ne[0]} must equal "
                f"a.ne[0]={a.ne[0]}", a=a, mask=mask)
        require(mask.ne[1] >= a.ne[1], op, f"mask.ne[1]={mask.ne[1]} must be at least "
                f"a.ne[1]={a.ne[1]}", a=a, mask=mask)
        require(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, op,
                "mask.ne[2:4] must divide a.ne[2:4] (broadcast by modulo)", a=a, mask=mask)
    require(max_bias <= 0.0 or mask is not None, op, "ALiBi (max_bias > 0) needs a mask", a=a)
    if sinks is not None:
        require_type(op, "sinks", sinks, (GGMLType.F32,))
        require(sinks.nelements == a.ne[2], op, f"sinks needs one value per head "
                f"(a.ne[2]={a.ne[2]}), has {sinks.nelements}", a=a, sinks=sinks)
    _check_head_slice(op, a.ne[2], head_offset, n_head, a=a)
    return new_node(OpKind.SOFT_MAX, (a, mask, sinks), GGMLType.F32, a.ne,
                    SoftMaxParams(float(scale), float(max_bias), head_offset, n_head), name=name)


def _check_head_slice(op: str, n: int, head_offset: int, n_head: int, **t: Tensor) -> None:
    require(head_offset >= 0 and (n_head == 0 and head_offset == 0 or
                                  head_offset + n <= n_head), op,
            f"head slice {head_offset}..{head_offset + n - 1} does not fit in n_head={n_head}",
            **t)


def soft_max(a: Tensor, name: str = "") -> Tensor:
    """Plain row softmax."""
    return soft_max_ext(a, name=name)


def soft_max_ext_back(dy: Tensor, y: Tensor, scale: float = 1.0, max_bias: float = 0.0,
                      name: str = "") -> Tensor:
    """ggml_soft_max_ext_back: the gradient of soft_max_ext's input a for the gradient dy of
    its result y: scale * y * (dy - sum(dy * y)) per row. max_bias is carried as ggml does
    and changes nothing (ALiBi biases the mask term, constant in a; ggml's CPU kernel
    asserts max_bias == 0)."""
    op = "soft_max_ext_back"
    require_type(op, "dy", dy, (GGMLType.F32,))
    require_type(op, "y", y, (GGMLType.F32,))
    require(dy.ne == y.ne, op, "dy and y must have the same shape", dy=dy, y=y)
    return new_node(OpKind.SOFT_MAX_BACK, (dy, y), GGMLType.F32, y.ne,
                    SoftMaxBackParams(float(scale), float(max_bias)), name=name)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                   scale: float = 1.0, max_bias: float = 0.0, softcap: float = 0.0,
                   head_offset: int = 0, n_head: int = 0, name: str = "") -> Tensor:
    """softmax(q.k*scale (softcapped) + slope*mask) . v per head, online softmax in kernels.
    Not differentiable here (no backward rule, as in ggml): a training graph takes the
    unfused path, mul_mat + soft_max_ext + mul_mat."""
    op = "flash_attn_ext"
    require_type(op, "q", q, (GGMLType.F32,))
    require_type(op, "k", k, KV_TYPES)
    require_type(op, "v", v, KV_TYPES)
    kw = dict(q=q, k=k, v=v)
    require(q.ne[0] == k.ne[0], op, f"q.ne[0]={q.ne[0]} (head size) must equal "
            f"k.ne[0]={k.ne[0]}", **kw)
    require(k.ne[1] == v.ne[1], op, f"k.ne[1]={k.ne[1]} and v.ne[1]={v.ne[1]} (n_kv) differ",
            **kw)
    require(k.ne[2] == v.ne[2] and k.ne[3] == v.ne[3], op, "k and v must have the same heads "
            "and sequences (ne[2], ne[3])", **kw)
    require(q.ne[2] % k.ne[2] == 0, op, f"q heads ({q.ne[2]}) must be a multiple of K/V heads "
            f"({k.ne[2]})", **kw)
    require(q.ne[3] % k.ne[3] == 0, op, f"q.ne[3]={q.ne[3]} must be a multiple of "
            f"k.ne[3]={k.ne[3]}", **kw)
    if mask is not None:
        require_type(op, "mask", mask, MASK_TYPES)
        require(mask.ne[0] == k.ne[1], op, f"mask.ne[0]={mask.ne[0]} must equal "
                f"n_kv={k.ne[1]}", mask=mask, k=k)
        require(mask.ne[1] >= q.ne[1], op, f"mask.ne[1]={mask.ne[1]} must be at least the "
                f"number of queries {q.ne[1]}", mask=mask, q=q)
        require(q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0, op,
                "mask.ne[2:4] must divide q.ne[2:4]", mask=mask, q=q)
    require(max_bias <= 0.0 or mask is not None, op, "ALiBi (max_bias > 0) needs a mask", q=q)
    require(softcap >= 0.0, op, f"softcap must be >= 0, got {softcap}", q=q)
    _check_head_slice(op, q.ne[2], head_offset, n_head, q=q)
    return new_node(OpKind.FLASH_ATTN_EXT, (q, k, v, mask), GGMLType.F32,
                    (v.ne[0], q.ne[2], q.ne[1], q.ne[3]),
                    FlashAttnParams(float(scale), float(max_bias), float(softcap), head_offset,
                                    n_head), name=name)


# -- references ---------------------------------------------------------------------------

def _mask_for(ex, mask: Tensor | None, ne1: int, ne2: int, ne3: int) -> np.ndarray | float:
    """mask rows 0..ne1-1, broadcast over dims 2 and 3 by modulo -> (ne3, ne2, ne1, ne0)."""
    if mask is None:
        return 0.0
    m = ex.read(mask).astype(np.float64)[:, :, :ne1, :]
    i3 = np.arange(ne3) % mask.ne[3]
    i2 = np.arange(ne2) % mask.ne[2]
    return m[i3][:, i2]


def _softmax_rows(w: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    mx = w.max(axis=-1, keepdims=True)
    if sinks is not None:
        mx = np.maximum(mx, sinks)
    e = np.exp(w - mx)
    s = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        s = s + np.exp(sinks - mx)
    return e / s


def _ref_soft_max(node: Tensor, ex) -> np.ndarray:
    a, mask, sinks = node.src
    p: SoftMaxParams = node.params
    x = ex.read(a).astype(np.float64)
    n3, n2, n1, _ = x.shape
    slopes = alibi_slopes(n2, p.max_bias, p.head_offset, p.n_head)
    w = x * p.scale + slopes[None, :, None, None] * _mask_for(ex, mask, n1, n2, n3)
    s = None
    if sinks is not None:
        s = ex.read(sinks).astype(np.float64).reshape(-1)[None, :, None, None]
    with np.errstate(invalid="ignore"):
        return _softmax_rows(w, s)


def _ref_soft_max_back(node: Tensor, ex) -> np.ndarray:
    dy = ex.read(node.src[0]).astype(np.float64)
    y = ex.read(node.src[1]).astype(np.float64)
    return node.params.scale * y * (dy - np.sum(dy * y, axis=-1, keepdims=True))


def _soft_max_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """a's gradient only: scale * y * (dy - sum(dy*y)), which holds with a mask, ALiBi slopes
    (they scale the mask, not a) and sinks (extra terms of the denominator only). The mask
    and the sinks get none (ggml differentiates neither)."""
    if not wants[0]:
        return (None,) * len(node.src)
    p: SoftMaxParams = node.params
    return (soft_max_ext_back(grad, node, p.scale, p.max_bias),) + (None,) * (len(node.src) - 1)


def _ref_flash_attn_ext(node: Tensor, ex) -> np.ndarray:
    q, k, v, mask = node.src
    p: FlashAttnParams = node.params
    Q = ex.read(q).astype(np.float64)           # (S, H, T, Dk)
    K = ex.read(k).astype(np.float64)           # (Sk, Hkv, n_kv, Dk)
    V = ex.read(v).astype(np.float64)           # (Sk, Hkv, n_kv, Dv)
    S, H, T, _ = Q.shape
    rk2, rk3 = H // k.ne[2], S // k.ne[3]
    K = np.repeat(np.repeat(K, rk3, axis=0), rk2, axis=1)
    V = np.repeat(np.repeat(V, rk3, axis=0), rk2, axis=1)
    s = Q @ np.swapaxes(K, -1, -2)              # (S, H, T, n_kv)
    if p.softcap:
        s = p.softcap * np.tanh(s * (p.scale / p.softcap))
    else:
        s = s * p.scale
    slopes = alibi_slopes(H, p.max_bias, p.head_offset, p.n_head)
    s = s + slopes[None, :, None, None] * _mask_for(ex, mask, T, H, S)
    with np.errstate(invalid="ignore"):
        w = _softmax_rows(s, None)
    # ggml's kernels: a row whose every entry is masked (-inf) has S == 0 and gives 0, not NaN
    w = np.where(np.isneginf(s.max(axis=-1, keepdims=True)), 0.0, w)
    out = w @ V                                 # (S, H, T, Dv)
    return np.swapaxes(out, 1, 2)               # (S, T, H, Dv) = ne [Dv, H, T, S]


# -- conformance cases --------------------------------------------------------------------

def _soft_max_cases() -> Iterator[Case]:
    for mt in (None, T.F16, T.F32):
        for scale, max_bias in ((1.0, 0.0), (0.125, 0.0), (0.5, 8.0)):
            if max_bias and mt is None:
                continue
            yield case(OpKind.SOFT_MAX, lambda B, mt=mt, s=scale, mb=max_bias: soft_max_ext(
                B.inp(T.F32, 33, 5, 6, 2), B.mask(33, 7, mt, 3, 1) if mt is not None else None,
                s, mb), TOL_SOFTMAX, mask=str(mt) if mt is not None else "none", scale=scale,
                max_bias=max_bias, ne=[33, 5, 6, 2])
    yield case(OpKind.SOFT_MAX, lambda B: soft_max_ext(
        B.inp(T.F32, 16, 4, 3), B.mask(16, 4), 0.5, 0.0, B.inp(T.F32, 3)), TOL_SOFTMAX,
        sinks=True, ne=[16, 4, 3])
    yield case(OpKind.SOFT_MAX, lambda B: soft_max_ext(
        B.inp(T.F32, 16, 4, 3), B.mask(16, 4), 0.5, 8.0, head_offset=2, n_head=8),
        TOL_SOFTMAX, head_offset=2, n_head=8, max_bias=8.0)


def _soft_max_back_cases() -> Iterator[Case]:
    for ne, scale in (((33, 5, 6, 2), 1.0), ((16, 4, 3), 0.125), ((1, 7), 1.0)):
        yield case(OpKind.SOFT_MAX_BACK, lambda B, ne=ne, s=scale: soft_max_ext_back(
            B.inp(T.F32, *ne), soft_max(B.inp(T.F32, *ne)), s), TOL_SOFTMAX, ne=list(ne),
            scale=scale)


def fa_flops(t: Tensor) -> float:
    q, k, v, _ = t.src
    return 2.0 * q.ne[1] * q.ne[2] * q.ne[3] * k.ne[1] * (q.ne[0] + v.ne[0])


def _flash_attn_cases() -> Iterator[Case]:
    for kt in KV:
        for hd, T_, H, Hkv, nkv in ((64, 1, 4, 2, 96), (32, 5, 4, 4, 64), (64, 3, 8, 1, 33),
                                    (32, 9, 4, 2, 1100)):  # 9 queries: CPU's blockwise path
            yield case(OpKind.FLASH_ATTN_EXT, lambda B, kt=kt, hd=hd, t=T_, h=H, hk=Hkv,
                       n=nkv: flash_attn_ext(
                B.inp(T.F32, hd, t, h), B.inp(kt, hd, n, hk), B.inp(kt, hd, n, hk),
                B.mask(n, t), 1.0 / np.sqrt(hd)), TOL_MATMUL, flops=fa_flops,
                type_kv=kt, hs=hd, nh=H, nr=H // Hkv, kv=nkv, nb=T_)
    for extra in (dict(max_bias=8.0), dict(softcap=30.0), dict(max_bias=8.0, softcap=30.0)):
        for nq in (4, 12):
            yield case(OpKind.FLASH_ATTN_EXT, lambda B, e=extra, nq=nq: flash_attn_ext(
                B.inp(T.F32, 32, nq, 4), B.inp(T.F16, 32, 40, 2), B.inp(T.F16, 32, 40, 2),
                B.mask(40, nq), 0.2, **e), TOL_MATMUL, flops=fa_flops, type_kv=T.F16, nb=nq,
                **extra)
    for t in (1, 512):
        yield case(OpKind.FLASH_ATTN_EXT, lambda B, t=t: flash_attn_ext(
            B.inp(T.F32, 64, t, 9), B.inp(T.F16, 64, 4096, 3), B.inp(T.F16, 64, 4096, 3),
            B.mask(4096, t), 0.125), TOL_MATMUL, perf=True, flops=fa_flops,
            type_kv=T.F16, hs=64, nh=9, kv=4096, nb=t)


def _ggml_soft_max(lib, ctx, t: Tensor, S: list):
    p = t.params
    g = lib.ggml_soft_max_ext(ctx, S[0], S[1], p.scale, p.max_bias)
    if t.src[2] is not None:
        lib.ggml_soft_max_add_sinks(g, S[2])
    return g


_SOFT_MAX_DECL = (ggml_fn("ggml_soft_max_ext", "a", "mask", "float scale", "float max_bias") +
                  "\nvoid ggml_soft_max_add_sinks(struct ggml_tensor * a, "
                  "struct ggml_tensor * sinks);")


def _ggml_alibi(t: Tensor) -> str | None:
    """ggml's ALiBi slopes count heads from 0 of the node's own heads: no head slice."""
    p, n = t.params, t.src[0].ne[2]
    if p.max_bias > 0 and (p.head_offset != 0 or p.n_head not in (0, n)):
        return (f"{t.op}: ggml has no head offset for ALiBi (head_offset={p.head_offset}, "
                f"n_head={p.n_head}): its slopes always count heads from 0 of a.ne[2]={n}")
    return None


def _ggml_flash_attn_limits(t: Tensor) -> str | None:
    q, k, _, mask = t.src
    if why := _ggml_alibi(t):
        return why
    if mask is not None and mask.type != GGMLType.F16:
        return f"ggml_flash_attn_ext needs an F16 mask, got {mask.type}"
    if q.ne[3] != k.ne[3]:
        return "ggml_flash_attn_ext needs q.ne[3] == k.ne[3] (no broadcast over dim 3)"
    return None


def _ggml_soft_max_back_limits(t: Tensor) -> str | None:
    if t.params.max_bias != 0.0:
        return f"ggml's CPU soft_max_back asserts max_bias == 0, got {t.params.max_bias}"
    if not all(s.is_contiguous() for s in t.src):
        return "ggml's CPU soft_max_back needs contiguous dy and y"
    return None


def _ggml_flash_attn_probe(k: GGMLProbe):
    return k.lib.ggml_flash_attn_ext(k.ctx, k.a, k.a, k.a, k.new(GGMLType.F16, 64, 4), 1.0,
                                     0.0, 0.0)


register(OpDef(OpKind.SOFT_MAX, "soft_max", _ref_soft_max, SoftMaxParams, inplace=True,
               cases=_soft_max_cases, accepts=lambda n: types_ok(n, (T.F32,), FLOATS, (T.F32,)),
               src_labels=True, backward=_soft_max_grad,
               ggml=GGMLMap(build=_ggml_soft_max, limits=_ggml_alibi, cdecl=_SOFT_MAX_DECL,
                            probe=lambda k: k.lib.ggml_soft_max_ext(k.ctx, k.a, k.null, 1.0,
                                                                    0.0))))
register(OpDef(OpKind.FLASH_ATTN_EXT, "flash_attn_ext", _ref_flash_attn_ext, FlashAttnParams,
               cases=_flash_attn_cases,
               accepts=lambda n: types_ok(n, (T.F32,), KV_TYPES, KV_TYPES, FLOATS),
               src_labels=True,
               ggml=GGMLMap(cdecl=ggml_fn("ggml_flash_attn_ext", "q", "k", "v", "mask",
                                          "float scale", "float max_bias",
                                          "float logit_softcap"),
                            build=lambda lib, ctx, t, S: lib.ggml_flash_attn_ext(
                   ctx, *S[:4], t.params.scale, t.params.max_bias, t.params.softcap),
                   limits=_ggml_flash_attn_limits, probe=_ggml_flash_attn_probe)))
register(OpDef(OpKind.SOFT_MAX_BACK, "soft_max_back", _ref_soft_max_back, SoftMaxBackParams,
               inplace=True, cases=_soft_max_back_cases,
               accepts=lambda n: types_ok(n, (T.F32,), (T.F32,)), src_labels=True,
               ggml=GGMLMap(build=lambda lib, ctx, t, S: lib.ggml_soft_max_ext_back(
                   ctx, S[0], S[1], t.params.scale, t.params.max_bias),
                   cdecl=ggml_fn("ggml_soft_max_ext_back", "a", "b", "float scale",
                                 "float max_bias"),
                   cpu_limits=_ggml_soft_max_back_limits,
                   probe=lambda k: k.lib.ggml_soft_max_ext_back(k.ctx, k.a, k.a, 1.0, 0.0))))
