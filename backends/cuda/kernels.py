"""The CUDA kernel table: one entry per OpKind with the CPU table's `accepts` rules, each a
binder that takes the node's device arrays from the Session once, picks the launch geometry and
returns the launch of a template (templates.py, templates_mm.py, templates_attn.py) compiled for
the node's types; a session replays the bound launches when the same graph runs again (decode
steps; replay.py). fusion.py binds groups of nodes through `norm_chain` and `mat_vec`.

Per-type device helpers (launch.py's `helpers`) are built once per type from the shared codecs compiled
for CUDA: element load/store, chunk decode/encode/dot (a chunk is CH elements of a row: one
quant block), and whole-row dot. A kernel template gets them bound per role (a, b, d, k, v, m).

Refusals beyond the CPU's rules, all from fixed-size shared memory: flash attention with K
heads above FA_DMAX or V heads above FA_DV_MAX, argsort/top_k of rows above SORT_MAX.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ..accepts import BINARY_OPS, UNARY_OPS, VIEW_OPS, rule
from ..base import Kernel, Session
from ..shared.kernel_args import (argsort_args, binary_args, flash_attn_args, norm_args,
                                  raw_copy, rope_args, soft_max_args, unary_args)
from . import runtime as R
from . import templates as K
from . import templates_attn as KA
from . import templates_mm as KM
from . import tc_gemm

from .launch import Launch, compiled, elementwise_launch, n_rows, per_row_launch

_compiled, _ew, _per_row, _rows = compiled, elementwise_launch, per_row_launch, n_rows
# the PTX-only mode compiles every path a node may take on a GPU (the gate); counting the
# launches a GPU would make (benchmarks/cuda_launches.py) turns that off
PTX_ALL_PATHS = True
MV_MAX_N = KM.MV_NMAX  # columns of b up to which mul_mat runs the mat-vec kernel

def _k(fn: Callable[[Tensor, Session], Launch],
       accepts: Callable[[Tensor], bool] = lambda n: True, why_not: str = "") -> Kernel:
    """A table entry in bind mode: fn(node, session) returns the node's launch with its device
    arrays bound (None when there is nothing to run); a session replays it on later runs."""
    return Kernel(fn, accepts, why_not, bind=True)


# -- element-wise ---------------------------------------------------------------------------
# (the numbers after the arrays: backends/shared/kernel_args.py, the same for the CPU)

def _unary(node: Tensor, s: Session) -> Launch:
    a = node.src[0]
    return _ew(_compiled(K.k_unary, a=a.type, d=node.type), node.nelements, s.arr(a),
               s.arr(node), *unary_args(node))


def _binary(node: Tensor, s: Session) -> Launch:
    a, b = node.src
    return _ew(_compiled(K.k_binary, a=a.type, b=b.type, d=node.type), node.nelements,
               s.arr(a), s.arr(b), s.arr(node), *binary_args(node))


def _norm(node: Tensor, s: Session) -> Launch:
    a = node.src[0]
    eps, rms = norm_args(node)
    D, W = s.arr(node), R.dummy(np.float32)
    return norm_chain(node, s.arr(a), W, W, D, D, D, np.float32(eps), rms, -1, -1, False,
                      False)


def norm_chain(node: Tensor, *args: Any) -> Launch:
    """k_norm's launch for norm `node` and the arguments of the fused chain it may lead
    (templates.k_norm; backends/cuda/fusion.py)."""
    a = node.src[0]
    return _per_row(_compiled(K.k_norm, a=a.type, d=node.type), _rows(node), K.ROW_NT, *args)


# -- softmax, rope, attention ---------------------------------------------------------------

def _soft_max(node: Tensor, s: Session) -> Launch:
    a, mask, sinks = node.src
    k = _compiled(K.k_soft_max, a=a.type, m=mask.type if mask is not None else T.F32,
                  d=node.type)
    return _per_row(k, _rows(node), K.ROW_NT, s.arr(a),
                    s.arr(mask) if mask is not None else R.dummy(np.float32),
                    s.arr(sinks) if sinks is not None else R.dummy(np.float32), s.arr(node),
                    *_f32_floats(soft_max_args(node)), mask is not None, sinks is not None)


def _f32_floats(args: tuple) -> tuple:
    """Kernel arguments with Python floats as float32: a Python float is a float64 parameter,
    which drags the arithmetic it touches into float64."""
    return tuple(np.float32(x) if isinstance(x, float) else x for x in args)


def _rope(node: Tensor, s: Session) -> Launch:
    a, pos, ff = node.src
    n_dims = node.params.n_dims
    work = _rows(node) * (n_dims // 2 + node.ne[0] - n_dims)
    return _ew(_compiled(K.k_rope, a=a.type, d=node.type), work, s.arr(a), s.arr(pos),
               s.arr(ff) if ff is not None else R.dummy(np.float32), s.arr(node),
               *_f32_floats(rope_args(node)), ff is not None)


def _flash_attn(node: Tensor, s: Session) -> Launch:
    """Flash attention (templates_attn.py): few query rows (decode) split the KV positions over
    blocks and a second kernel combines the chunks; many take FA_QT rows per block (fa_plan).
    The PTX gate's tiny shapes reach one of those paths; a GPU's may reach any, so the PTX-only
    mode compiles all of them for the node's types."""
    q, k, v, mask = node.src
    roles = dict(k=k.type, v=v.type, m=mask.type if mask is not None else T.F32)
    nt, rows, nkv = q.ne[1], _rows(q), k.ne[1]
    if rows == 0 or v.ne[0] == 0:
        return None
    d = s.arr(node)
    args = (s.arr(q), s.arr(k), s.arr(v),
            s.arr(mask) if mask is not None else R.dummy(np.float32), d)
    tail = (*_f32_floats(flash_attn_args(node)), mask is not None)

    def launch(qt: int, splits: int, chunk: int) -> Launch:
        if qt > 1:
            items = rows // nt * -(-nt // qt)
            return R.bound(_compiled(KA.k_flash_attn_tile, **roles), (R.blocks_for(items, 1), 1),
                           KA.FA_NT, *args, R.dummy(np.float32), *tail, chunk)
        kern = _compiled(KA.k_flash_attn_split, **roles)
        if splits == 1:
            return R.bound(kern, (R.blocks_for(rows, 1), 1), KA.FA_NT, *args,
                           R.dummy(np.float32), *tail, chunk)
        buf, part = KA.fa_scratch(rows, splits, v.ne[0])  # once per binding, kept by the launch
        run = R.bound(kern, (R.blocks_for(rows, 1), splits), KA.FA_NT, *args, part, *tail,
                      chunk)
        merge = R.bound(_compiled(KA.k_flash_attn_combine), R.blocks_for(rows, 1), KA.FA_NT,
                        part, d)

        def both(buf: Any = buf) -> None:  # both on the binding's stream, in order
            run()
            merge()
        return both

    if R.MODE == "ptx" and PTX_ALL_PATHS:
        every = [launch(KA.FA_QT, 1, nkv), launch(1, 1, nkv), launch(1, 2, KA.FA_NT)]

        def compile_all() -> None:
            for f in every:
                f()
        return compile_all
    return launch(*KA.fa_plan(rows, nt, nkv))


