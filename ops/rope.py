"""Rotary position embedding: rope_ext with NORMAL and NEOX modes, linear scaling and YaRN;
rope_ext_back (ggml's gradient of rope: the same rotation by -theta) and rope's backward rule.

a [head_dim, n_head, T, 1] rotated by positions pos (I32 [T]); dims past n_dims are copied.
`yarn_corr_dims` and `rope_cache` are plain numpy so the reference and tests share ggml's rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, GGMLType as T
from .case import Case, case
from .registry import (FLOATS, GGMLMap, OpDef, ggml_fn, new_node, register, require,
                       require_type, types_ok)

ROPE = OpKind.define("rope", Family.ROPE)
ROPE_BACK = OpKind.define("rope_back", Family.ROPE)


class RopeMode(IntEnum):
    NORMAL = 0  # rotate (x[2i], x[2i+1])
    NEOX = 2    # rotate (x[i], x[i + n_dims/2])


@dataclass(frozen=True)
class RopeParams:
    n_dims: int
    mode: RopeMode = RopeMode.NORMAL
    n_ctx_orig: int = 0
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def rope_ext(a: Tensor, pos: Tensor, freq_factors: Tensor | None = None, n_dims: int = 0,
             mode: RopeMode | int = RopeMode.NORMAL, n_ctx_orig: int = 0,
             freq_base: float = 10000.0, freq_scale: float = 1.0, ext_factor: float = 0.0,
             attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
             name: str = "") -> Tensor:
    return _rope(OpKind.ROPE, a, pos, freq_factors, n_dims, mode, n_ctx_orig, freq_base,
                 freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, name)


def rope_ext_back(a: Tensor, pos: Tensor, freq_factors: Tensor | None = None, n_dims: int = 0,
                  mode: RopeMode | int = RopeMode.NORMAL, n_ctx_orig: int = 0,
                  freq_base: float = 10000.0, freq_scale: float = 1.0, ext_factor: float = 0.0,
                  attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0,
                  name: str = "") -> Tensor:
    """ggml_rope_ext_back: a (the gradient of a rope_ext result) rotated by -theta with the
    same magnitude, the transpose of rope_ext's rotation: the gradient of its source."""
    return _rope(OpKind.ROPE_BACK, a, pos, freq_factors, n_dims, mode, n_ctx_orig, freq_base,
                 freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, name)


