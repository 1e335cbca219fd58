"""Element-wise ops: add, sub, mul, div (b broadcast by modulo), scale, clamp, fill, sqr, sqrt,
log, silu, gelu, sigmoid, tanh, swiglu (silu(gate) * up), geglu (gelu(gate) * up) and
silu_back (silu's gradient), with the backward rules of those that gradients flow through.

The binary ops, scale, clamp, fill and the unary activations may run in place (ggml-alloc's
list in the libggml that llama-cpp-python 0.3.36 ships; older ggml left clamp out); swiglu,
geglu and silu_back may not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from .case import TOL_DEFAULT, Case, case
from .registry import (FLOATS, Backward, GGMLMap, GGMLProbe, OpDef, can_repeat,
                       ggml_contiguous_from, ggml_fn, ggml_packed_rows, ggml_packed_sources,
                       new_node, register, require, require_type, types_ok)
from .views import strided, transpose

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
SUB = OpKind.define("sub", Family.ARITHMETIC)
SQR = OpKind.define("sqr", Family.ARITHMETIC)
SQRT = OpKind.define("sqrt", Family.ARITHMETIC)
LOG = OpKind.define("log", Family.ARITHMETIC)
SILU_BACK = OpKind.define("silu_back", Family.ACTIVATION)
GEGLU = OpKind.define("geglu", Family.ACTIVATION)


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


def sub(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """a - b (ggml_sub)."""
    return _binary(OpKind.SUB, a, b, name)


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


def sqr(a: Tensor, name: str = "") -> Tensor:
    """a * a (ggml_sqr)."""
    return _unary(OpKind.SQR, a, None, name)


def sqrt(a: Tensor, name: str = "") -> Tensor:
    """sqrt(a) (ggml_sqrt; NaN below zero)."""
    return _unary(OpKind.SQRT, a, None, name)


def log(a: Tensor, name: str = "") -> Tensor:
    """Natural log of a (ggml_log; -inf at zero, NaN below)."""
    return _unary(OpKind.LOG, a, None, name)


def _same_shape(kind: OpKind, roles: tuple[str, str], x: Tensor, y: Tensor, name: str,
                same_type: bool = True) -> Tensor:
    """A node of two float sources of one shape (the GLUs, silu_back), typed as the first."""
    op = str(kind)
    (r0, r1), both = roles, {roles[0]: x, roles[1]: y}
    require_type(op, r0, x, FLOAT_TYPES)
    require_type(op, r1, y, FLOAT_TYPES)
    require(x.ne == y.ne, op, f"{r0} and {r1} must have the same shape", **both)
    require(not same_type or x.type == y.type, op, f"{r0} and {r1} must have the same type "
            f"({x.type} and {y.type})", **both)
    return new_node(kind, (x, y), x.type, x.ne, name=name)


def _glu(kind: OpKind, gate: Tensor, up: Tensor, name: str) -> Tensor:
    return _same_shape(kind, ("gate", "up"), gate, up, name)


def swiglu(gate: Tensor, up: Tensor, name: str = "") -> Tensor:
    """silu(gate) * up (ggml_swiglu_split)."""
    return _glu(OpKind.SWIGLU, gate, up, name)


def geglu(gate: Tensor, up: Tensor, name: str = "") -> Tensor:
    """gelu(gate) * up, gelu's tanh approximation (ggml_geglu_split)."""
    return _glu(OpKind.GEGLU, gate, up, name)


def silu_back(grad: Tensor, x: Tensor, name: str = "") -> Tensor:
    """The gradient of silu at x times grad: grad * s * (1 + x * (1 - s)), s = sigmoid(x).
    ggml_silu_back's order: the incoming gradient first, silu's input second."""
    return _same_shape(OpKind.SILU_BACK, ("grad", "x"), grad, x, name, same_type=False)


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


def _pair_cases(kind: OpKind, f: Callable[..., Tensor], f16_tol: float = TOL_DEFAULT
                ) -> Callable[[], Iterator[Case]]:
    """Two same-shape sources (swiglu, geglu, silu_back), and one strided first source."""
    def gen() -> Iterator[Case]:
        for t in (T.F32, T.F16):
            yield case(kind, lambda B, t=t: f(B.inp(t, 64, 5), B.inp(t, 64, 5)),
                       f16_tol if t == T.F16 else TOL_DEFAULT, type=t, ne=[64, 5])
        yield case(kind, lambda B: f(strided(B, T.F32, 16, 5), B.inp(T.F32, 16, 5)),
                   type=T.F32, a="strided")
    return gen


