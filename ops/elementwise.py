"""Element-wise ops: add, mul, div (b broadcast by modulo), scale, clamp, fill, silu, gelu,
sigmoid and swiglu (silu(gate) * up).

The binary ops, scale, clamp, fill and the unary activations may run in place (ggml-alloc's
list in the libggml that llama-cpp-python 0.3.36 ships; older ggml left clamp out); swiglu may
not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggraph.opkind import OpKind
from ggraph.tensor import Tensor
from ggraph.types import GGMLType
from .registry import OpDef, can_repeat, new_node, register, require, require_type

FLOAT_TYPES = (GGMLType.F32, GGMLType.F16)


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


register(OpDef(OpKind.ADD, "+", _binary_ref(np.add), inplace=True))
register(OpDef(OpKind.MUL, "*", _binary_ref(np.multiply), inplace=True))
register(OpDef(OpKind.DIV, "/", _binary_ref(np.divide), inplace=True))
register(OpDef(OpKind.SCALE, "scale",
               lambda n, ex: _x(n, ex) * n.params.s + n.params.b, ScaleParams, inplace=True))
register(OpDef(OpKind.CLAMP, "clamp",
               lambda n, ex: np.clip(_x(n, ex), n.params.min, n.params.max), ClampParams,
               inplace=True))
register(OpDef(OpKind.FILL, "fill",
               lambda n, ex: np.full(n.shape, n.params.value), FillParams, inplace=True))
register(OpDef(OpKind.SILU, "silu", lambda n, ex: _silu(_x(n, ex)), inplace=True))
register(OpDef(OpKind.GELU, "gelu", lambda n, ex: 0.5 * _x(n, ex) * (
    1.0 + np.tanh(_GELU_C * _x(n, ex) * (1.0 + 0.044715 * _x(n, ex) ** 2))), inplace=True))
register(OpDef(OpKind.SIGMOID, "sigmoid",
               lambda n, ex: 1.0 / (1.0 + np.exp(-_x(n, ex))), inplace=True))
register(OpDef(OpKind.SWIGLU, "swiglu", lambda n, ex: _silu(
    ex.read(n.src[0]).astype(np.float64)) * ex.read(n.src[1]).astype(np.float64)))