def _rope(kind: OpKind, a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int,
          mode: RopeMode | int, n_ctx_orig: int, freq_base: float, freq_scale: float,
          ext_factor: float, attn_factor: float, beta_fast: float, beta_slow: float,
          name: str) -> Tensor:
    op = "rope_ext" if kind == OpKind.ROPE else "rope_ext_back"
    # gradients are F32 (ggml's CPU rope_back takes F16 too)
    require_type(op, "a", a, (GGMLType.F32, GGMLType.F16) if kind == OpKind.ROPE else
                 (GGMLType.F32,))
    require_type(op, "pos", pos, (GGMLType.I32,))
    n_dims = n_dims or a.ne[0]
    try:
        mode = RopeMode(int(mode))
    except ValueError:
        raise ValueError(f"{op}: unknown rope mode {mode}; expected 0 (NORMAL) or 2 (NEOX) "
                         f"(a={a.describe()})") from None
    require(pos.ne[1] == pos.ne[2] == pos.ne[3] == 1, op, "pos must be a vector", pos=pos)
    require(pos.ne[0] == a.ne[2], op, f"pos has {pos.ne[0]} positions, a has {a.ne[2]} tokens "
            f"(a.ne[2])", a=a, pos=pos)
    require(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, op,
            f"n_dims={n_dims} must be even and in 1..a.ne[0]={a.ne[0]}", a=a)
    require(freq_base > 0 and freq_scale > 0, op,
            f"freq_base ({freq_base}) and freq_scale ({freq_scale}) must be positive", a=a)
    if freq_factors is not None:
        require_type(op, "freq_factors", freq_factors, (GGMLType.F32,))
        require(freq_factors.nelements >= n_dims // 2, op, f"freq_factors needs n_dims/2="
                f"{n_dims // 2} values, has {freq_factors.nelements}", freq_factors=freq_factors)
    p = RopeParams(n_dims, mode, int(n_ctx_orig), float(freq_base), float(freq_scale),
                   float(ext_factor), float(attn_factor), float(beta_fast), float(beta_slow))
    return new_node(kind, (a, pos, freq_factors), a.type, a.ne, p, name=name)


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dims between which YaRN ramps from extrapolation."""
    def corr_dim(n_rot: float) -> float:
        num = n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi))
        den = 2 * math.log(freq_base)
        if den == 0.0:   # freq_base 1: C's float division gives +-inf, which the clamps take
            return math.copysign(math.inf, num) if num else math.nan
        return num / den
    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    low = math.floor(lo) if math.isfinite(lo) else lo
    high = math.ceil(hi) if math.isfinite(hi) else hi
    return max(0.0, low), min(n_dims - 1.0, high)


def rope_cache(p: RopeParams, positions: np.ndarray,
               freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, shape (T, n_dims/2), for each position and rotated pair i."""
    i = np.arange(p.n_dims // 2, dtype=np.float64)
    theta_base = positions.astype(np.float64)[:, None] * p.freq_base ** (-2.0 * i / p.n_dims)
    if freq_factors is not None:
        theta_base = theta_base / freq_factors[: p.n_dims // 2][None, :]
    theta_interp = p.freq_scale * theta_base
    mscale = p.attn_factor
    theta = theta_interp
    if p.ext_factor != 0.0:
        low, high = yarn_corr_dims(p.n_dims, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
        mix = ramp * p.ext_factor
        theta = theta_interp * (1 - mix) + theta_base * mix
        mscale *= 1.0 + 0.1 * math.log(1.0 / p.freq_scale)
    return np.cos(theta) * mscale, np.sin(theta) * mscale


def _ref_rope(node: Tensor, ex) -> np.ndarray:
    a, pos, ff = node.src
    p: RopeParams = node.params
    x = ex.read(a).astype(np.float64)                   # (1?, T, n_head, head_dim)
    positions = ex.read(pos).reshape(-1)
    factors = ex.read(ff).reshape(-1).astype(np.float64) if ff is not None else None
    cos, sin = rope_cache(p, positions, factors)        # (T, n_dims/2)
    if node.op == OpKind.ROPE_BACK:  # the rotation by -theta
        sin = -sin
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = x.copy()
    half = p.n_dims // 2
    if p.mode == RopeMode.NEOX:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = np.arange(half) * 2, np.arange(half) * 2 + 1
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = x0 * cos - x1 * sin
    out[..., i1] = x0 * sin + x1 * cos
    return out


def _rope_grad(node: Tensor, grad: Tensor, wants: tuple[bool, ...]) -> tuple:
    """The source's gradient is the rotation by -theta (rope_ext_back); positions and freq
    factors get none (ggml differentiates neither)."""
    if not wants[0]:
        return (None, None, None)
    p: RopeParams = node.params
    _, pos, ff = node.src
    return (rope_ext_back(grad, pos, ff, p.n_dims, p.mode, p.n_ctx_orig, p.freq_base,
                          p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow),
            None, None)


# -- conformance cases --------------------------------------------------------------------

def _rope_cases(kind: OpKind = OpKind.ROPE) -> Iterator[Case]:
    f = rope_ext if kind == OpKind.ROPE else rope_ext_back
    for t in (T.F32, T.F16) if kind == OpKind.ROPE else (T.F32,):
        for mode in (RopeMode.NORMAL, RopeMode.NEOX):
            for n_dims, kw in ((64, {}), (32, dict(freq_scale=0.25)),
                               (64, dict(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64,
                                         attn_factor=1.2))):
                yield case(kind, lambda B, t=t, m=mode, nd=n_dims, kw=kw: f(
                    B.inp(t, 64, 3, 5), B.idx(T.I32, 4096, 5), None, nd, m, **kw),
                    type=t, mode=int(mode), n_dims=n_dims, **kw)
    yield case(kind, lambda B: f(
        B.inp(T.F32, 64, 3, 5), B.idx(T.I32, 4096, 5),
        B.ctx.new_tensor(T.F32, (32,)).set_data(B.rng.uniform(1.0, 4.0, 32)), 64,
        RopeMode.NEOX), freq_factors=True)


_ROPE_DECL = ggml_fn("ggml_rope_ext", "a", "b", "c", "int n_dims", "int mode", "int n_ctx_orig",
                     "float freq_base", "float freq_scale", "float ext_factor",
                     "float attn_factor", "float beta_fast", "float beta_slow")


def _ggml_rope(lib, ctx, t: Tensor, S: list):
    p = t.params
    fn = lib.ggml_rope_ext if t.op == OpKind.ROPE else lib.ggml_rope_ext_back
    return fn(ctx, *S[:3], p.n_dims, int(p.mode), p.n_ctx_orig, p.freq_base,
                             p.freq_scale, p.ext_factor, p.attn_factor, p.beta_fast,
                             p.beta_slow)


register(OpDef(OpKind.ROPE, "rope", _ref_rope, RopeParams, inplace=True, cases=_rope_cases,
               accepts=lambda n: types_ok(n, FLOATS, (T.I32,), (T.F32,)), src_labels=True,
               backward=_rope_grad,
               ggml=GGMLMap(build=_ggml_rope, cdecl=_ROPE_DECL, probe=lambda k: k.lib.ggml_rope_ext(
                   k.ctx, k.a, k.new(T.I32, 2), k.null, 64, 0, 0, 1e4, 1.0, 0.0, 1.0, 32.0,
                   1.0))))
register(OpDef(OpKind.ROPE_BACK, "rope_back", _ref_rope, RopeParams, inplace=True,
               cases=lambda: _rope_cases(OpKind.ROPE_BACK),
               accepts=lambda n: types_ok(n, (T.F32,), (T.I32,), (T.F32,)), src_labels=True,
               ggml=GGMLMap(build=_ggml_rope, cdecl=_ROPE_DECL.replace(
                   "ggml_rope_ext(", "ggml_rope_ext_back("),
                   probe=lambda k: k.lib.ggml_rope_ext_back(
                       k.ctx, k.a, k.new(T.I32, 2), k.null, 64, 0, 0, 1e4, 1.0, 0.0, 1.0, 32.0,
                       1.0))))