def _positive_cases(kind: OpKind, f: Callable[..., Tensor]) -> Callable[[], Iterator[Case]]:
    """Values in [0.1, 2] (sqrt, log: defined on the positive half-line only)."""
    def gen() -> Iterator[Case]:
        for t in (T.F32, T.F16):
            yield case(kind, lambda B, t=t: f(B.inp(t, 33, 4, 3, lo=0.1, hi=2.0)), type=t,
                       ne=[33, 4, 3])
        yield case(kind, lambda B: f(transpose(B.inp(T.F32, 5, 16, lo=0.1, hi=2.0))),
                   type=T.F32, src="transposed")
    return gen


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


def _ggml_rows_layout(t: Tensor) -> str | None:
    if not (ggml_contiguous_from(t.src[0], 1) and ggml_contiguous_from(t.src[1], 1)):
        return f"ggml's {t.op} needs sources contiguous in dims 1-3"
    return None


def _ggml_swiglu_probe(k: GGMLProbe) -> Any:
    return k.lib.ggml_swiglu_split(k.ctx, k.a, k.a)


def _ggml_geglu_probe(k: GGMLProbe) -> Any:
    return k.lib.ggml_geglu_split(k.ctx, k.a, k.a)


def _binary_op(kind: OpKind, symbol: str, ref: Callable, f: Callable[..., Tensor],
               backward: Backward, src_labels: bool = False, cdecl: str | None = None) -> None:
    # ggml's CPU binary kernels assert packed rows in a (b may be strided)
    register(OpDef(kind, symbol, _binary_ref(ref), inplace=True, cases=_binary_cases(kind, f),
                   accepts=_floats_2, accepts_why="F32/F16 only", elementwise="binary",
                   ggml=GGMLMap(cpu_limits=ggml_packed_sources(0), cdecl=cdecl),
                   src_labels=src_labels, backward=backward))


def _unary_op(kind: OpKind, symbol: str, ref: Callable, f: Callable[..., Tensor],
              backward: Backward | None, params: type | None = None,
              ggml: GGMLMap | None = None, cases: Callable[[], Iterator[Case]] | None = None,
              **case_kw: Any) -> None:
    register(OpDef(kind, symbol, ref, params, inplace=True,
                   cases=cases or _unary_cases(kind, f, **case_kw), accepts=_floats_in_out,
                   accepts_why="F32/F16 only", elementwise="unary", ggml=ggml or GGMLMap(),
                   backward=backward))


def _glu_op(kind: OpKind, symbol: str, ref: Callable, f: Callable[..., Tensor],
            backward: Backward | None, ggml: GGMLMap, f16_tol: float = TOL_DEFAULT) -> None:
    register(OpDef(kind, symbol, _binary_ref(ref), cases=_pair_cases(kind, f, f16_tol),
                   accepts=_floats_2, accepts_why="F32/F16 only", elementwise="binary",
                   ggml=ggml, backward=backward))


# -- backward rules (ops/registry.py: Backward) -------------------------------------------
# g is the F32 gradient of the node; each rule puts g first in a binary op so the share is
# F32 (a binary op takes a's type) whatever the other source's type.

def _reduce_to(g: Tensor, like: Tensor) -> Tensor:
    # ops/reduce.py builds on this module: its ops are reached through the package, whose
    # modules have all loaded by the time a rule runs (no import cycle between the modules)
    from ggraph import ops
    return ops.reduce_to(g, like)


