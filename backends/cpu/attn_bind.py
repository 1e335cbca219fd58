"""How a flash_attn_ext node binds on the CPU (the kernel table's entry, backends/cpu/kernels.py):
a decode step's per-row kernel over an F16 cache (attn_decode.py), a prompt's blockwise path
(attention.py) from BLOCK_MIN_QUERIES queries, the generic template otherwise; and
`flat_rows`, the one-dimensional span of a cache view's rows that the per-row kernels (this
one and the F16 mat-vec over the cache) index by their strides.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from ggraph.ops.attention import alibi_slopes
from ..base import Session
from ..shared.kernel_args import flash_attn_args
from . import attn_decode, qmem
from .team import Part, TeamForm
from . import templates as K
from .attention import (BlockMath, SharedMask, decode_heads, flash_attn_blocks, k_round_half,
                        k_soft_max_rows)
from .compile import (EXPF, KERNEL_ORDERED, SERIAL_ORDERED, TARGET, compiled,
                      compiled_nogil, is_small)

BLOCK_MIN_QUERIES = 8  # from this many queries the BLAS blockwise path wins
_DUMMY = np.zeros((1, 1, 1, 1), np.float32)


# a decode step's flash attention: cells per unit, V rows per block, K/V rows prefetched ahead
# (attn_decode.py; 4-32 ahead all took a 64 MiB cache at 2 threads from 14.5 to 6.2-6.9 ms)
DECODE_CELLS = 256
DECODE_VB = 8
DECODE_PREFETCH = 8
DECODE_SUM_LANES = 16   # a softmax sum's lanes (attn_decode.py): one AVX-512 vector


def flash_attn(node: Tensor, s: Session):
    q, k, v, mask = node.src
    args = flash_attn_args(node)
    rows = _flash_attn_rows(node, s, args)
    if q.ne[1] >= BLOCK_MIN_QUERIES:
        return _flash_attn_blocks(node, s, rows, *args)
    if rows is not None:
        return rows
    mt = mask.type if mask is not None else T.F32
    kern = compiled(K.k_flash_attn, is_small(node), k=k.type, v=v.type, m=mt)
    return partial(kern, s.arr(q), s.arr(k), s.arr(v), s.arr(mask) if mask is not None else _DUMMY,
                   s.arr(node).reshape(node.shape), *args, mask is not None)


def decode_attention_kernel(serial: bool, mask_type: T, dk: int, dv: int) -> Any:
    """attn_decode.k_flash_attn_decode for K/V heads of dk and dv, on one thread or many. It
    compiles without reassociation (compile.KERNEL_ORDERED) and sums in fixed lanes, so both
    variants, freshly compiled or loaded from numba's cache, give the same bits: a token's
    logits must not depend on which one a batch's size picks, nor on the first run."""
    names, tag = _decode_names(mask_type, dk, dv)
    return TARGET.bind(attn_decode.k_flash_attn_decode,
                       SERIAL_ORDERED if serial else KERNEL_ORDERED,
                       f"{tag}{'_serial' if serial else ''}", **names)


def decode_attention_team(mask_type: T, dk: int, dv: int) -> Any:
    """attn_decode.k_attn_team: the decode attention as a team makes it (backends/cpu/team.py),
    serial and as ordered as the kernel: the same bits."""
    names, tag = _decode_names(mask_type, dk, dv)
    return TARGET.bind(attn_decode.k_attn_team, SERIAL_ORDERED, tag, **names)


def _decode_names(mask_type: T, dk: int, dv: int) -> tuple[dict, str]:
    qmem.load_threads()   # the kernel's cached code reads the layer's thread count
    tag = f"m{mask_type}_pf{qmem.PF_LOCALITY}"
    names = dict(dec_m=TARGET.codec(mask_type).dec, expf=EXPF, CELLS=DECODE_CELLS,
                 VB=DECODE_VB, PFC=DECODE_PREFETCH, SL=DECODE_SUM_LANES, DK=dk, DV=dv)
    # the units and the output rows as functions of their own, compiled once (and cached) for
    # the kernel's threads and a team's alike
    return {**names, "attn_unit": TARGET.bind(attn_decode.unit_template, SERIAL_ORDERED, tag,
                                              **names),
            "attn_combine": TARGET.bind(attn_decode.combine_template, SERIAL_ORDERED, tag,
                                        **names)}, tag


