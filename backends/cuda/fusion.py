"""CUDA's fusion pass: groups of consecutive nodes of a planned graph that run as one launch,
so that a decode step makes fewer launches (each costs numba's dispatch on the host, 15-35 us,
more than most of a small model's kernels take on the GPU). Two groups:

- the norm chain (backends/fusion_rules.py) without its leading residual add:
  n = rms_norm(x) | norm(x) -> [m = n * w1] -> [d = m + w2], one k_norm launch;
- a mat-vec and the residual add after it: d = mul_mat(a, b) + c (after the attention output
  and the FFN down projections of every layer), one k_mul_mat_vec launch that adds c as it
  stores;
- the FFN's gate and up mat-vecs, one k_mul_mat_vec launch reading x once for both weights,
  with their GLU d = swiglu(gate, up) too when d's memory is not x's (the plan may give the
  GLU the memory x leaves free, which other warps would still be reading).

The IR is untouched, as on the CPU (backends/cpu/fusion.py): a group's intermediate is left
unwritten only when the liveness rule says nobody reads it afterwards (an observer of an
observed run included: backends/observe.py; a product it reads then keeps its own launch).
A group is refused when memory it writes overlaps memory it reads, other than the exact alias
each kernel handles (one thread reads an element, then writes the same element).

GGRAPH_FUSE=0 turns the pass off, as on the CPU.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph import config
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ..fusion_rules import PRE_OPS, Group, dead, match, scan
from ..shared.elementwise import BINARY_CODE
from ..shared.kernel_args import norm_args
from . import runtime as R
from .kernels import MV_MAX_N, mat_vec, norm_chain
from .templates_mm import MV_PAIR

ENABLED = config.fuse()


def fuse(order: Sequence[Tensor], session: Any, observed: frozenset[Tensor] = frozenset()
         ) -> dict[Tensor, Group]:
    """Groups of `order` (a planned graph's nodes) keyed by their first node; `observed`:
    nodes an observer reads after their group."""
    if not ENABLED:
        return {}

    def norm(seq: list[Tensor], i: int, rb: dict[Tensor, set[Tensor]]) -> Group | None:
        chain = match(seq, i)
        # a chain led by the residual add: the add stays a launch of its own, and its norm
        # matches at the next node
        return _bind_norm(chain, session, rb, observed) \
            if chain and chain[0].op not in PRE_OPS else None

    return scan(order, [
        norm,
        lambda seq, i, rb: _bind_mat_vec_add(c, session, rb, observed)
        if (c := _match_mat_vec_add(seq, i)) else None,
        lambda seq, i, rb: _bind_glu(c, session, rb, observed)
        if (c := _match_glu(seq, i)) else None])


# -- memory overlap, on the device's buffers ----------------------------------------------------

def _span(s: Any, t: Tensor) -> tuple[Any, int, int]:
    buf, off = s.storage(t)
    return buf, off, off + t.nbytes


def _alias(s: Any, x: Tensor, y: Tensor) -> bool:
    """x and y are the same elements of the same memory (same start, shape and strides)."""
    return s.storage(x) == s.storage(y) and x.ne == y.ne and x.nb == y.nb and x.type == y.type


def _overlap_safe(s: Any, reads: list[Tensor], writes: list[Tensor]) -> bool:
    """No written tensor overlaps another, and each overlaps a read one only as its alias."""
    for k, w in enumerate(writes):
        wb, lo, hi = _span(s, w)
        for v in writes[k + 1:]:
            vb, vlo, vhi = _span(s, v)
            if vb is wb and lo < vhi and vlo < hi:
                return False
        for r in reads:
            rb, rlo, rhi = _span(s, r)
            if rb is wb and lo < rhi and rlo < hi and not _alias(s, r, w):
                return False
    return True


# -- the norm chain -----------------------------------------------------------------------------

def _bind_norm(chain: list[Tensor], s: Any, read_by: dict[Tensor, set[Tensor]],
               observed: frozenset[Tensor]) -> Group | None:
    norm, posts, last = chain[0], chain[1:], chain[-1]
    members = set(chain)
    write = {t: t is not last and not dead(t, members, read_by, s.plan, observed)
             for t in chain}
    ws = [p.src[1] for p in posts]
    writes = [t for t in chain if write[t] or t is last]
    if not _overlap_safe(s, [norm.src[0], *ws], writes):
        return None
    dummy = R.dummy(np.float32)
    D = s.arr(last)

    def out(t: Tensor | None) -> Any:
        return s.arr(t) if t is not None and write[t] else D

    eps, rms = norm_args(norm)
    call = norm_chain(norm, s.arr(norm.src[0]), s.arr(ws[0]),
                      s.arr(ws[1]) if len(ws) > 1 else dummy, D, out(norm),
                      out(posts[0]) if len(posts) > 1 else D, np.float32(eps), rms,
                      BINARY_CODE[posts[0].op], BINARY_CODE[posts[1].op] if len(posts) > 1 else -1,
                      write[norm], len(posts) > 1 and write[posts[0]])
    return Group(tuple(chain), call) if call is not None else None


# -- mat-vec + residual add -----------------------------------------------------------------------

def _match_mat_vec_add(seq: list[Tensor], i: int) -> list[Tensor]:
    """[mul_mat(a, b), add(mm, c) | add(c, mm)]: the product on the mat-vec path (few
    columns), the add float32 of the product's own shape (no broadcast)."""
    mm = seq[i]
    if mm.op != OpKind.MUL_MAT or mm.ne[1] > MV_MAX_N or i + 1 >= len(seq):
        return []
    add = seq[i + 1]
    if add.op != OpKind.ADD or mm not in add.src:
        return []
    c = add.src[1] if add.src[0] is mm else add.src[0]
    if c is mm or any(t.type != T.F32 or t.ne != mm.ne for t in (mm, add, c)):
        return []
    return [mm, add]


def _bind_mat_vec_add(chain: list[Tensor], s: Any, read_by: dict[Tensor, set[Tensor]],
                      observed: frozenset[Tensor]) -> Group | None:
    mm, add = chain
    if not dead(mm, set(chain), read_by, s.plan, observed):
        return None  # someone reads the product itself
    c = add.src[1] if add.src[0] is mm else add.src[0]
    a, b = mm.src
    # the sum may be written over c (each output element read, then written, by one lane),
    # never over the product's sources, which other warps are still reading
    if not _overlap_safe(s, [a, b], [add]) or not _overlap_safe(s, [c], [add]):
        return None
    A = s.arr(a)
    call = mat_vec(mm, A, A, s.arr(b), s.arr(c), s.arr(add), BINARY_CODE[OpKind.ADD])
    return Group(tuple(chain), call) if call is not None else None


# -- gate and up mat-vecs + swiglu ------------------------------------------------------------------

def _match_glu(seq: list[Tensor], i: int) -> list[Tensor]:
    """[gate = mul_mat(g, x), up = mul_mat(u, x), swiglu(gate, up)]: g and u of one type and
    layout (the kernel reads both through one compiled decoder), on the mat-vec path."""
    if i + 2 >= len(seq):
        return []
    gate, up, glu = seq[i:i + 3]
    if gate.op != OpKind.MUL_MAT or up.op != OpKind.MUL_MAT or glu.op != OpKind.SWIGLU:
        return []
    g, x = gate.src
    u, y = up.src
    if glu.src[0] is not gate or glu.src[1] is not up or x is not y:
        return []
    if gate.ne[1] > MV_MAX_N or g.type != u.type or g.ne != u.ne or g.nb != u.nb:
        return []
    if any(t.type != T.F32 or t.ne != gate.ne for t in (gate, up, glu)):
        return []
    return [gate, up, glu]


def _bind_glu(chain: list[Tensor], s: Any, read_by: dict[Tensor, set[Tensor]],
              observed: frozenset[Tensor]) -> Group | None:
    gate, up, glu = chain
    (g, x), u = gate.src, up.src[0]
    A, A2, X = s.arr(g), s.arr(u), s.arr(x)
    if all(dead(t, set(chain), read_by, s.plan, observed) for t in (gate, up)) \
            and _overlap_safe(s, [g, u, x], [glu]):
        D = s.arr(glu)
        call = mat_vec(gate, A, A2, X, D, D, BINARY_CODE[OpKind.SWIGLU])
        return Group(tuple(chain), call) if call is not None else None
    # the two products alone: each was planned while x was live, so neither overlaps it
    if not _overlap_safe(s, [g, u, x], [gate, up]):
        return None
    call = mat_vec(gate, A, A2, X, s.arr(up), s.arr(gate), MV_PAIR)
    return Group((gate, up), call) if call is not None else None
