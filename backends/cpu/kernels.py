"""The CPU kernel table: one entry per OpKind, each a binder that takes the node's arrays
from the Session once and returns a call of a template compiled for the node's types (so a
graph that runs again, a decode step, pays only the numba dispatch per node).

Matrix products pick a path by shape: float32 batches go to BLAS through numpy (the same
library numpy's matmul uses), quantized/F16/BF16 weights with a batch of >= BLAS_MIN_N
columns are dequantized in row chunks and multiplied by BLAS, and mat-vec products run the
numba dot kernels that read quantized blocks directly (memory-bound, no dequantized copy).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph import config
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import TYPE_RECORDS
from ggraph.ir.types import GGMLType as T
from ..accepts import BINARY_OPS, UNARY_OPS, VIEW_OPS, rule
from ..base import Kernel, Session
from ..shared.kernel_args import (argsort_args, binary_args, norm_args, raw_copy, rope_args,
                                  soft_max_args, unary_args)
from . import fastmath
from .attn_bind import flash_attn, flat_rows
from .blas import mul_mat_blas
from .team import Part, TeamForm
from . import templates as K

from .compile import (INLINE_FAST as _INLINE_FAST, KERNEL as _KERNEL,
                      KERNEL_FAST as _KERNEL_FAST, PARALLEL_MIN_WORK, ROUND_HALF as _ROUND_HALF,
                      SERIAL as _SERIAL, SERIAL_FAST as _SERIAL_FAST, TARGET,
                      compiled, in_turn, index_checked, is_small, row_decoder)

_compiled = compiled
_small = is_small
# GGRAPH_EXACT_ACTIVATIONS=1 multiplies by the float32 activations (closer to the reference,
# further from llama.cpp)
ROUND_ACTIVATIONS = not config.exact_activations()
BLAS_MIN_N = 16  # columns of b from which dequantize + BLAS beats the dot kernels


# -- element-wise ---------------------------------------------------------------------------
# (the numbers after the arrays: backends/shared/kernel_args.py, the same for CUDA)

def _unary(node: Tensor, s: Session):
    a = node.src[0]
    return partial(_compiled(K.k_unary, _small(node), a=a.type, d=node.type), s.arr(a),
                   s.arr(node), *unary_args(node))


def _binary(node: Tensor, s: Session) -> None:
    a, b = node.src
    return partial(_compiled(K.k_binary, _small(node), a=a.type, b=b.type, d=node.type),
                   s.arr(a), s.arr(b), s.arr(node), *binary_args(node))


def _norm(node: Tensor, s: Session) -> None:
    a = node.src[0]
    return partial(_compiled(K.k_norm, _small(node), a=a.type, d=node.type), s.arr(a),
                   s.arr(node), *norm_args(node))


# -- softmax, rope, attention -----------------------------------------------------------------

_DUMMY = np.zeros((1, 1, 1, 1), np.float32)


def _soft_max(node: Tensor, s: Session) -> None:
    a, mask, sinks = node.src
    mt = mask.type if mask is not None else T.F32
    k = _compiled(K.k_soft_max, _small(node), True, a=a.type, m=mt, d=node.type)
    return partial(k, s.arr(a), s.arr(mask) if mask is not None else _DUMMY,
                   s.arr(sinks).reshape(1, 1, 1, -1) if sinks is not None else _DUMMY,
                   s.arr(node), *soft_max_args(node), mask is not None, sinks is not None)


def _rope(node: Tensor, s: Session) -> None:
    a, pos, ff = node.src
    n_dims, neox, *angles = rope_args(node)
    k = _compiled(K.k_rope, _small(node), a=a.type, d=node.type)
    key = ("rope", pos, ff, n_dims, *angles)  # the nodes sharing one angle table
    if (table := s.bind_memo.get(key)) is not None:
        return partial(k, s.arr(a), *table, s.arr(node), n_dims, neox)
    table = s.bind_memo[key] = (np.empty((pos.ne[0], n_dims // 2)),
                                np.empty((pos.ne[0], n_dims // 2)))
    kt = TARGET.bind(K.k_rope_table, _SERIAL if _small(node) else _KERNEL,
                     "serial" if _small(node) else "")
    return partial(in_turn, partial(kt, s.arr(pos), s.arr(ff).reshape(1, 1, 1, -1)
                                    if ff is not None else _DUMMY, *table, n_dims, *angles,
                                    ff is not None),
                   [partial(k, s.arr(a), *table, s.arr(node), n_dims, neox)])


# -- matrix products ------------------------------------------------------------------------


# The type ggml's CPU dot products convert activations to before multiplying (vec_dot_type,
# from each weight type's record): matching it keeps ggraph's logits within 1e-3 NMSE of
# llama.cpp's instead of ~1e-2. F32 weights dot F32 activations: nothing to round.
VEC_DOT_TYPE = {t: r.vec_dot_type for t, r in TYPE_RECORDS.items()
                if r.weight and r.vec_dot_type not in (None, T.F32)}

# Integer dot products (backends/shared/qdot.py): the activations stay quantized (int8 + scale
# per block) and each block is summed in integers, as ggml does. The CPU binds vector-IR block
# sums (qsimd.py) in place of the shared loops; this runs before any codec is compiled.
# At decode (a few columns) the types of qrows.ROW_DOTS take whole-row dots with vector
# accumulators instead (qrows.py, qvec.py): the same integer sums, at memory bandwidth.
from . import qact, qgemm, qlanes, qmem, qpack, qrows, qsimd, qtiles  # noqa: E402  (kept with the section that uses them)
from .qpack import PACKS  # noqa: E402
from .qtiles import TILES  # noqa: E402
from .qgemm import GEMMS  # noqa: E402
from .qrows import ROW_DOTS  # noqa: E402

TARGET.replace_helpers(dict(qsimd.OVERRIDES, **({"_f16_round": TARGET.device(
    fastmath.round_half_f16c)} if fastmath.F16C else {})), "simd")


def act_encoder(vt: T) -> Any:
    """The encoder that quantizes a product's activations to vec_dot_type vt: the CPU's
    vectorized one where there is one (qact.py: the same bytes), else the shared codec's."""
    fn = qact.ENCODERS.get(vt)
    return TARGET.codec(vt).enc if fn is None else TARGET.bind(fn, TARGET.device, str(vt))


