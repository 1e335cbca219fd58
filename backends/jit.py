"""Compile the shared math (backends/shared) and kernel templates for a target.

A *template* is a plain Python function whose free names (`dec_a`, `enc_d`, `dot_a`, ...)
are bound per call site: `Target.bind(template, dec_a=..., ...)` makes a copy of the function
with its own globals and compiles it with the target's decorator. Each binding gets its own
qualified name, so numba's on-disk cache (`cache=True`) keeps one entry per type combination.
This is how one kernel serves every tensor type without numba's (uncacheable) first-class
function arguments, and how CPU and CUDA compile the same math.
"""
from __future__ import annotations

import hashlib
import types
from pathlib import Path
from typing import Any, Callable

from ggraph.ir.types import TYPE_RECORDS
from ggraph.ir.types import GGMLType
from .shared import codecs, codecs_k, elementwise, numeric, qdot

NUMERIC = ("rint", "half_to_f32", "f32_to_half", "bf16_to_f32", "f32_to_bf16", "roundf", "mul_rn",
           "silu", "gelu", "sigmoid", "alibi_slope", "rope_cos_sin", "norm_row")
ELEMENTWISE = ("unary_value", "binary_value", "unary_row", "binary_row", "unflatten")
CODEC_HELPERS = ("_half_at", "_put_half", "_finite_or_zero", "_trunc_u8", "_half_row", "_opaque",
                 "_u32_row", "_put_fives", "_k4_scale", "_k4_min", "_q3_scale", "_iq4_xs_scale",
                 "_best_iq4", "_f32_row", "_put_f32", "_isum_i8", "_sum_i8", "_isum_nib",
                 "_isum_nib_h", "_isum_q4", "_isum_q5", "_isum_q4k", "_i16_row", "_k4_min_sum",
                 "_f16_round")
CODEC_CONSTANTS = ("IQ4NL_VALUES",)  # module-level arrays the codecs read (compile-time constants)
# the modules codec functions live in; a record names a function of either
CODEC_MODULES = (codecs, codecs_k, qdot)
# each type's codec names in shared/codecs*.py, from its record (ggraph/ir/types.py):
# (load, store, load1) for element types, (dec, enc, dot) for block types; an empty encoder
# name (a type without a quantizer, never stored) compiles `enc_none`
ELEM_CODECS = {t: r.codecs for t, r in TYPE_RECORDS.items() if not r.is_quantized}
BLOCK_CODECS = {t: r.codecs for t, r in TYPE_RECORDS.items() if r.is_quantized}
# the integer dot with quantized activations (shared/qdot.py), for the types that have one
QDOT_CODECS = {t: r.qdot for t, r in TYPE_RECORDS.items() if r.qdot}


def source_hash(*files: str | Path) -> str:
    """A hash of everything a target's kernels are compiled from: the shared math a Target
    compiles (numeric, codecs, elementwise), this file, the bit-level conversions both targets
    bind (half.py), and a backend's own `files` (its templates). numba's on-disk cache checks only a kernel's own file, not the functions it
    inlines, so the tag of every binding carries this hash: editing the shared math compiles
    afresh instead of reusing stale code."""
    paths = [Path(m.__file__) for m in (numeric, codecs, codecs_k, qdot, elementwise)] + \
        [Path(__file__), Path(__file__).with_name("half.py")] + \
        [Path(f) for f in files]
    return hashlib.sha1(b"".join(p.read_bytes() for p in paths)).hexdigest()[:10]


def _copy(f: Callable, glb: dict, tag: str) -> Callable:
    nf = types.FunctionType(f.__code__, glb, f.__name__, f.__defaults__, f.__closure__)
    nf.__qualname__ = f"{f.__qualname__}__{tag}" if tag else f.__qualname__
    nf.__module__ = f.__module__
    nf.__doc__ = f.__doc__
    return nf


def _codec_source(name: str) -> Any:
    """The shared codec function (or constant) `name`, from whichever codec module has it."""
    for m in CODEC_MODULES:
        if hasattr(m, name):
            return getattr(m, name)
    raise KeyError(f"no codec function {name!r} in {', '.join(m.__name__ for m in CODEC_MODULES)}")


class Codec:
    """A type's compiled row decoder/encoder/dot (and element load/store for element types);
    `qdot` the integer dot with vec_dot_type activation bytes (None: the type has none)."""

    def __init__(self, dec: Any, enc: Any, dot: Any, load: Any = None, store: Any = None,
                 qdot: Any = None):
        self.dec, self.enc, self.dot, self.load, self.store = dec, enc, dot, load, store
        self.qdot = qdot