def _fa_fits(n: Tensor) -> bool:
    q, k, v, _ = n.src
    return q.ne[0] <= KA.FA_DMAX and v.ne[0] <= KA.FA_DV_MAX


# -- matrix products ------------------------------------------------------------------------

def _grid_z(node: Tensor, z: int) -> int:
    if z > 65535:
        raise ValueError(f"mul_mat {node.describe()}: {z} batch slices exceed CUDA's grid "
                         f"limit of 65535")
    return z


def _mul_mat(node: Tensor, s: Session) -> Launch:
    a, b = node.src
    A, B, D = s.arr(a), s.arr(b), s.arr(node)
    m, n = node.ne[0], node.ne[1]
    z = node.ne[2] * node.ne[3]
    if n <= MV_MAX_N:
        return mat_vec(node, A, A, B, D, D, -1)
    if tc_gemm.torch_cuda() is not None and tc_gemm.accepts(a, b, node):
        return tc_gemm.bind(node, s, lambda A_, W16: _ew(
            _compiled(K.k_copy_chunks, a=a.type, d=T.F16), a.nelements // K.CH, A_, W16,
            a.ne[0], a.ne[0]))
    return R.bound(_compiled(KM.k_mul_mat_tiled, a=a.type, b=b.type),
                   (-(-m // KM.MM_TM), -(-n // KM.MM_TN), _grid_z(node, z)), KM.MM_NT, A, B, D)


def mat_vec(mm: Tensor, A: Any, A2: Any, B: Any, C: Any, D: Any, op: int) -> Launch:
    """The mat-vec launch of mul_mat node `mm` (arrays A, B of its sources), with the fused
    node after it by `op` (-1, B_ADD with C, B_SWIGLU or MV_PAIR with A2 of a's type;
    templates_mm.k_mul_mat_vec), one item per group of MV_WARPS rows of each batch slice."""
    a, b = mm.src
    items = -(-mm.ne[0] // KM.MV_WARPS) * mm.ne[2] * mm.ne[3]
    return R.bound(_compiled(KM.k_mul_mat_vec, a=a.type, b=b.type), R.blocks_for(items, 1),
                   KM.MV_NT, A, A2, B, C, D, op)


def _mul_mat_id(node: Tensor, s: Session) -> Launch:
    as_, b, ids = node.src
    work = -(-node.ne[0] // KM.MV_WARPS) * node.ne[1] * node.ne[2]
    return R.bound(_compiled(KM.k_mul_mat_id, a=as_.type, b=b.type), R.blocks_for(work, 1),
                   KM.MV_NT, s.arr(as_), s.arr(b), s.arr(ids), s.arr(node))


# -- rows, copies, layout --------------------------------------------------------------------

def _chunks(t: Tensor) -> int:
    return _rows(t) * -(-t.ne[0] // K.CH)


def _get_rows(node: Tensor, s: Session) -> Launch:
    a, idx = node.src
    if a.type == T.I32:
        return _ew(K.k_get_rows_raw, node.nelements, s.arr(a), s.arr(idx), s.arr(node))
    return _ew(_compiled(K.k_get_rows, a=a.type), _chunks(node), s.arr(a), s.arr(idx),
               s.arr(node))


def _set_rows(node: Tensor, s: Session) -> Launch:
    dst, src, idx = node.src
    return _ew(_compiled(K.k_set_rows, a=src.type, d=dst.type), _chunks(src), s.arr(src),
               s.arr(idx), s.arr(node))


def _copy_into(a: Tensor, d: Tensor, s: Session) -> Launch:
    """a's elements, in ggml order, into d: raw copies for equal types (and int widths)."""
    A, D = s.arr(a), s.arr(d)
    if raw_copy(a, d) or (a.type.is_int and d.type.is_int):
        return _ew(K.k_copy_raw, int(np.prod(A.shape)), A, D)
    if a.type.is_quantized or d.type.is_quantized:
        return _ew(_compiled(K.k_copy_chunks, a=a.type, d=d.type), a.nelements // K.CH, A, D,
                   a.ne[0], d.ne[0])
    return _ew(_compiled(K.k_copy_elem, a=a.type, d=d.type), a.nelements, A, D)


def _cpy(node: Tensor, s: Session) -> Launch:
    return _copy_into(node.src[0], node, s)


def _cont(node: Tensor, s: Session) -> Launch:
    return _copy_into(node.src[0], node, s)


def _concat(node: Tensor, s: Session) -> Launch:
    a, b = node.src
    D = s.arr(node)
    return _ew(K.k_concat, int(np.prod(D.shape)), s.arr(a), s.arr(b), D, 3 - node.params.dim)


def _repeat(node: Tensor, s: Session) -> Launch:
    D = s.arr(node)
    return _ew(K.k_repeat, int(np.prod(D.shape)), s.arr(node.src[0]), D)


def _sum_rows(node: Tensor, s: Session) -> Launch:
    a = node.src[0]
    return _per_row(_compiled(K.k_sum_rows, a=a.type), _rows(a), K.ROW_NT, s.arr(a),
                    s.arr(node), a.ne[0])


def _argsort(node: Tensor, s: Session) -> Launch:
    a = node.src[0]
    return _per_row(_compiled(K.k_argsort, a=a.type), _rows(a), K.SORT_NT, s.arr(a),
                    s.arr(node), a.ne[0], *argsort_args(node))


def _view(node: Tensor, s: Session) -> Launch:
    """Views compute nothing: their memory is their source's."""
    return None


_SORT_WHY = f"rows longer than {K.SORT_MAX} elements (the sort runs in shared memory)"
_FA_WHY = (f"K heads above {KA.FA_DMAX} or V heads above {KA.FA_DV_MAX} elements (q rows and "
           f"per-thread output chunks live in shared memory), or types the CPU refuses")

KERNELS: dict[OpKind, Kernel] = {
    **{op: _k(_view, *rule(op)) for op in VIEW_OPS},
    **{op: _k(_unary, *rule(op)) for op in UNARY_OPS},
    **{op: _k(_binary, *rule(op)) for op in BINARY_OPS},
    **{op: _k(fn, *rule(op)) for op, fn in (
        (OpKind.RMS_NORM, _norm), (OpKind.NORM, _norm), (OpKind.SOFT_MAX, _soft_max),
        (OpKind.ROPE, _rope), (OpKind.MUL_MAT, _mul_mat), (OpKind.MUL_MAT_ID, _mul_mat_id),
        (OpKind.GET_ROWS, _get_rows), (OpKind.SET_ROWS, _set_rows), (OpKind.CPY, _cpy),
        (OpKind.CONT, _cont), (OpKind.CONCAT, _concat), (OpKind.REPEAT, _repeat),
        (OpKind.SUM_ROWS, _sum_rows))},
    # CUDA's own limits on top of the shared type rules: shared-memory sizes
    OpKind.FLASH_ATTN_EXT: _k(_flash_attn, *rule(OpKind.FLASH_ATTN_EXT, _fa_fits, _FA_WHY)),
    **{op: _k(_argsort, *rule(op, lambda n: n.src[0].ne[0] <= K.SORT_MAX, _SORT_WHY))
       for op in (OpKind.ARGSORT, OpKind.TOP_K)},
}

# the training ops' kernels (they bind with backends/cuda/launch.py, as this module does)
from . import backward_rows, reductions, training  # noqa: E402

KERNELS.update({op: _k(fn, *rule(op)) for m in (reductions, backward_rows, training)
                for op, fn in m.BINDERS.items()})