def _int_dot_type(a: Tensor, b: Tensor) -> T | None:
    """The type b's rows are encoded to for integer dot products with a (a's vec_dot_type);
    None where they do not apply (exact activations, a type without a qdot, a row that is not
    whole blocks)."""
    vt = VEC_DOT_TYPE.get(a.type) if ROUND_ACTIVATIONS else None
    if vt is None or not TYPE_RECORDS[a.type].qdot or b.ne[0] % vt.block_size:
        return None
    return vt


def _quantized_activations(a: Tensor, b: Tensor, B: np.ndarray, node: Tensor):
    """(b's rows encoded to `a`'s vec_dot_type as a uint8 array, the call that fills it) for
    the integer dot products; None where they do not apply (_int_dot_type)."""
    if (vt := _int_dot_type(a, b)) is None:
        return None
    Q = np.empty(B.shape[:3] + (vt.type_size * b.ne[0] // vt.block_size,), np.uint8)
    # a few columns (decode) quantize in less time than a fork-join of threads takes
    k = _compiled(K.k_quant_rows, b.nelements < PARALLEL_MIN_WORK, b=b.type, r=vt)
    return Q, partial(k, B, Q, b.ne[0])


def _qdot_kernel(template, serial: bool, a: T):
    return TARGET.bind(template, _SERIAL if serial else _KERNEL,
                       f"a{a}{'_serial' if serial else ''}",
                       qdot_a=TARGET.codec(a).qdot)




def _row_dot_kernel(serial: bool, a: T, b: T):
    """k_mul_mat_rows bound to `a`'s row dot (backends/cpu/qrows.py: its block function in
    rowdot, or its shared qdot where qrows has no block function) and to the codecs that
    quantize b's columns."""
    tag = f"a{a}_b{b}{'_serial' if serial else ''}"
    vt = VEC_DOT_TYPE[a]
    dev = TARGET.device_fast
    if a in ROW_DOTS:
        # inlined in numba's IR: the row loop holds the block's code, whatever LLVM's inliner
        # would decide for a function returning a vector in a tuple
        blk = TARGET.bind(ROW_DOTS[a].blk, _INLINE_FAST)
        rd = TARGET.bind(qrows.rowdot, dev, f"{a}", blk=blk)
    else:
        rd = TARGET.bind(qrows.rowdot_shared, dev, f"{a}",
                         qdot_a=TARGET.codec(a).qdot, BLOCK=TYPE_RECORDS[a].block_size)
    return TARGET.bind(K.k_mul_mat_rows, _SERIAL if serial else _KERNEL, tag, rowdot_a=rd,
                       dec_b=TARGET.codec(b).dec, enc_r=act_encoder(vt),
                       act_sums=TARGET.bind(qrows.act_sums, TARGET.device))


# the packed products ask for each weight line this many bytes before they read it, or for
# none (0), as measured per CPU (qmem.prefetch_choice): where a prefetch helps, 8-16 KiB
# ahead; closer, the line is not in yet, further, it leaves L1 before its turn
PREFETCH = qmem.PF_DISTANCE

# a packed product's threads take the runs of the others' shares once theirs are done
# (qtiles.k_mul_mat_packed), so a thread the host holds back delays one run, not its share
PACKED_STEAL = True
# and take the last PACKED_TAIL runs of each share in runs a quarter the size (0: none)
PACKED_TAIL = 2


def packed_weight(a: Tensor, b: Tensor, s: Session) -> np.ndarray | None:
    """The packed copy of weight `a` (backends/cpu/qpack.py) where the decode mat-vec can
    read it: a whole 2-D leaf of a packed type, with its own stored bytes (not a copy this
    Session wrote), times activations that take the integer dots."""
    packs = getattr(s.backend, "packs", None)
    vt = VEC_DOT_TYPE.get(a.type) if ROUND_ACTIVATIONS else None
    if (packs is None or vt is None or a.op is not None or a.view_src is not None
            or a.data is None or not qpack.packable(a.type, a.ne) or b.ne[0] % vt.block_size
            or s.storage(a)[0] is not a.data):
        return None
    return packs.get(a, a.data)


# a prompt's product works on this many bytes of a group's packed rows at a time (L1), and on
# columns whose quantized activations for them take this many bytes (L2): qtiles.py
PACKED_L1, PACKED_L2 = 24 << 10, 1 << 19
# blocks of a row summed apart before they join the row's sum (qtiles.k_mul_mat_packed)
PACKED_RUN = 16


# products one packed call computes at most (backends/cpu/fusion.py: gate and up; Q, K, V).
# Every call passes this many weights, the missing ones as empty repeats of the last: one
# compiled specialization serves a product alone and any fused group (a second one cost a
# cold first run ~14 s of compiling on a 2-core Xeon)
PACKED_MAX = 3
# the packed calls of one bound graph share their quantization buffers by shape
# (packed_work); benchmarks/ab_decode.py turns it off for one engine to measure it
SHARED_WORK = True


def packed_call(kernel: Any, a: T, B: np.ndarray, products: Sequence[tuple], r: int = qlanes.R,
                work: dict | None = None, team: Any = None) -> Callable[[], None]:
    """`kernel` (packed_kernel's, for groups of r rows) bound to products D = W B (+ bias)
    that read the same columns B, one to PACKED_MAX of them (backends/cpu/fusion.py), each
    (packed weight W of m rows of type a, D, m) or (W, D, m, bias: m float32 values added to
    every column's result, an add node folded in), and to the work buffers the columns are
    quantized into once for all of them (a's vec_dot_type bytes and their sums, per column).
    `work`: a dict the calls of one bound graph share (Session.bind_memo), where calls of the
    same shape find the same buffers (packed_work). `team`: packed_team's kernel, which
    makes the call as a team of threads does (backends/cpu/team.py), where B has up to 3
    columns (the call's `team` form).
    The kernel takes every array but B by address (qtiles.k_mul_mat_packed's `meta`); the
    call keeps them alive (`keep`, which compile.direct carries). A result whose memory is
    not one contiguous float32 block is computed into a buffer and copied there."""
    if not 1 <= len(products) <= PACKED_MAX:
        raise ValueError(f"packed_call: {len(products)} products; one call takes 1 to "
                         f"{PACKED_MAX}")
    for p in products:
        w = p[0]
        if w.dtype != np.uint8 or w.ndim != 1 or not w.flags.c_contiguous:
            raise ValueError(f"packed_call: a packed weight is one contiguous run of bytes, "
                             f"got {w.dtype} of shape {w.shape}")
    land = [(np.empty(p[1].shape, np.float32), p[1]) if not _flat_f32(p[1]) else None
            for p in products]
    products = [p if c is None else (p[0], c[0], *p[2:]) for p, c in zip(products, land)]
    vt, k = VEC_DOT_TYPE[a], B.shape[-1]
    work_bufs = packed_work(vt, k, products[0][1].shape[:3], work if SHARED_WORK else None)
    # each weight's row groups numbered after the ones before it; the padding has none
    groups = [-(-p[2] // r) for p in products]
    pad = PACKED_MAX - len(products)
    full = list(products) + [products[-1][:3]] * pad
    rows = [_bias_row(p[3], p[2]) if len(p) > 3 and p[3] is not None else None
            for p in products]
    # qtiles.k_mul_mat_packed's words (PACKED_MAX = 3): starts, rows, bias rows (0: none),
    # weights, their bytes, results, the work buffers, the columns' dimensions and the work
    # buffers' lengths a column
    meta = np.array(
        list(np.cumsum([0] + groups + [0] * pad)) + [p[2] for p in full]
        + [0 if row is None else row.ctypes.data for row in rows] + [0] * pad
        + [p[0].ctypes.data for p in full] + [p[0].nbytes for p in full]
        + [p[1].ctypes.data for p in full] + [x.ctypes.data for x in work_bufs]
        + list(products[0][1].shape[:3]) + [x.shape[3] for x in work_bufs], np.int64)
    if PACKED_MAX != 3 or meta.size != 30:
        raise AssertionError("qtiles.k_mul_mat_packed reads 30 words for 3 weights")
    call = partial(kernel, B, meta, k, k // TYPE_RECORDS[a].block_size)
    # compile.direct carries `keep`: every array the kernel reaches by its address
    call.keep = (tuple(p[0] for p in products) + tuple(p[1] for p in products) + work_bufs
                 + tuple(row for row in rows if row is not None))
    if team is not None and int(np.prod(products[0][1].shape[:3])) < 4:
        call.team = _packed_team_form(team, call.args)
    if not any(land):
        return call
    # each buffer copied to its result's memory after the call, as fusion.py lands a product
    # it computed into a buffer
    return partial(in_turn, call, [partial(np.copyto, d, buf) for buf, d in filter(None, land)])


def _packed_team_form(kernel: Any, args: tuple) -> TeamForm:
    """A packed call on `args` as a team makes it (qtiles.k_packed_team): the columns
    quantized and the share counters zeroed, then every thread's share (the counters made for
    the run's threads; the arrays the kernel reaches by address live as long as the bound
    call, which keeps them)."""
    def parts(threads: int) -> list[Part]:
        taken = np.zeros(8 * threads, np.int64)
        return [Part(kernel, args + (taken, -1, threads)), Part(kernel, args + (taken,), True)]

    return TeamForm(parts, kernel)


def _flat_f32(d: np.ndarray) -> bool:
    return d.dtype == np.float32 and d.ndim == 4 and d.flags.c_contiguous


def packed_work(vt: T, k: int, cols: tuple[int, ...], work: dict | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The buffers a packed call quantizes its columns into: cols columns of k values as
    vt's bytes, their 32-element sums as 2 bytes each (qtiles.aux_q8_k), their offset sums
    and float sums. The calls of one graph run one after the other, and each fills its
    buffers before it reads them, so calls of one shape can share them (`work`, their
    graph's shared dict): then a decode step's ~130 products write the same few cache lines,
    where each had its own and found them cold (the step's weight stream evicts them)."""
    key = ("packed work", vt, k, cols)
    if work is not None and key in work:
        return work[key]
    bufs = (np.empty(cols + (vt.type_size * k // vt.block_size,), np.uint8),
            np.empty(cols + (2 * (k // 32),), np.uint8), np.empty(cols + (k // 16,), np.int32),
            np.empty(cols + (k // 32,), np.float32))
    if work is not None:
        work[key] = bufs
    return bufs


def _bias_row(bias: np.ndarray, m: int) -> np.ndarray:
    """A product's bias as a 1-D float32 view of m contiguous values."""
    row = bias.reshape(-1)
    if row.dtype != np.float32 or row.shape != (m,) or not row.flags.c_contiguous:
        raise ValueError(f"packed_call: a bias must be {m} contiguous float32 values, got "
                         f"{row.dtype} of shape {bias.shape}")
    return row


def packed_kernel(serial: bool, a: T, b: T, r: int = qlanes.R, l1: int = PACKED_L1,
                  l2: int = PACKED_L2):
    """k_mul_mat_packed bound to `a`'s tile function (backends/cpu/qtiles.py) for groups of
    r rows, for one column, 2 and 4 at a time, with its activation sums and the codecs that
    quantize b's columns to a's vec_dot_type; l1 and l2 size its cache blocks."""
    names, tag = _packed_names(a, b, r, l1, l2)
    return TARGET.bind(qtiles.k_mul_mat_packed, _SERIAL_FAST if serial else _KERNEL_FAST,
                       f"a{a}_b{b}{'_serial' if serial else ''}_{l1}_{l2}_{tag}", **names)


def packed_team(a: T, b: T, r: int = qlanes.R, l1: int = PACKED_L1, l2: int = PACKED_L2):
    """qtiles.k_packed_team for packed_kernel's product of a few columns as a team makes it
    (backends/cpu/team.py); serial (a team run forks no threads inside its region)."""
    names, tag = _packed_names(a, b, r, l1, l2)
    return TARGET.bind(qtiles.k_packed_team, _SERIAL_FAST, f"a{a}_b{b}_{l1}_{l2}_{tag}",
                       **names)


# _packed_names' results by their key (the switches it reads are in the tag): each bound
# product asks twice (its kernel and its team's), ~130 a decode graph bound again each 256
# cells, and binding a dozen helpers again found them at ~85 us a time
_NAMES: dict[tuple, tuple[dict, str]] = {}


def _packed_names(a: T, b: T, r: int, l1: int, l2: int) -> tuple[dict, str]:
    """The names the packed product's templates are bound with, and their tag."""
    qmem.load_threads()   # the kernel's cached code reads the layer's thread count
    tag = (f"R{r}_{qlanes.flavor()}_pf{PREFETCH}_{qmem.PF_LOCALITY}"
           f"{'' if PACKED_STEAL else '_nosteal'}_tail{PACKED_TAIL}")
    key = (a, b, r, l1, l2, tag)
    if key not in _NAMES:
        _NAMES[key] = _bind_packed_names(a, b, r, l1, l2, tag), tag
    return _NAMES[key]


def _bind_packed_names(a: T, b: T, r: int, l1: int, l2: int, tag: str) -> dict:
    tile = TILES[a]
    dots = {}
    ahead = TARGET.bind(qtiles.ahead, _INLINE_FAST, tag, PF=PREFETCH)
    for c in (1, 2, 4):
        names: dict = {"R": r, "C": c, "PF": PREFETCH, "ahead": ahead, **tile.names}
        for h in tile.helpers:
            names[h.__name__] = TARGET.bind(h, _INLINE_FAST, f"C{c}_{tag}", **names)
        fn = TARGET.bind(tile.fn, _INLINE_FAST, f"{a}_C{c}_{tag}", **names)
        if c == 1:
            tile1 = fn   # the one-column loop of k_mul_mat_packed calls it directly
        dots[f"dots{c}"] = TARGET.bind(qtiles.column_dots, _INLINE_FAST, f"{a}_C{c}_{tag}", R=r,
                                       C=c, TILE=PACKS[a].tile(r), tile=fn)
    aux = TARGET.bind(tile.aux, TARGET.device, f"{a}", OFF=tile.off, SUB=tile.sub)
    quantize = TARGET.bind(qtiles.quantize_column, TARGET.device, f"a{a}_b{b}",
                           dec_b=TARGET.codec(b).dec, enc_r=act_encoder(VEC_DOT_TYPE[a]),
                           aux=aux)
    size = PACKS[a].tile(r)
    group = TARGET.bind(qtiles.row_group_dot, _INLINE_FAST, f"{a}_{tag}", R=r, TILE=size,
                        **dots)
    # a thread's runs as a function of its own, compiled once (and cached) for the kernel's
    # threads and a team's alike
    runs = TARGET.bind(qtiles.runs_template, _SERIAL_FAST, f"{a}_{tag}", R=r, TILE=size,
                       STEAL=PACKED_STEAL, TAIL=PACKED_TAIL, group_dot=group, tile1=tile1)
    return {"R": r, "TILE": size, "quantize_column": quantize, "ACT_BYTES": l2, "W_BYTES": l1,
            "KC": PACKED_RUN, "packed_runs": runs,
            "packed_views": TARGET.bind(qtiles.views_template, _INLINE_FAST, ""),
            "run_split": TARGET.bind(qtiles.split_template, _INLINE_FAST, f"{a}_{tag}",
                                     TILE=size)}


def _gemm(a: Tensor, b: Tensor, node: Tensor, s: Session):
    """The prompt-size product by integer GEMM (backends/cpu/qgemm.py): b's columns encoded to
    a's vec_dot_type and unpacked by one kernel, multiplied by a's rows by the next. Products
    reading the same b in the same layout (Q, K and V; gate and up) share the first one's
    unpacked activations: b cannot change before its last reader has run."""
    g, vt, k = GEMMS[a.type], VEC_DOT_TYPE[a.type], b.ne[0]
    nsub = k // g.sub
    dev = TARGET.device
    kg = TARGET.bind(qgemm.k_gemm, _KERNEL, f"a{a.type}",
                     unpack=TARGET.bind(g.unpack, dev, k_nibbles=TARGET.bind(
                         qgemm.k_nibbles, dev)), SUB=g.sub)
    key = (b, g.acts, g.sub, g.round_sums)
    if (shared := s.bind_memo.get(key)) is not None:
        return partial(kg, s.arr(a), *shared, s.arr(node), nsub)
    D = s.arr(node)
    aq = np.empty(D.shape[:3] + (qgemm.layout_width(nsub, g.sub),), np.uint8)
    af = np.empty(D.shape[:3] + (16 * -(-nsub // 8),), np.float32)
    s.bind_memo[key] = (aq, af)
    tag = f"{g.acts.__name__}{'_r' if g.round_sums else ''}"
    ka = TARGET.bind(qgemm.k_gemm_acts, _KERNEL, f"b{b.type}_{tag}",
                     dec_b=TARGET.codec(b.type).dec, enc_r=act_encoder(vt),
                     acts=TARGET.bind(g.acts, dev, tag, ROUND_SUMS=g.round_sums))
    return partial(in_turn, partial(ka, s.arr(b), aq, af, k, nsub,
                                    vt.type_size * k // vt.block_size, g.sub),
                   [partial(kg, s.arr(a), aq, af, D, nsub)])


def _activations(a: Tensor, b: Tensor, B: np.ndarray, node: Tensor):
    """b as the dot products of `a`'s type see it: a float32 array and the call that fills it
    (None when b is used as is)."""
    vt = VEC_DOT_TYPE.get(a.type) if ROUND_ACTIVATIONS else None
    if vt is None or b.ne[0] % vt.block_size:
        return B, None
    out = np.empty(b.shape, np.float32)
    if vt == T.F16 and b.type == T.F32:
        k = TARGET.bind(K.k_round_half_rows, _SERIAL if _small(node) else _KERNEL,
                        "serial" if _small(node) else "", round_half=_ROUND_HALF)
        return out, partial(k, B, out)
    k = _compiled(K.k_round_rows, _small(node), b=b.type, r=vt)
    width = b.ne[0] if vt.block_size == 1 else vt.type_size * b.ne[0] // vt.block_size
    proto = np.empty((1, 1, 1, width), np.uint16 if vt.block_size == 1 else np.uint8)
    return out, partial(k, B, out, b.ne[0], proto)


def _mul_mat(node: Tensor, s: Session):
    a, b = node.src
    A, D = s.arr(a), s.arr(node)
    n = b.ne[1]
    if a.type == T.F16 and b.type == T.F32 and n < BLAS_MIN_N and (
            flat := flat_rows(A)) is not None:
        # F16 mat-vec (K*Q and V*softmax on the KV cache at decode): each row a contiguous
        # slice of the memory the view spans, dotted with every column and broadcast head;
        # b is rounded to F16 inside the kernel (no separate pass)
        af, (o3, o2, o1) = flat
        k = TARGET.bind(K.k_mul_mat_half, _SERIAL_FAST if _small(node) else _KERNEL_FAST,
                        "serial" if _small(node) else "",
                        round_half=_ROUND_HALF, prefetch=qmem.prefetch, HALF_PF=HALF_PF)
        return partial(k, af, o3, o2, o1, A.shape[0], A.shape[1], A.shape[2], s.arr(b), D,
                       ROUND_ACTIVATIONS)
    if (packed := packed_weight(a, b, s)) is not None:
        # R rows at a time from the weight's packed copy (backends/cpu/qpack.py): a decode
        # step's few columns and a prompt's many alike
        return packed_call(packed_kernel(_small(node), a.type, b.type), a.type, s.arr(b),
                           [(packed, D, a.ne[1])], work=s.bind_memo,
                           team=packed_team(a.type, b.type))
    if n < BLAS_MIN_N and (vt := _int_dot_type(a, b)) is not None:
        # integer dots with the activations quantized in the same kernel call
        k = b.ne[0]
        Q = np.empty(D.shape[:3] + (vt.type_size * k // vt.block_size,), np.uint8)
        ys = np.empty(D.shape[:3] + (k // 32,), np.float32)
        rd = ROW_DOTS.get(a.type)
        return partial(_row_dot_kernel(_small(node), a.type, b.type), A, s.arr(b), Q, ys, D, k,
                       k // TYPE_RECORDS[a.type].block_size, rd is not None and rd.sums)
    if a.type in GEMMS and _int_dot_type(a, b) is not None:
        # a prompt's worth of columns: integer GEMM, each unpacked weight row used by all
        return _gemm(a, b, node, s)
    B, prep = _activations(a, b, s.arr(b), node)
    if b.type == T.F32 and (a.type == T.F32 or n >= BLAS_MIN_N):
        run = partial(mul_mat_blas, A, B, D, None if a.type == T.F32 else row_decoder(a.type))
    else:
        run = partial(_compiled(K.k_mul_mat, _small(node), a=a.type, b=T.F32 if prep else b.type),
                      A, B, D)
    return run if prep is None else partial(in_turn, prep, [run])


# k_mul_mat_half asks for the rows this many rows ahead of the one it dots: a decode step's
# K*Q and V*softmax read the cache from memory (the weights streamed since the last token have
# evicted it); 8 ahead took SmolLM2's per layer from 23 and 33 us to 17 and 17 (2 threads,
# Intel Xeon, 128-192 cells; benchmarks/profile_decode.py --fa 0)
HALF_PF = 8




def _mul_mat_id(node: Tensor, s: Session):
    as_, b, ids = node.src
    if (qa := _quantized_activations(as_, b, s.arr(b), node)) is not None:
        Q, prep = qa
        run = partial(_qdot_kernel(K.k_mul_mat_id_q, _small(node), as_.type), s.arr(as_), Q,
                      s.arr(ids), s.arr(node), b.ne[0])
        run = index_checked(node, s.arr(ids), as_.ne[2], "expert id", run)
        return partial(in_turn, prep, [run])
    B, prep = _activations(as_, b, s.arr(b), node)
    run = partial(_compiled(K.k_mul_mat_id, _small(node), a=as_.type,
                            b=T.F32 if prep else b.type), s.arr(as_), B, s.arr(ids), s.arr(node))
    run = index_checked(node, s.arr(ids), as_.ne[2], "expert id", run)
    return run if prep is None else partial(in_turn, prep, [run])


# -- rows, copies, layout --------------------------------------------------------------------


def _get_rows(node: Tensor, s: Session):
    a, idx = node.src
    if a.type == T.I32:
        run = partial(_SERIAL_GET_ROWS_INT, s.arr(a), s.arr(idx), s.arr(node))
    else:
        run = partial(_compiled(K.k_get_rows, _small(node), a=a.type, d=node.type), s.arr(a),
                      s.arr(idx), s.arr(node))
    return index_checked(node, s.arr(idx), a.ne[1], "row", run)


_SERIAL_GET_ROWS_INT = _SERIAL(K.k_get_rows_int)
_COPY_INT = TARGET.bind(K.k_copy_int, _SERIAL)


def _set_rows(node: Tensor, s: Session):
    dst, src, idx = node.src
    if src.ne[0] == 1 and src.type == T.F32 and dst.type in _ENC_ONE:
        k = TARGET.bind(K.k_set_rows_1, _SERIAL if _small(node) else _KERNEL,
                        f"{dst.type}{'_serial' if _small(node) else ''}",
                        enc_one=_ENC_ONE[dst.type])
    else:
        k = _compiled(K.k_set_rows, _small(node), a=src.type, d=dst.type)
    run = partial(k, s.arr(src), s.arr(idx), s.arr(node))
    return index_checked(node, s.arr(idx), dst.ne[1], "row", run)


# one float32 as a destination type's element (k_set_rows_1): the target's own f32_to_half
# (F16C's where the host has it)
_ENC_ONE = {T.F16: TARGET.fn("f32_to_half"), T.F32: TARGET.device(fastmath.f32_identity)}


def _copy_into(a: Tensor, d: Tensor, s: Session) -> None:
    """a's elements, in ggml order, into d: exact byte copies for equal types."""
    A, D = s.arr(a), s.arr(d)
    if raw_copy(a, d):
        return partial(_same_type_copy, A, D)
    if a.type.is_int:
        return partial(_COPY_INT, A, D)
    return partial(_compiled(K.k_copy, _small(d), a=a.type, d=d.type), A, D, a.ne[0], d.ne[0])


def _same_type_copy(A: np.ndarray, D: np.ndarray) -> None:
    D[...] = A.reshape(D.shape)  # numpy's reshape follows ggml's element order


def _cpy(node: Tensor, s: Session):
    return _copy_into(node.src[0], node, s)


def _cont(node: Tensor, s: Session):
    return _copy_into(node.src[0], node, s)


def _concat(node: Tensor, s: Session) -> None:
    a, b = node.src
    D = s.arr(node)
    axis = 3 - node.params.dim
    cut = a.shape[axis]
    return partial(
        _concat_run,
        D[(slice(None),) * axis + (slice(0, cut),)],
        s.arr(a),
        D[(slice(None),) * axis + (slice(cut, None),)],
        s.arr(b),
    )


def _concat_run(d0: np.ndarray, a: np.ndarray, d1: np.ndarray, b: np.ndarray) -> None:
    d0[...] = a
    d1[...] = b


def _repeat(node: Tensor, s: Session):
    a = node.src[0]
    if a.type.is_int:  # exact: the float32 row path would round large ints
        return partial(_tile, s.arr(a), s.arr(node))
    return partial(
        _compiled(K.k_repeat, _small(node), a=a.type, d=node.type), s.arr(a), s.arr(node)
    )


def _tile(A: np.ndarray, D: np.ndarray) -> None:
    D[...] = np.tile(A, tuple(x // y for x, y in zip(D.shape, A.shape)))


def _sum_rows(node: Tensor, s: Session) -> None:
    a = node.src[0]
    return partial(_compiled(K.k_sum_rows, _small(node), a=a.type), s.arr(a), s.arr(node))


def _argsort(node: Tensor, s: Session) -> None:
    a = node.src[0]
    return partial(_compiled(K.k_argsort, _small(node), a=a.type), s.arr(a), s.arr(node),
                   *argsort_args(node))


def _view(node: Tensor, s: Session) -> None:
    """Views compute nothing: their memory is their source's."""
    return None


def _k(fn, accepts=lambda node: True, why_not: str = "") -> Kernel:
    return Kernel(fn, accepts, why_not, bind=True)


KERNELS: dict[OpKind, Kernel] = {
    **{op: _k(_view, *rule(op)) for op in VIEW_OPS},
    **{op: _k(_unary, *rule(op)) for op in UNARY_OPS},
    **{op: _k(_binary, *rule(op)) for op in BINARY_OPS},
    **{op: _k(fn, *rule(op)) for op, fn in (
        (OpKind.RMS_NORM, _norm), (OpKind.NORM, _norm), (OpKind.SOFT_MAX, _soft_max),
        (OpKind.ROPE, _rope), (OpKind.FLASH_ATTN_EXT, flash_attn), (OpKind.MUL_MAT, _mul_mat),
        (OpKind.MUL_MAT_ID, _mul_mat_id), (OpKind.GET_ROWS, _get_rows),
        (OpKind.SET_ROWS, _set_rows), (OpKind.CPY, _cpy), (OpKind.CONT, _cont),
        (OpKind.CONCAT, _concat), (OpKind.REPEAT, _repeat), (OpKind.SUM_ROWS, _sum_rows),
        (OpKind.ARGSORT, _argsort), (OpKind.TOP_K, _argsort))},
}

# the training ops' kernels (they bind with backends/cpu/compile.py, as this module does)
from . import backward_rows, reductions, training  # noqa: E402

KERNELS.update({op: _k(fn, *rule(op)) for m in (reductions, backward_rows, training)
                for op, fn in m.BINDERS.items()})