def _bw_add(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    return (g if w[0] else None, _reduce_to(g, n.src[1]) if w[1] else None)


def _bw_sub(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    return (g if w[0] else None, scale(_reduce_to(g, n.src[1]), -1.0) if w[1] else None)


def _bw_mul(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    a, b = n.src
    return (mul(g, b) if w[0] else None, _reduce_to(mul(g, a), b) if w[1] else None)


def _bw_div(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    a, b = n.src  # d(a/b)/db = -a / b^2
    return (div(g, b) if w[0] else None,
            scale(_reduce_to(div(div(mul(g, a), b), b), b), -1.0) if w[1] else None)


def _one(f: Callable[[Tensor, Tensor], Tensor]) -> Backward:
    """The rule of a one-source op whose share is f(node, g)."""
    return lambda n, g, w: (f(n, g) if w[0] else None,)


def _gelu_back(dy: Tensor, x: Tensor) -> Tensor:
    """dy times the exact derivative of gelu's tanh approximation at x:
    0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3k x^2), t = tanh(c x (1 + k x^2))."""
    k = 0.044715
    x2 = sqr(x)
    t = tanh(scale(mul(scale(x2, k, 1.0), x), _GELU_C))
    slope = mul(mul(scale(x, 0.5), scale(sqr(t), -1.0, 1.0)), scale(x2, 3 * k * _GELU_C, _GELU_C))
    return mul(dy, add(scale(t, 0.5, 0.5), slope))


def _bw_swiglu(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    gate, up = n.src
    return (silu_back(mul(g, up), gate) if w[0] else None, mul(g, silu(gate)) if w[1] else None)


def _bw_geglu(n: Tensor, g: Tensor, w: tuple[bool, ...]) -> tuple:
    gate, up = n.src
    return (_gelu_back(mul(g, up), gate) if w[0] else None,
            mul(g, gelu(gate)) if w[1] else None)


def _silu_back_ref(n: Tensor, ex) -> np.ndarray:
    dy, x = (ex.read(s).astype(np.float64) for s in n.src)
    s = 1.0 / (1.0 + np.exp(-x))
    return dy * s * (1.0 + x * (1.0 - s))


def _gelu_ref(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_GELU_C * x * (1.0 + 0.044715 * x ** 2)))


_binary_op(OpKind.ADD, "+", np.add, add, _bw_add)  # ggml_cdefs declares ggml_add
_binary_op(OpKind.MUL, "*", np.multiply, mul, _bw_mul, cdecl=ggml_fn("ggml_mul", "a", "b"))
_binary_op(OpKind.DIV, "/", np.divide, div, _bw_div, src_labels=True,  # a / b: which is which
           cdecl=ggml_fn("ggml_div", "a", "b"))
_unary_op(OpKind.SCALE, "scale", lambda n, ex: _x(n, ex) * n.params.s + n.params.b, scale,
          _one(lambda n, g: scale(g, n.params.s)),
          ScaleParams, GGMLMap(cdecl=ggml_fn("ggml_scale_bias", "a", "float s", "float b"),
                                build=lambda lib, ctx, t, S: lib.ggml_scale_bias(
              ctx, S[0], t.params.s, t.params.b), limits=_ggml_scale_layout,
              cpu_limits=_ggml_scale_cpu,
              probe=lambda k: k.lib.ggml_scale_bias(k.ctx, k.a, 1.0, 0.0)), s=0.5, b=0.25)
# clamp: no rule (its gradient needs a mask of the unclamped elements, which no op makes yet)
_unary_op(OpKind.CLAMP, "clamp", lambda n, ex: np.clip(_x(n, ex), n.params.min, n.params.max),
          clamp, None, ClampParams,
          GGMLMap(cdecl=ggml_fn("ggml_clamp", "a", "float min", "float max"),
                  build=lambda lib, ctx, t, S: lib.ggml_clamp(ctx, S[0], t.params.min,
                                                              t.params.max),
                  cpu_limits=ggml_packed_sources(0),  # its F32 and F16 kernels assert it
                  probe=lambda k: k.lib.ggml_clamp(k.ctx, k.a, -1.0, 1.0)), min=-0.3, max=0.6)
# fill: its value does not depend on a's, so a gets no gradient (and autodiff need not refuse)
_unary_op(OpKind.FILL, "fill", lambda n, ex: np.full(n.shape, n.params.value), fill,
          lambda n, g, w: (None,), FillParams,
          GGMLMap(cdecl=ggml_fn("ggml_fill", "a", "float c"),
                  build=lambda lib, ctx, t, S: lib.ggml_fill(ctx, S[0], t.params.value),
                  limits=_ggml_fill_layout, probe=lambda k: k.lib.ggml_fill(k.ctx, k.a, 0.0)),
          value=-2.5)
_unary_op(OpKind.SILU, "silu", lambda n, ex: _silu(_x(n, ex)), silu,
          _one(lambda n, g: silu_back(g, n.src[0])),
          ggml=GGMLMap.unary("SILU", cdecl=ggml_fn("ggml_silu", "a")))
_unary_op(OpKind.GELU, "gelu", lambda n, ex: _gelu_ref(_x(n, ex)), gelu,
          _one(lambda n, g: _gelu_back(g, n.src[0])),
          ggml=GGMLMap.unary("GELU", cdecl=ggml_fn("ggml_gelu", "a")))
_unary_op(OpKind.SIGMOID, "sigmoid", lambda n, ex: 1.0 / (1.0 + np.exp(-_x(n, ex))), sigmoid,
          _one(lambda n, g: mul(mul(g, n), scale(n, -1.0, 1.0))),  # s (1 - s)
          ggml=GGMLMap.unary("SIGMOID", cdecl=ggml_fn("ggml_sigmoid", "a")))
_unary_op(OpKind.GELU_QUICK, "gelu_quick",
          lambda n, ex: _x(n, ex) / (1.0 + np.exp(-1.702 * _x(n, ex))), gelu_quick, None,
          ggml=GGMLMap.unary("GELU_QUICK", cdecl=ggml_fn("ggml_gelu_quick", "a")))
_unary_op(OpKind.TANH, "tanh", lambda n, ex: np.tanh(_x(n, ex)), tanh,
          _one(lambda n, g: mul(g, scale(sqr(n), -1.0, 1.0))),  # 1 - tanh^2
          ggml=GGMLMap.unary("TANH", cdecl=ggml_fn("ggml_tanh", "a")))
_glu_op(OpKind.SWIGLU, "swiglu", lambda x, y: _silu(x) * y, swiglu, _bw_swiglu,
        GGMLMap("GLU", "SWIGLU", cdecl=ggml_fn("ggml_swiglu_split", "a", "b"),
                build=lambda lib, ctx, t, S: lib.ggml_swiglu_split(ctx, *S),
                limits=_ggml_rows_layout, probe=_ggml_swiglu_probe))
_binary_op(OpKind.SUB, "-", np.subtract, sub, _bw_sub, src_labels=True,
           cdecl=ggml_fn("ggml_sub", "a", "b"))
_unary_op(OpKind.SQR, "sqr", lambda n, ex: _x(n, ex) ** 2, sqr,
          _one(lambda n, g: scale(mul(g, n.src[0]), 2.0)),
          ggml=GGMLMap(cdecl=ggml_fn("ggml_sqr", "a"), cpu_limits=ggml_packed_sources(0)))
_unary_op(OpKind.SQRT, "sqrt", lambda n, ex: np.sqrt(_x(n, ex)), sqrt,
          _one(lambda n, g: scale(div(g, n), 0.5)), cases=_positive_cases(OpKind.SQRT, sqrt),
          ggml=GGMLMap(cdecl=ggml_fn("ggml_sqrt", "a"), cpu_limits=ggml_packed_sources(0)))
_unary_op(OpKind.LOG, "log", lambda n, ex: np.log(_x(n, ex)), log,
          _one(lambda n, g: div(g, n.src[0])), cases=_positive_cases(OpKind.LOG, log),
          ggml=GGMLMap(cdecl=ggml_fn("ggml_log", "a"), cpu_limits=ggml_packed_sources(0)))
_glu_op(OpKind.GEGLU, "geglu", lambda x, y: _gelu_ref(x) * y, geglu, _bw_geglu,
        GGMLMap("GLU", "GEGLU", cdecl=ggml_fn("ggml_geglu_split", "a", "b"),
                build=lambda lib, ctx, t, S: lib.ggml_geglu_split(ctx, *S),
                limits=_ggml_rows_layout, probe=_ggml_geglu_probe),
        f16_tol=1e-6)  # ggml's F16 geglu rounds gelu(gate) to f16 (a table) before the product
# silu_back: no rule of its own (a second derivative)
register(OpDef(OpKind.SILU_BACK, "silu_back", _silu_back_ref, cases=_pair_cases(
    OpKind.SILU_BACK, silu_back), accepts=_floats_2, accepts_why="F32/F16 only",
    elementwise="binary", src_labels=True,
    ggml=GGMLMap(cdecl=ggml_fn("ggml_silu_back", "a", "b"), limits=_ggml_rows_layout)))
