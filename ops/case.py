"""What a conformance case is: a Case builds its graph from a CaseBuilder, whose leafs are
filled uniform in [-1, 1] (index tensors with valid indices), in the spirit of ggml's
test-backend-ops. Each op module declares its own cases (small shapes, odd sizes, broadcasts,
strided sources, every accepted type) in its OpDef; `perf=True` cases are larger shapes used
by the perf mode only. The tolerances are the facts page's (section 9).

A quantized leaf's rows are widened to whole blocks (a case written with 64-element rows
covers the K-quants, 256 per block). A type without a quantizer (the K-quants, until ggraph
has quantizers for them) is filled with random valid blocks: random bytes with small finite
f16 scales. The case only needs data the type can hold, and the reference reads it back
through the exact numpy dequantizer, so no quantizer is needed to test computing with it.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import kv_types, storable_types, weight_types
from ggraph.ir.types import GGMLType as T


# NMSE tolerances of facts page section 9
TOL_DEFAULT = 1e-7
TOL_MATMUL = 5e-4
TOL_SOFTMAX = 1e-6
# about one quantization step (Q5 halves Q4's; IQ4_NL's non-linear steps are Q4_0's at most)
TOL_QUANT_COPY = {T.Q8_0: 1e-5, T.Q4_0: 1e-3, T.Q4_1: 1e-3, T.Q5_0: 3e-4, T.Q5_1: 3e-4,
                  T.IQ4_NL: 1e-3}


def fit_row(t: T, n: int) -> int:
    """n rounded up to a whole number of t's blocks (the row length a case uses for t)."""
    return -(-n // t.block_size) * t.block_size


def random_blocks(rng: np.random.Generator, t: T, nbytes: int) -> np.ndarray:
    """nbytes of random t blocks whose f16 scales are finite and small (|d| < 2^-6: values
    of order one for every K-quant), for types ggraph cannot quantize to."""
    b = rng.integers(0, 256, (nbytes // t.type_size, t.type_size), dtype=np.uint8)
    for at in t.traits.scale_fields:
        d = (rng.uniform(-1.0, 1.0, b.shape[0]) / 64).astype("<f2")
        b[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


class CaseBuilder:
    """Makes a case's leafs: values uniform in [-1, 1], converted to each leaf's type."""

    def __init__(self, seed: int) -> None:
        self.ctx = Context("conformance")
        self.rng = np.random.default_rng(seed)

    def inp(self, type: T, *ne: int, name: str = "", lo: float = -1.0, hi: float = 1.0
            ) -> Tensor:
        """A leaf of `type`, uniform in [lo, hi] (an op defined on part of the line, log or
        sqrt, asks for positive values); a quantized type's rows are widened to whole
        blocks."""
        t = self.ctx.new_tensor(type, (fit_row(type, ne[0]),) + tuple(ne[1:]), name=name)
        if type.is_quantized and type.traits.quantize is None:
            t.data = random_blocks(self.rng, type, t.nbytes)
            return t
        return t.set_data(self.rng.uniform(lo, hi, t.shape))

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


def case(op: OpKind, build: Callable, tol: float = TOL_DEFAULT, perf: bool = False,
         flops: Callable | None = None, **vars: Any) -> Case:
    """A Case of op: `build(builder)` makes its graph; `vars` name it in reports."""
    return Case(op, tuple(vars.items()), build, tol, perf, flops)


def any_values(B: CaseBuilder, t: T, *ne: int) -> Tensor:
    """A leaf of type t: valid index values for integer types, uniform values otherwise."""
    return B.idx(t, 1000, *ne) if t.is_int else B.inp(t, *ne)


# the weight, KV and stored types the matrix, attention and set_rows/cpy cases run over:
# every type whose record (ggraph/ir/types.py) has that role
WEIGHTS = weight_types()
KV = kv_types()
STORED = storable_types()
QUANT_STORED = tuple(t for t in STORED if t.is_quantized)