def _attention_team(mask_type: T, args: tuple) -> TeamForm:
    """The decode attention call on `args` (k_flash_attn_decode's) as a team makes it: the
    mask's rows, the units and (over several runs of cells) the output rows, with the work
    memory the kernel would allocate made once for the run."""
    q, d, m = args[0], args[13], args[12]
    hkv, nkv, has_mask = args[10], args[11], args[19]
    kernel = decode_attention_team(mask_type, q.shape[3], d.shape[3])

    def parts(threads: int) -> list[Part]:
        ns, nh, nt = q.shape[:3]
        nr, runs = nh // hkv * nt, -(-nkv // DECODE_CELLS)
        m3, m2 = (m.shape[0], m.shape[1]) if has_mask else (1, 1)
        mf = np.empty((m3, m2, nt, nkv if has_mask else 1), np.float32)
        work = args + (mf,) + tuple(np.empty((ns * hkv * runs, nr) + extra, np.float32)
                                    for extra in ((), (), (d.shape[3],)))
        return [Part(kernel, work + (0, 0, 1)), Part(kernel, work + (1,), True)] + (
            [Part(kernel, work + (2,), True)] if runs > 1 else [])

    return TeamForm(parts, kernel)


def _flash_attn_rows(node: Tensor, s: Session, args: tuple):
    """The per-row kernel over an F16 cache (attn_decode.py: a decode step, or queries of
    several sequences that each see their own cells); None for other K/V types or layouts."""
    q, k, v, mask = node.src
    K_, V_ = s.arr(k), s.arr(v)
    if not (k.type == v.type == T.F16 and (fk := flat_rows(K_)) is not None and (
            fv := flat_rows(V_)) is not None):
        return None
    kern = decode_attention_kernel(is_small(node), mask.type if mask is not None else T.F32,
                                   q.ne[0], v.ne[0])
    call = partial(kern, s.arr(q), fk[0], *fk[1], fv[0], *fv[1], *K_.shape[:3],
                   s.arr(mask) if mask is not None else _DUMMY,
                   s.arr(node).reshape(node.shape), *args, mask is not None)
    call.team = _attention_team(mask.type if mask is not None else T.F32, call.args)
    return call


def _flash_attn_blocks(node: Tensor, s: Session, rows, scale, max_bias, softcap, h0, n_head):
    """A prompt's flash attention by query blocks (backends/cpu/attention.py): K and V decoded
    to float32 each run, the mask's visible ranges computed by the first layer of a run. A
    run whose blocks see little of their ranges (several sequences' tokens, SharedMask.sparse)
    takes the per-row kernel `rows` instead, where there is one."""
    q, k, v, mask = node.src
    Kr, Vr, Q, D = s.arr(k), s.arr(v), s.arr(q), s.arr(node).reshape(node.shape)
    shared = first = None
    Mr = s.arr(mask) if mask is not None else None
    if mask is not None:  # the layers share their mask: the first node of a run reads it
        key = ("attn mask", mask, q.ne[1], k.ne[1])
        first = key not in s.bind_memo
        shared = s.bind_memo.setdefault(key, SharedMask())
    math = BlockMath(np.float32(scale), softcap, alibi_slopes(q.ne[2], max_bias, h0, n_head)
                     .astype(np.float32), k.type == T.F16, v.type == T.F16,
                     compiled_nogil(k_round_half), compiled_nogil(k_soft_max_rows))
    dk, dv = TARGET.codec(k.type).dec, TARGET.codec(v.type).dec

    def call() -> None:
        if first:
            shared.update(Mr, mask, Q.shape[2], Kr.shape[2])
        if rows is not None and shared is not None and shared.sparse:
            rows()
        else:
            flash_attn_blocks(Q, decode_heads(Kr, k, dk), decode_heads(Vr, v, dv), shared, D,
                              math)
    return call


def flat_rows(A: np.ndarray):
    """(the 1-D contiguous array of the memory from A's first element to its last, A's
    (i3, i2, i1) strides in elements) for a 4-D view whose rows are contiguous; else None."""
    it = A.itemsize
    if A.size == 0 or (A.shape[3] > 1 and A.strides[3] != it) or any(
            st < 0 or st % it for st in A.strides[:3]):
        return None
    st = [x // it for x in A.strides[:3]]
    span = A.shape[3] + sum((n - 1) * x for n, x in zip(A.shape[:3], st))
    return np.lib.stride_tricks.as_strided(A, shape=(span,), strides=(it,)), tuple(st)