class Target:
    """Compiled shared math for one target. `device` compiles helpers (called from kernels),
    `kernel` compiles templates called from Python (the CPU may pass parallel=True)."""

    def __init__(self, name: str, device: Callable[[Callable], Any],
                 device_fast: Callable[[Callable], Any] | None = None,
                 overrides: dict[str, Callable] | None = None,
                 device_ieee: Callable[[Callable], Any] | None = None) -> None:
        self.name = name
        self.device = device
        # dot products may reassociate their sums (vectorized reductions); never used where
        # NaN/inf handling or exact rounding matters (conversions, quantizers)
        self.device_fast = device_fast or device
        # the element-wise formulas divide as IEEE does (x / 0 is inf or NaN, as in ggml and
        # in a numba parallel loop's body), not raising as numba.njit's default does
        device_ieee = device_ieee or device
        glb: dict[str, Any] = dict(numeric.__dict__)
        glb.update({k: v for k, v in codecs.__dict__.items() if k in ("np", "math")})
        glb.update({k: _codec_source(k) for k in CODEC_CONSTANTS})
        # the op codes U_* and B_* (integer constants in compiled code)
        glb.update({k: v for k, v in vars(elementwise).items() if k.startswith(("U_", "B_"))})
        self.globals = glb
        for n in NUMERIC:
            glb[n] = device(_copy(getattr(numeric, n), glb, ""))
        for n in ELEMENTWISE:  # own names: numba's disk cache does not key on the flags
            glb[n] = device_ieee(_copy(getattr(elementwise, n), glb, "ieee"))
        # a target may replace a scalar function by a faster equivalent (tested equal); the
        # shared version stays the definition every other target compiles
        for n, f in (overrides or {}).items():
            if n not in NUMERIC and n not in ELEMENTWISE:
                raise ValueError(f"override of unknown shared function {n!r}")
            # IEEE division (no zero check, which would keep a loop of it from vectorizing)
            glb[n] = device_ieee(f)
        for n in CODEC_HELPERS:
            glb[n] = device(_copy(_codec_source(n), glb, ""))
        self._codecs: dict[GGMLType, Codec] = {}
        self._bound: dict[tuple, Any] = {}
        self._helper_tag = ""

    def replace_helpers(self, compiled: dict[str, Any], tag: str) -> None:
        """Bind target-specific versions of shared codec helpers (already compiled: numba
        intrinsics, same arguments and results) in place of the shared ones, before any codec
        is built. `tag` names them in the qualified names of the codecs built after (numba's
        disk cache keeps them apart from a target compiling the shared helpers)."""
        if self._codecs or self._bound:
            raise RuntimeError(f"{self.name}: helpers replaced after codecs were compiled")
        unknown = set(compiled) - set(CODEC_HELPERS)
        if unknown:
            raise ValueError(f"replacement of unknown codec helpers {sorted(unknown)}")
        self.globals.update(compiled)
        self._helper_tag = tag

    def fn(self, name: str) -> Any:
        return self.globals[name]

    def codec(self, t: GGMLType) -> Codec:
        c = self._codecs.get(t)
        if c is None:
            c = self._codecs[t] = self._make_codec(t)
        return c

    def _make_codec(self, t: GGMLType) -> Codec:
        if t in BLOCK_CODECS:
            dec, enc, dot = BLOCK_CODECS[t]
            qd = QDOT_CODECS.get(t)
            return Codec(self.device(_copy(_codec_source(dec), self.globals, "")),
                         self.device(_copy(_codec_source(enc or "enc_none"), self.globals, "")),
                         self.device_fast(_copy(_codec_source(dot), self.globals, "")),
                         qdot=self.device_fast(_copy(_codec_source(qd), self.globals,
                                                     self._helper_tag)) if qd else None)
        ld, st, ld1 = ELEM_CODECS[t]
        load = self.device(_copy(_codec_source(ld), self.globals, ""))
        store = self.device(_copy(_codec_source(st), self.globals, ""))
        tag = str(t)
        dec = self.device(_copy(codecs.dec_elem, dict(self.globals, load=load), tag))
        enc = self.device(_copy(codecs.enc_elem, dict(self.globals, store=store), tag))
        load1 = self.device(_copy(_codec_source(ld1), self.globals, ""))
        dot = self.device_fast(_copy(codecs.dot_elem, dict(self.globals, load1=load1), tag))
        return Codec(dec, enc, dot, load, store)

    def bind(self, template: Callable, decorator: Callable[[Callable], Any], tag: str,
             **names: Any) -> Any:
        """`template` compiled with `decorator`, its free names bound to `names`. Cached per
        (template, tag): the tag must name everything the bindings depend on."""
        key = (template, tag)
        k = self._bound.get(key)
        if k is None:
            glb = dict(template.__globals__)
            glb.update(self.globals)
            glb.update(names)
            k = self._bound[key] = decorator(_copy(template, glb, tag))
        return k

    def bound_kernels(self) -> list[Any]:
        """Every kernel `bind` has compiled so far (for tools that inspect their code)."""
        return list(self._bound.values())
