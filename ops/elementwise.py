"""Element-wise ops: add, mul, div (b broadcast by modulo), scale, clamp, fill, silu, gelu,
sigmoid and swiglu (silu(gate) * up).

The binary ops, scale, clamp, fill and the unary activations may run in place (ggml-alloc's
list in the libggml that llama-cpp-python 0.3.36 ships; older ggml left clamp out); swiglu may
not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from .case import Case, case
from .registry import (FLOATS, GGMLMap, GGMLProbe, OpDef, can_repeat, ggml_contiguous_from, ggml_fn,
                       ggml_packed_rows, ggml_packed_sources, new_node, register, require,
                       require_type, types_ok)
from .views import strided

FLOAT_TYPES = FLOATS
ADD = OpKind.define("add", Family.ARITHMETIC)
MUL = OpKind.define("mul", Family.ARITHMETIC)
DIV = OpKind.define("div", Family.ARITHMETIC)
SCALE = OpKind.define("scale", Family.ARITHMETIC)
CLAMP = OpKind.define("clamp", Family.ARITHMETIC)
FILL = OpKind.define("fill", Family.ARITHMETIC)
SILU = OpKind.define("silu", Family.ACTIVATION)
GELU = OpKind.define("gelu", Family.ACTIVATION)
SIGMOID = OpKind.define("sigmoid", Family.ACTIVATION)
GELU_QUICK = OpKind.define("gelu_quick", Family.ACTIVATION)
TANH = OpKind.define("tanh", Family.ACTIVATION)
SWIGLU = OpKind.define("swiglu", Family.ACTIVATION)


@dataclass(frozen=True)
class ScaleParams:
    s: float
    b: float = 0.0


@dataclass(frozen=True)
class ClampParams:
    min: float
    max: float


@dataclass(frozen=True)
class FillParams:
    value: float


def _binary(kind: OpKind, a: Tensor, b: Tensor, name: str) -> Tensor:
    op = str(kind)
    require_type(op, "a", a, FLOAT_TYPES)
    require_type(op, "b", b, FLOAT_TYPES)
    require(can_repeat(b, a), op, f"b.ne={list(b.ne)} must divide a.ne={list(a.ne)} in every "
            f"dimension (b is broadcast over a by modulo)", a=a, b=b)
    return new_node(kind, (a, b), a.type, a.ne, name=name)


def add(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(OpKind.ADD, a, b, name)


def mul(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(OpKind.MUL, a, b, name)


def div(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(OpKind.DIV, a, b, name)


def _unary(kind: OpKind, a: Tensor, params: object, name: str) -> Tensor:
    require_type(str(kind), "a", a, FLOAT_TYPES)
    return new_node(kind, (a,), a.type, a.ne, params, name=name)


def scale(a: Tensor, s: float, b: float = 0.0, name: str = "") -> Tensor:
    """a * s + b."""
    return _unary(OpKind.SCALE, a, ScaleParams(float(s), float(b)), name)


def clamp(a: Tensor, min: float, max: float, name: str = "") -> Tensor:
    require(min <= max, "clamp", f"min={min} is above max={max}", a=a)
    return _unary(OpKind.CLAMP, a, ClampParams(float(min), float(max)), name)


def fill(a: Tensor, value: float, name: str = "") -> Tensor:
    """A tensor shaped like `a` with every element `value` (a's values are not read)."""
    return _unary(OpKind.FILL, a, FillParams(float(value)), name)


def silu(a: Tensor, name: str = "") -> Tensor:
    return _unary(OpKind.SILU, a, None, name)


def gelu(a: Tensor, name: str = "") -> Tensor:
    """tanh approximation, as ggml_gelu."""
    return _unary(OpKind.GELU, a, None, name)


def sigmoid(a: Tensor, name: str = "") -> Tensor:
    return _unary(OpKind.SIGMOID, a, None, name)


def gelu_quick(a: Tensor, name: str = "") -> Tensor:
    """x * sigmoid(1.702 x), as ggml_gelu_quick (CLIP-style encoders use it)."""
    return _unary(OpKind.GELU_QUICK, a, None, name)


def tanh(a: Tensor, name: str = "") -> Tensor:
    """tanh(x), as ggml_tanh (Gemma 2's logit soft-capping uses it)."""
    return _unary(OpKind.TANH, a, None, name)


def swiglu(gate: Tensor, up: Tensor, name: str = "") -> Tensor:
    """silu(gate) * up (ggml_swiglu_split)."""
    op = "swiglu"
    require_type(op, "gate", gate, FLOAT_TYPES)
    require_type(op, "up", up, FLOAT_TYPES)
    require(gate.ne == up.ne, op, "gate and up must have the same shape", gate=gate, up=up)
    require(gate.type == up.type, op, f"gate and up must have the same type ({gate.type} and "
            f"{up.type})", gate=gate, up=up)
    return new_node(OpKind.SWIGLU, (gate, up), gate.type, gate.ne, name=name)


# -- references ---------------------------------------------------------------------------

def _broadcast(ex, a: Tensor, b: Tensor) -> tuple[np.ndarray, np.ndarray]:
    A = ex.read(a).astype(np.float64)
    B = ex.read(b).astype(np.float64)
    reps = tuple(x // y for x, y in zip(A.shape, B.shape))
    return A, np.tile(B, reps)


def _binary_ref(f):
    def ref(node: Tensor, ex) -> np.ndarray:
        A, B = _broadcast(ex, *node.src)
        return f(A, B)
    return ref


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


_GELU_C = math.sqrt(2.0 / math.pi)


def _x(node: Tensor, ex) -> np.ndarray:
    return ex.read(node.src[0]).astype(np.float64)


# -- conformance cases --------------------------------------------------------------------

def _binary_cases(kind: OpKind, f: Callable[..., Tensor]) -> Callable[[], Iterator[Case]]:
    def gen() -> Iterator[Case]:
        for ta in (T.F32, T.F16):
            for nb in ((64, 5, 3, 2), (64, 1, 3, 1), (1, 5, 1, 2), (16, 1, 1, 1)):
                yield case(kind, lambda B, ta=ta, nb=nb: f(
                    B.inp(ta, 64, 5, 3, 2), B.inp(T.F32, *nb)), type=ta, ne_a=[64, 5, 3, 2],
                    ne_b=list(nb))
        yield case(kind, lambda B: f(strided(B, T.F32, 16, 5), B.inp(T.F32, 16, 1)),
                   type=T.F32, a="strided")
    return gen


def _swiglu_cases() -> Iterator[Case]:
    for t in (T.F32, T.F16):
        yield case(OpKind.SWIGLU, lambda B, t=t: swiglu(B.inp(t, 64, 5), B.inp(t, 64, 5)),
                   type=t, ne=[64, 5])


def _unary_cases(kind: OpKind, f: Callable[..., Tensor], **kw: Any
                 ) -> Callable[[], Iterator[Case]]:
    def gen() -> Iterator[Case]:
        for t in (T.F32, T.F16):
            yield case(kind, lambda B, t=t: f(B.inp(t, 33, 4, 3), **kw), type=t,
                       ne=[33, 4, 3], **kw)
        yield case(kind, lambda B: f(strided(B, T.F32, 16, 5), **kw), type=T.F32,
                   src="strided", **kw)
    return gen


def _floats_in_out(n: Tensor) -> bool:
    return types_ok(n, FLOATS) and n.type in FLOATS


def _floats_2(n: Tensor) -> bool:
    return types_ok(n, FLOATS, FLOATS)


# -- ggml: what its constructors and CPU kernels cannot do ----------------------------------

def _ggml_scale_layout(t: Tensor) -> str | None:
    a = t.src[0]
    if not (ggml_packed_rows(a) and a.nb[2] == a.nb[1] * a.ne[1]
            and a.nb[3] == a.nb[2] * a.ne[2]):
        return "ggml_scale needs a padded-1d source (packed rows, dims 2-3 contiguous)"
    return None


def _ggml_scale_cpu(t: Tensor) -> str | None:
    if t.src[0].type not in (T.F32, T.BF16):
        return f"ggml's CPU scale has no {t.src[0].type} kernel (F32, BF16 only)"
    return None


def _ggml_fill_layout(t: Tensor) -> str | None:
    return None if ggml_contiguous_from(t.src[0], 0) else "ggml_fill needs a contiguous tensor"


def _ggml_swiglu_layout(t: Tensor) -> str | None:
    if not (ggml_contiguous_from(t.src[0], 1) and ggml_contiguous_from(t.src[1], 1)):
        return "ggml_swiglu_split needs sources contiguous in dims 1-3"
    return None


def _ggml_swiglu_probe(k: GGMLProbe) -> Any:
    return k.lib.ggml_swiglu_split(k.ctx, k.a, k.a)


def _binary_op(kind: OpKind, symbol: str, ref: Callable, f: Callable[..., Tensor],
               src_labels: bool = False, cdecl: str | None = None) -> None:
    # ggml's CPU binary kernels assert packed rows in a (b may be strided)
    register(OpDef(kind, symbol, _binary_ref(ref), inplace=True, cases=_binary_cases(kind, f),
                   accepts=_floats_2, accepts_why="F32/F16 only", elementwise="binary",
                   ggml=GGMLMap(cpu_limits=ggml_packed_sources(0), cdecl=cdecl),
                   src_labels=src_labels))


def _unary_op(kind: OpKind, symbol: str, ref: Callable, f: Callable[..., Tensor],
              params: type | None = None, ggml: GGMLMap | None = None, **case_kw: Any) -> None:
    register(OpDef(kind, symbol, ref, params, inplace=True,
                   cases=_unary_cases(kind, f, **case_kw), accepts=_floats_in_out,
                   accepts_why="F32/F16 only", elementwise="unary", ggml=ggml or GGMLMap()))


_binary_op(OpKind.ADD, "+", np.add, add)  # ggml_add: ggml_cdefs declares it (its layout check)
_binary_op(OpKind.MUL, "*", np.multiply, mul, cdecl=ggml_fn("ggml_mul", "a", "b"))
_binary_op(OpKind.DIV, "/", np.divide, div, src_labels=True,  # a / b: which is which
           cdecl=ggml_fn("ggml_div", "a", "b"))
_unary_op(OpKind.SCALE, "scale", lambda n, ex: _x(n, ex) * n.params.s + n.params.b, scale,
          ScaleParams, GGMLMap(cdecl=ggml_fn("ggml_scale_bias", "a", "float s", "float b"),
                                build=lambda lib, ctx, t, S: lib.ggml_scale_bias(
              ctx, S[0], t.params.s, t.params.b), limits=_ggml_scale_layout,
              cpu_limits=_ggml_scale_cpu,
              probe=lambda k: k.lib.ggml_scale_bias(k.ctx, k.a, 1.0, 0.0)), s=0.5, b=0.25)
_unary_op(OpKind.CLAMP, "clamp", lambda n, ex: np.clip(_x(n, ex), n.params.min, n.params.max),
          clamp, ClampParams, GGMLMap(cdecl=ggml_fn("ggml_clamp", "a", "float min", "float max"),
                                 build=lambda lib, ctx, t, S: lib.ggml_clamp(
              ctx, S[0], t.params.min, t.params.max),
              cpu_limits=ggml_packed_sources(0),  # its F32 and F16 kernels assert it
              probe=lambda k: k.lib.ggml_clamp(k.ctx, k.a, -1.0, 1.0)), min=-0.3, max=0.6)
_unary_op(OpKind.FILL, "fill", lambda n, ex: np.full(n.shape, n.params.value), fill,
          FillParams, GGMLMap(cdecl=ggml_fn("ggml_fill", "a", "float c"),
                               build=lambda lib, ctx, t, S: lib.ggml_fill(
              ctx, S[0], t.params.value), limits=_ggml_fill_layout,
              probe=lambda k: k.lib.ggml_fill(k.ctx, k.a, 0.0)), value=-2.5)
_unary_op(OpKind.SILU, "silu", lambda n, ex: _silu(_x(n, ex)), silu,
          ggml=GGMLMap.unary("SILU", cdecl=ggml_fn("ggml_silu", "a")))
_unary_op(OpKind.GELU, "gelu", lambda n, ex: 0.5 * _x(n, ex) * (
    1.0 + np.tanh(_GELU_C * _x(n, ex) * (1.0 + 0.044715 * _x(n, ex) ** 2))), gelu,
    ggml=GGMLMap.unary("GELU", cdecl=ggml_fn("ggml_gelu", "a")))
_unary_op(OpKind.SIGMOID, "sigmoid", lambda n, ex: 1.0 / (1.0 + np.exp(-_x(n, ex))), sigmoid,
          ggml=GGMLMap.unary("SIGMOID", cdecl=ggml_fn("ggml_sigmoid", "a")))
_unary_op(OpKind.GELU_QUICK, "gelu_quick",
          lambda n, ex: _x(n, ex) / (1.0 + np.exp(-1.702 * _x(n, ex))), gelu_quick,
          ggml=GGMLMap.unary("GELU_QUICK", cdecl=ggml_fn("ggml_gelu_quick", "a")))
_unary_op(OpKind.TANH, "tanh", lambda n, ex: np.tanh(_x(n, ex)), tanh,
          ggml=GGMLMap.unary("TANH", cdecl=ggml_fn("ggml_tanh", "a")))
register(OpDef(OpKind.SWIGLU, "swiglu", lambda n, ex: _silu(
    ex.read(n.src[0]).astype(np.float64)) * ex.read(n.src[1]).astype(np.float64),
    cases=_swiglu_cases, accepts=_floats_2, accepts_why="F32/F16 only", elementwise="binary",
    ggml=GGMLMap("GLU", "SWIGLU", cdecl=ggml_fn("ggml_swiglu_split", "a", "b"),
                 build=lambda lib, ctx, t, S: lib.ggml_swiglu_split(ctx, *S),
                 limits=_ggml_swiglu_layout, probe=_ggml_swiglu_probe)))
