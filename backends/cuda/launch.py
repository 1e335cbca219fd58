"""How the CUDA kernel tables compile and launch: per-type device helpers (element load and
store, chunk decode/encode/dot: a chunk is CH elements of a row, one quant block) built once
per type from the shared codecs, `compiled` (a template bound to its roles' helpers: ld_a,
cdec_v, ...), and the two launch shapes, element-wise (grid-stride) and one block per row.
backends/cuda/kernels.py and the training ops' modules beside it all bind through here."""
from __future__ import annotations

from typing import Any, Callable

from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from . import runtime as R
from . import templates as K

TARGET = R.TARGET
KERNEL = R.kernel_decorator()
DEVICE = R.device_decorator()
Launch = Callable[[], None] | None

ROLE_FNS = ("ld", "st", "cdec", "cenc", "cdot", "dot")

_NO_STORE = DEVICE(K.no_store)
_HELPERS: dict[T, dict[str, Any]] = {}


def helpers(t: T) -> dict[str, Any]:
    """Device functions for type t (see templates.py for what each does)."""
    h = _HELPERS.get(t)
    if h is None:
        c = TARGET.codec(t)
        q = t.is_quantized
        bs, ts = (t.block_size, t.type_size) if q else (1, 1)
        tag = str(t)
        # a block longer than a chunk (K-quants: 256) is decoded whole and the chunk picked
        # out of it (K-quants are weights only: never encoded chunk-wise)
        big = bs > K.CH
        h = {"cdec": TARGET.bind(K.chunk_dec_big if big else K.chunk_dec, DEVICE, tag,
                                 dec=c.dec, BS=bs, TS=ts),
             "cenc": TARGET.bind(K.chunk_enc, DEVICE, tag, enc=c.enc, BS=bs, TS=ts),
             "cdot": TARGET.bind(K.chunk_dot_big, DEVICE, tag, dec=c.dec, BS=bs, TS=ts)
             if big else TARGET.bind(K.chunk_dot, DEVICE, tag, dot=c.dot, BS=bs, TS=ts),
             "dot": c.dot, "Q": q}
        if q:
            h["ld"] = TARGET.bind(K.block_load, DEVICE, tag, cdec=h["cdec"])
            h["st"] = _NO_STORE
        else:
            h["ld"], h["st"] = c.load, c.store
        _HELPERS[t] = h
    return h


def compiled(template: Callable, **roles: T) -> Any:
    """`template` compiled as a CUDA kernel with each role's helpers bound (ld_a, cdec_v...)."""
    names: dict[str, Any] = {}
    for role, t in roles.items():
        h = helpers(t)
        names.update({f"{fn}_{role}": h[fn] for fn in ROLE_FNS})
        names[f"Q_{role}"] = h["Q"]
    tag = "_".join(f"{r}{t}" for r, t in roles.items())
    return TARGET.bind(template, KERNEL, tag, **names)


def n_rows(t: Tensor) -> int:
    return t.ne[1] * t.ne[2] * t.ne[3]


def elementwise_launch(kernel: Any, work: int, *args: Any) -> Launch:
    """An element-wise (grid-stride) launch over `work` items."""
    return R.bound(kernel, R.blocks_for(work, K.EW_NT) if work else 0, K.EW_NT, *args)


def per_row_launch(kernel: Any, nrows: int, nt: int, *args: Any) -> Launch:
    """One block per row (grid-stride over rows)."""
    return R.bound(kernel, max(1, min(nrows, R.MAX_BLOCKS)) if nrows else 0, nt, *args)
