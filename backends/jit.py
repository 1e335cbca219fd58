"""Compile the shared math (backends/shared) and kernel templates for a target.

A *template* is a plain Python function whose free names (`dec_a`, `enc_d`, `dot_a`, ...)
are bound per call site: `Target.bind(template, dec_a=..., ...)` makes a copy of the function
with its own globals and compiles it with the target's decorator. Each binding gets its own
qualified name, so numba's on-disk cache (`cache=True`) keeps one entry per type combination.
This is how one kernel serves every tensor type without numba's (uncacheable) first-class
function arguments, and how CPU and CUDA compile the same math.

numba's on-disk cache keys a kernel by its file and qualified name only, not by the functions
it inlines or the values bound into it. So every binding's qualified name ends in a key derived
from everything it is compiled from (`Target.key_of`): the shared math, the template's file,
the files of the functions and intrinsics it calls, each bound value (a bound function by its
own key or file, a constant by its value, an array by its bytes) and the compiler's options
(`Compiler`). Nobody writes source hashes into tags: editing any of those sources, or binding
other values, compiles afresh instead of reusing stale machine code. A caller's `tag` only
adds what the sources cannot show (a CPU flavor read at code generation) and a readable name.
"""
from __future__ import annotations

import hashlib
import marshal
import types
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import numpy as np

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


_FILE_HASHES: dict[str, str] = {}


def file_hash(path: str | Path) -> str:
    """sha1 of a source file's bytes (read once per process)."""
    key = str(path)
    h = _FILE_HASHES.get(key)
    if h is None:
        h = _FILE_HASHES[key] = hashlib.sha1(Path(path).read_bytes()).hexdigest()
    return h


# the shared math every target compiles: part of every binding's key
SHARED_SOURCES = tuple(Path(m.__file__) for m in (numeric, codecs, codecs_k, qdot, elementwise)) \
    + (Path(__file__), Path(__file__).with_name("half.py"))


def _canon(v: Any) -> str:
    """A value as the same text in every process (sets sorted; no object addresses)."""
    if isinstance(v, (set, frozenset)):
        return "{" + ",".join(sorted(_canon(x) for x in v)) + "}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_canon(k)}:{_canon(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, (bool, int, float, str, type(None))) or isinstance(v, Enum):
        return repr(v)
    raise TypeError(f"cannot key a compile option of type {type(v).__name__}")


_SCALARS = (bool, int, float, str, Enum, type(None))


class Compiler:
    """A template decorator with its options named, so that how a binding is compiled is part
    of its key: Compiler(numba.njit, cache=True, parallel=True)."""

    def __init__(self, factory: Callable[..., Any], **options: Any) -> None:
        self.factory, self.options = factory, options
        self.decorate = factory(**options) if options else factory
        self.key = f"{getattr(factory, '__module__', '')}.{getattr(factory, '__name__', '?')}" \
            f"{_canon(options)}"

    def __call__(self, fn: Callable) -> Any:
        return self.decorate(fn)


# (code, qualified name) -> its source's key: a kernel binder derives keys for every binding
# it makes (a graph of 200 products binds thousands), so each function is keyed once
_SOURCES: dict[tuple[types.CodeType, str], str] = {}


def _source_of(v: Any) -> str | None:
    """The source of a Python function, dispatcher or intrinsic: its file's hash and its name,
    or, for code with no file (run from a string: the docs' examples), its compiled code."""
    fn = getattr(v, "py_func", None) or getattr(v, "_defn", None) or v
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    key = (code, getattr(fn, "__qualname__", ""))
    src = _SOURCES.get(key)
    if src is None:
        path = Path(code.co_filename)
        src = _SOURCES[key] = (f"{file_hash(path)}:{key[1]}" if path.is_file() else
                               f"code:{hashlib.sha1(marshal.dumps(code)).hexdigest()}")
    return src


def value_key(v: Any) -> str:
    """What a bound value contributes to a binding's key."""
    k = getattr(v, "ggraph_key", None)
    if isinstance(k, str):
        return k   # a binding of Target.bind: its own derived key
    src = _source_of(v)
    if src is not None:
        return src
    if isinstance(v, np.ndarray):
        return f"array{v.dtype}{v.shape}:{hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest()}"
    if isinstance(v, types.ModuleType):
        return f"module:{v.__name__}"
    return _canon(v)


_CODE_NAMES: dict[types.CodeType, frozenset[str]] = {}


def _code_names(code: types.CodeType) -> frozenset[str]:
    """The global names a function's code (and the code nested in it) reads."""
    out = _CODE_NAMES.get(code)
    if out is None:
        names = set(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names |= _code_names(c)
        out = _CODE_NAMES[code] = frozenset(names)
    return out


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
        self._sources: dict[tuple[Callable, frozenset[str]], list[str]] = {}
        self._keys: dict[tuple, tuple[str, Any, tuple]] = {}
        self._helper_tag = ""
        self.base_key = hashlib.sha1("".join(file_hash(p) for p in SHARED_SOURCES).encode()
                                     + name.encode()).hexdigest()

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

    def key_of(self, template: Callable, decorator: Any, names: dict[str, Any],
               tag: str = "") -> str:
        """The key of `template` compiled with `decorator` and `names` bound: a hash of the
        shared math, the template's file, the sources of every function and intrinsic its
        code reads (bound or from its module), each bound value, the compiler's options (a
        Compiler; any other decorator by its name) and `tag` (what no source shows)."""
        parts = [self.base_key, self._helper_tag, tag, value_key(template),
                 getattr(decorator, "key", None) or getattr(decorator, "__qualname__", "?")]
        parts += [f"{n}={value_key(v)}" for n, v in sorted(names.items())]
        parts += self._module_sources(template, frozenset(names))
        return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]

    def _module_sources(self, template: Callable, bound: frozenset[str]) -> list[str]:
        """The sources of the functions and intrinsics `template` reads from its own module's
        globals (not bound, not the shared math), once per template and set of bound names."""
        key = (template, bound)
        out = self._sources.get(key)
        if out is None:
            glb = template.__globals__
            out = self._sources[key] = [
                f"{n}@{src}" for n in sorted(_code_names(template.__code__) - bound)
                if n not in self.globals and (src := _source_of(glb.get(n))) is not None]
        return out

    def bind(self, template: Callable, decorator: Callable[[Callable], Any], tag: str = "",
             **names: Any) -> Any:
        """`template` compiled with `decorator`, its free names bound to `names`, named (and
        cached, in memory and by numba on disk) by its derived key (key_of). `tag` is for what
        the sources cannot show (a code generation flavor) and for people reading names."""
        # the same values bound again (a graph rebinding its nodes) find their key without
        # deriving it: constants by type and value, objects by identity (the entry holds the
        # objects, so no other object can take their ids)
        seen = (template, id(decorator), tag,
                tuple((n, (type(v), v) if isinstance(v, _SCALARS) else id(v))
                      for n, v in names.items()))
        hit = self._keys.get(seen)
        if hit is None:
            hit = self._keys[seen] = (self.key_of(template, decorator, names, tag), decorator,
                                      tuple(names.values()))
        key = hit[0]
        k = self._bound.get((template, key))
        if k is None:
            glb = dict(template.__globals__)
            glb.update(self.globals)
            glb.update(names)
            k = decorator(_copy(template, glb, f"{tag}_{key}" if tag else key))
            k.ggraph_key = key
            self._bound[(template, key)] = k
        return k

    def bound_kernels(self) -> list[Any]:
        """Every kernel `bind` has compiled so far (for tools that inspect their code)."""
        return list(self._bound.values())
