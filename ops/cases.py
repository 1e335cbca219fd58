"""Conformance cases for every op: small shapes, odd sizes, broadcasts, strided sources and
every accepted type, in the spirit of ggml's test-backend-ops.

A Case builds its graph from a CaseBuilder, whose leafs are filled uniform in [-1, 1] (index
tensors with valid indices). `CASES[OpKind]` lists each op's cases; ops/__init__.py attaches
them to the op records so `REGISTRY[op].cases()` yields them. `perf=True` cases are larger
shapes used by the perf mode only.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from ggraph.opkind import OpKind
from ggraph.tensor import Context, Tensor
from ggraph.types import GGMLType as T

from . import attention as A, elementwise as E, matmul as M, reduce as R
from . import rope as RP, rows as RW, views as V
from .norm import norm, rms_norm

# NMSE tolerances of facts page section 9
TOL_DEFAULT = 1e-7
TOL_MATMUL = 5e-4
TOL_SOFTMAX = 1e-6
TOL_QUANT_COPY = {T.Q8_0: 1e-5, T.Q4_0: 1e-3, T.Q4_1: 1e-3}  # about one quantization step


class CaseBuilder:
    """Makes a case's leafs: values uniform in [-1, 1], converted to each leaf's type."""

    def __init__(self, seed: int) -> None:
        self.ctx = Context("conformance")
        self.rng = np.random.default_rng(seed)

    def inp(self, type: T, *ne: int, name: str = "") -> Tensor:
        t = self.ctx.new_tensor(type, ne, name=name)
        return t.set_data(self.rng.uniform(-1.0, 1.0, t.shape))

    def idx(self, type: T, n_max: int, *ne: int, unique_rows: bool = False) -> Tensor:
        t = self.ctx.new_tensor(type, ne)
        if unique_rows:  # set_rows: distinct destinations per (j, k) so the result is defined
            vals = np.stack([self.rng.permutation(n_max)[: ne[0]]
                             for _ in range(int(np.prod(ne[1:])))]).reshape(t.shape)
        else:
            vals = self.rng.integers(0, n_max, t.shape)
        return t.set_data(vals)

    def mask(self, n_kv: int, rows: int, type: T = T.F16, *more: int) -> Tensor:
        """A causal-looking mask with -inf entries and a fully visible first column."""
        t = self.ctx.new_tensor(type, (n_kv, rows) + more)
        m = self.rng.uniform(-1.0, 1.0, t.shape)
        m[self.rng.uniform(size=t.shape) < 0.2] = -np.inf
        m[..., 0] = 0.0
        return t.set_data(m)

    def cache(self, type: T, *ne: int) -> Tensor:
        t = self.ctx.new_tensor(type, ne, name="cache")
        t.buffer = "cache"  # pre-allocated, zero, like a fresh KV cache
        return t

    def strided(self, type: T, *ne: int) -> Tensor:
        """A non-contiguous view with ne: a transposed, padded source (dims 0 and 1 swapped)."""
        big = self.inp(type, ne[1] + 3, ne[0], *ne[2:])
        v = V.view_4d(big, ne[1], ne[0], *(tuple(ne[2:]) + (1, 1))[:2], big.nb[1],
                      big.nb[2], big.nb[3], 0) if len(ne) >= 2 else big
        return V.transpose(v)


@dataclass(frozen=True)
class Case:
    op: OpKind
    vars: tuple[tuple[str, Any], ...]
    build: Callable[[CaseBuilder], Tensor]
    tol: float = TOL_DEFAULT
    perf: bool = False
    flops: Callable[[Tensor], float] | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return f"{self.op.name}({','.join(f'{k}={_fmt(v)}' for k, v in self.vars)})"

    def make(self) -> tuple[CaseBuilder, Tensor]:
        b = CaseBuilder(zlib.crc32(self.label.encode()))
        return b, self.build(b)


def _fmt(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return str(v)


def _case(op: OpKind, build: Callable, tol: float = TOL_DEFAULT, perf: bool = False,
          flops: Callable | None = None, **vars: Any) -> Case:
    return Case(op, tuple(vars.items()), build, tol, perf, flops)


def _mm_flops(t: Tensor) -> float:
    a = t.src[0]
    return 2.0 * a.ne[0] * t.nelements


def _fa_flops(t: Tensor) -> float:
    q, k, v, _ = t.src
    return 2.0 * q.ne[1] * q.ne[2] * q.ne[3] * k.ne[1] * (q.ne[0] + v.ne[0])


WEIGHTS = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0)
KV = (T.F16, T.BF16, T.F32, T.Q8_0, T.Q4_0, T.Q4_1)


def _mul_mat() -> Iterator[Case]:
    shapes = ((16, 1, 64, (1, 1), (1, 1)), (15, 7, 96, (1, 1), (1, 1)),
              (16, 9, 64, (1, 2), (3, 2)), (8, 17, 32, (2, 1), (4, 1)))
    for t in WEIGHTS:
        for m, n, k, ab, bb in shapes:  # ab, bb: ne[2:4] of a and b (block-repeat broadcast)
            yield _case(OpKind.MUL_MAT, lambda B, t=t, m=m, n=n, k=k, ab=ab, bb=bb: M.mul_mat(
                B.inp(t, k, m, *ab), B.inp(T.F32, k, n, *bb)), TOL_MATMUL, flops=_mm_flops,
                type=t, m=m, n=n, k=k, bs=list(bb), nr=[bb[0] // ab[0], bb[1] // ab[1]])
        yield _case(OpKind.MUL_MAT, lambda B, t=t: M.mul_mat(
            B.inp(t, 64, 12), B.strided(T.F32, 64, 5)), TOL_MATMUL, flops=_mm_flops,
            type=t, m=12, n=5, k=64, b="strided")
    for t, (m, n, k) in ((T.F32, (1024, 512, 1024)), (T.Q4_1, (1536, 1, 576)),
                         (T.Q8_0, (1536, 1, 576)), (T.Q4_1, (1536, 512, 576))):
        yield _case(OpKind.MUL_MAT, lambda B, t=t, m=m, n=n, k=k: M.mul_mat(
            B.inp(t, k, m), B.inp(T.F32, k, n)), TOL_MATMUL, perf=True, flops=_mm_flops,
            type=t, m=m, n=n, k=k)


def _mul_mat_id() -> Iterator[Case]:
    for t in WEIGHTS:
        for n_b in (1, 2):
            yield _case(OpKind.MUL_MAT_ID, lambda B, t=t, n_b=n_b: M.mul_mat_id(
                B.inp(t, 64, 9, 4), B.inp(T.F32, 64, n_b, 5), B.idx(T.I32, 4, 2, 5)),
                TOL_MATMUL, flops=_mm_flops, type=t, n_expert=4, n_used=2, n_b=n_b, m=9, k=64)


def _soft_max() -> Iterator[Case]:
    for mt in (None, T.F16, T.F32):
        for scale, max_bias in ((1.0, 0.0), (0.125, 0.0), (0.5, 8.0)):
            if max_bias and mt is None:
                continue
            yield _case(OpKind.SOFT_MAX, lambda B, mt=mt, s=scale, mb=max_bias: A.soft_max_ext(
                B.inp(T.F32, 33, 5, 6, 2), B.mask(33, 7, mt, 3, 1) if mt is not None else None, s, mb),
                TOL_SOFTMAX, mask=str(mt) if mt is not None else "none", scale=scale, max_bias=max_bias,
                ne=[33, 5, 6, 2])
    yield _case(OpKind.SOFT_MAX, lambda B: A.soft_max_ext(
        B.inp(T.F32, 16, 4, 3), B.mask(16, 4), 0.5, 0.0, B.inp(T.F32, 3)), TOL_SOFTMAX,
        sinks=True, ne=[16, 4, 3])
    yield _case(OpKind.SOFT_MAX, lambda B: A.soft_max_ext(
        B.inp(T.F32, 16, 4, 3), B.mask(16, 4), 0.5, 8.0, head_offset=2, n_head=8),
        TOL_SOFTMAX, head_offset=2, n_head=8, max_bias=8.0)


def _flash_attn() -> Iterator[Case]:
    for kt in KV:
        for hd, T_, H, Hkv, nkv in ((64, 1, 4, 2, 96), (32, 5, 4, 4, 64), (64, 3, 8, 1, 33),
                                    (32, 9, 4, 2, 1100)):  # 9 queries: CPU's blockwise path
            yield _case(OpKind.FLASH_ATTN_EXT, lambda B, kt=kt, hd=hd, t=T_, h=H, hk=Hkv,
                        n=nkv: A.flash_attn_ext(
                B.inp(T.F32, hd, t, h), B.inp(kt, hd, n, hk), B.inp(kt, hd, n, hk),
                B.mask(n, t), 1.0 / np.sqrt(hd)), TOL_MATMUL, flops=_fa_flops,
                type_kv=kt, hs=hd, nh=H, nr=H // Hkv, kv=nkv, nb=T_)
    for extra in (dict(max_bias=8.0), dict(softcap=30.0), dict(max_bias=8.0, softcap=30.0)):
        for nq in (4, 12):
            yield _case(OpKind.FLASH_ATTN_EXT, lambda B, e=extra, nq=nq: A.flash_attn_ext(
                B.inp(T.F32, 32, nq, 4), B.inp(T.F16, 32, 40, 2), B.inp(T.F16, 32, 40, 2),
                B.mask(40, nq), 0.2, **e), TOL_MATMUL, flops=_fa_flops, type_kv=T.F16, nb=nq,
                **extra)
    for t in (1, 512):
        yield _case(OpKind.FLASH_ATTN_EXT, lambda B, t=t: A.flash_attn_ext(
            B.inp(T.F32, 64, t, 9), B.inp(T.F16, 64, 4096, 3), B.inp(T.F16, 64, 4096, 3),
            B.mask(4096, t), 0.125), TOL_MATMUL, perf=True, flops=_fa_flops,
            type_kv=T.F16, hs=64, nh=9, kv=4096, nb=t)


def _rope() -> Iterator[Case]:
    for t in (T.F32, T.F16):
        for mode in (RP.RopeMode.NORMAL, RP.RopeMode.NEOX):
            for n_dims, kw in ((64, {}), (32, dict(freq_scale=0.25)),
                               (64, dict(freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64,
                                         attn_factor=1.2))):
                yield _case(OpKind.ROPE, lambda B, t=t, m=mode, nd=n_dims, kw=kw: RP.rope_ext(
                    B.inp(t, 64, 3, 5), B.idx(T.I32, 4096, 5), None, nd, m, **kw),
                    type=t, mode=int(mode), n_dims=n_dims, **kw)
    yield _case(OpKind.ROPE, lambda B: RP.rope_ext(
        B.inp(T.F32, 64, 3, 5), B.idx(T.I32, 4096, 5),
        B.ctx.new_tensor(T.F32, (32,)).set_data(B.rng.uniform(1.0, 4.0, 32)), 64,
        RP.RopeMode.NEOX), freq_factors=True)


def _norms() -> Iterator[Case]:
    for kind, f in ((OpKind.RMS_NORM, rms_norm), (OpKind.NORM, norm)):
        for ne in ((64, 5, 3), (33, 2)):
            yield _case(kind, lambda B, f=f, ne=ne: f(B.inp(T.F32, *ne), 1e-6), ne=list(ne))
        yield _case(kind, lambda B, f=f: f(B.strided(T.F32, 16, 5), 1e-6), ne=[16, 5],
                    src="strided")


def _binary() -> Iterator[Case]:
    for kind, f in ((OpKind.ADD, E.add), (OpKind.MUL, E.mul), (OpKind.DIV, E.div)):
        for ta in (T.F32, T.F16):
            for nb in ((64, 5, 3, 2), (64, 1, 3, 1), (1, 5, 1, 2), (16, 1, 1, 1)):
                yield _case(kind, lambda B, f=f, ta=ta, nb=nb: f(
                    B.inp(ta, 64, 5, 3, 2), B.inp(T.F32, *nb)), type=ta, ne_a=[64, 5, 3, 2],
                    ne_b=list(nb))
        yield _case(kind, lambda B, f=f: f(B.strided(T.F32, 16, 5), B.inp(T.F32, 16, 1)),
                    type=T.F32, a="strided")
    for t in (T.F32, T.F16):
        yield _case(OpKind.SWIGLU, lambda B, t=t: E.swiglu(B.inp(t, 64, 5), B.inp(t, 64, 5)),
                    type=t, ne=[64, 5])


def _unary() -> Iterator[Case]:
    ops = ((OpKind.SILU, E.silu, {}), (OpKind.GELU, E.gelu, {}), (OpKind.SIGMOID, E.sigmoid, {}),
           (OpKind.SCALE, E.scale, dict(s=0.5, b=0.25)), (OpKind.CLAMP, E.clamp,
                                                          dict(min=-0.3, max=0.6)),
           (OpKind.FILL, E.fill, dict(value=-2.5)))
    for kind, f, kw in ops:
        for t in (T.F32, T.F16):
            yield _case(kind, lambda B, f=f, t=t, kw=kw: f(B.inp(t, 33, 4, 3), **kw), type=t,
                        ne=[33, 4, 3], **kw)
        yield _case(kind, lambda B, f=f, kw=kw: f(B.strided(T.F32, 16, 5), **kw), type=T.F32,
                    src="strided", **kw)


def _rows() -> Iterator[Case]:
    for t in WEIGHTS + (T.I32,):
        yield _case(OpKind.GET_ROWS, lambda B, t=t: RW.get_rows(
            B.inp(t, 64, 10, 3) if t != T.I32 else B.idx(T.I32, 1000, 64, 10, 3),
            B.idx(T.I32, 10, 7, 3)), TOL_DEFAULT if t != T.I32 else 0.0, type=t, n=7,
            ne=[64, 10, 3])
    for t in (T.F16, T.BF16, T.F32, T.Q8_0, T.Q4_0, T.Q4_1):
        for it in (T.I64, T.I32):
            yield _case(OpKind.SET_ROWS, lambda B, t=t, it=it: RW.set_rows(
                B.cache(t, 64, 12, 2), B.inp(T.F32, 64, 5, 2),
                B.idx(it, 12, 5, 2, unique_rows=True)), 0.0, type=t, type_idx=it, n=5,
                ne=[64, 12, 2])


def _copies() -> Iterator[Case]:
    for src in (T.F32, T.F16, T.BF16):
        for dst in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1):
            tol = TOL_QUANT_COPY.get(dst, 0.0 if src == dst or dst == T.F32 else TOL_DEFAULT)
            if src == T.F32 and dst in (T.F16, T.BF16):
                tol = 0.0  # one rounding, identical everywhere
            yield _case(OpKind.CPY, lambda B, s=src, d=dst: V.cpy(
                B.inp(s, 64, 6, 2), B.cache(d, 64, 12)), tol, type_src=src, type_dst=dst)
        yield _case(OpKind.CPY, lambda B, s=src: V.cpy(
            B.strided(s, 32, 6), B.cache(T.F16, 32, 6)), TOL_DEFAULT, type_src=src,
            type_dst=T.F16, src="strided")
    for t in (T.F32, T.F16, T.BF16, T.I32, T.I64):
        yield _case(OpKind.CONT, lambda B, t=t: V.cont(V.transpose(_any(B, t, 8, 5, 3))), 0.0,
                    type=t, src="transposed")
    for t in (T.Q8_0, T.Q4_0, T.Q4_1):
        yield _case(OpKind.CONT, lambda B, t=t: V.cont(V.permute(B.inp(t, 64, 5, 3), 0, 2, 1, 3)),
                    0.0, type=t, src="permuted")
    for t in (T.I32, T.I64):
        yield _case(OpKind.CPY, lambda B, t=t: V.cpy(_any(B, t, 16, 6), B.cache(t, 96)), 0.0,
                    type_src=t, type_dst=t)
    for t in (T.F32, T.F16, T.BF16, T.I32, T.I64):
        for dim in range(4):
            yield _case(OpKind.CONCAT, lambda B, t=t, d=dim: R.concat(
                _any(B, t, 6, 5, 4, 3), _any(B, t, *[(2 if i == d else x) for i, x in
                                                     enumerate((6, 5, 4, 3))]), d),
                0.0, type=t, dim=dim)
    for t in (T.F32, T.F16, T.BF16, T.I32, T.I64):
        yield _case(OpKind.REPEAT, lambda B, t=t: R.repeat(
            _any(B, t, 8, 1, 3), _any(B, t, 16, 4, 3, 2)), 0.0, type=t)


def _any(B: CaseBuilder, t: T, *ne: int) -> Tensor:
    return B.idx(t, 1000, *ne) if t.is_int else B.inp(t, *ne)


def _reduce() -> Iterator[Case]:
    for ne in ((64, 5, 3), (7, 2)):
        yield _case(OpKind.SUM_ROWS, lambda B, ne=ne: R.sum_rows(B.inp(T.F32, *ne)),
                    ne=list(ne))
        for order in (R.SortOrder.ASC, R.SortOrder.DESC):
            yield _case(OpKind.ARGSORT, lambda B, ne=ne, o=order: R.argsort(
                B.inp(T.F32, *ne), o), 0.0, ne=list(ne), order=order.name)
        yield _case(OpKind.TOP_K, lambda B, ne=ne: R.top_k(B.inp(T.F32, *ne), 4), 0.0,
                    ne=list(ne), k=4)


def _views() -> Iterator[Case]:
    # views compute nothing; they are checked through a copy of the viewed window
    for kind, f in ((OpKind.VIEW, lambda a: V.view_3d(a, 8, 3, 2, a.nb[1], a.nb[2],
                                                      a.nb[1])),
                    (OpKind.RESHAPE, lambda a: V.reshape(a, 40, 3)),
                    (OpKind.PERMUTE, lambda a: V.permute(a, 2, 0, 1, 3)),
                    (OpKind.TRANSPOSE, lambda a: V.transpose(a))):
        yield _case(kind, lambda B, f=f: V.cont(f(B.inp(T.F32, 8, 5, 3))), 0.0)


CASES: dict[OpKind, Callable[[], Iterator[Case]]] = {
    OpKind.MUL_MAT: _mul_mat, OpKind.MUL_MAT_ID: _mul_mat_id, OpKind.SOFT_MAX: _soft_max,
    OpKind.FLASH_ATTN_EXT: _flash_attn, OpKind.ROPE: _rope,
}


def _by_op(gen: Callable[[], Iterator[Case]], kind: OpKind) -> Callable[[], Iterator[Case]]:
    return lambda: (c for c in gen() if c.op == kind)


for _gen, _kinds in ((_norms, (OpKind.RMS_NORM, OpKind.NORM)),
                     (_binary, (OpKind.ADD, OpKind.MUL, OpKind.DIV, OpKind.SWIGLU)),
                     (_unary, (OpKind.SILU, OpKind.GELU, OpKind.SIGMOID, OpKind.SCALE,
                               OpKind.CLAMP, OpKind.FILL)),
                     (_rows, (OpKind.GET_ROWS, OpKind.SET_ROWS)),
                     (_copies, (OpKind.CPY, OpKind.CONT, OpKind.CONCAT, OpKind.REPEAT)),
                     (_reduce, (OpKind.SUM_ROWS, OpKind.ARGSORT, OpKind.TOP_K)),
                     (_views, (OpKind.VIEW, OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE))):
    for _k in _kinds:
        CASES[_k] = _by_op(_gen, _k)
