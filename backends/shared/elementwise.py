"""The element-wise ops of every backend, once: their op codes, the value of one element, and
the walk of a flat element index over a 4-D array.

k_unary and k_binary (backends/cpu/templates.py, backends/cuda/templates.py) take an op code
and call `unary_value` / `binary_value` for each element (`binary_row` for a whole row), compiled into them by
ggraph.backends.jit with the target's `silu`, `gelu` and `sigmoid` (backends/shared/numeric.py).
Everything is float32 in and out: x, y, p0 and p1 are float32 and each formula rounds where
the kernels always have (one float32 operation at a time, in this order).

The op codes are the positions of the ops in the shared kernel rules' lists
(backends/accepts.py: UNARY_OPS, BINARY_OPS), computed here and nowhere else;
backends/shared/kernel_args.py turns a node into its code.
"""
import math

import numpy as np

from ggraph.ir.opkind import OpKind

from ..accepts import BINARY_OPS, UNARY_OPS
from .numeric import gelu, sigmoid, silu

UNARY_CODE = {op: i for i, op in enumerate(UNARY_OPS)}
BINARY_CODE = {op: i for i, op in enumerate(BINARY_OPS)}
# the names the formulas compare with (compiled code reads them as integer constants)
U_SCALE, U_CLAMP, U_FILL = (UNARY_CODE[o] for o in (OpKind.SCALE, OpKind.CLAMP, OpKind.FILL))
U_SILU, U_GELU, U_SIGMOID = (UNARY_CODE[o] for o in (OpKind.SILU, OpKind.GELU, OpKind.SIGMOID))
U_GELU_QUICK, U_TANH = UNARY_CODE[OpKind.GELU_QUICK], UNARY_CODE[OpKind.TANH]
U_SQR, U_SQRT, U_LOG = (UNARY_CODE[o] for o in (OpKind.SQR, OpKind.SQRT, OpKind.LOG))
B_ADD, B_MUL, B_DIV, B_SWIGLU = (BINARY_CODE[o] for o in (OpKind.ADD, OpKind.MUL, OpKind.DIV,
                                                          OpKind.SWIGLU))
B_SUB, B_GEGLU, B_SILU_BACK = (BINARY_CODE[o] for o in (OpKind.SUB, OpKind.GEGLU,
                                                        OpKind.SILU_BACK))
_NAMED = {k: v for k, v in globals().items() if k[:2] in ("U_", "B_")}
if len({v for k, v in _NAMED.items() if k[0] == "U"}) != len(UNARY_OPS) \
        or len({v for k, v in _NAMED.items() if k[0] == "B"}) != len(BINARY_OPS):
    raise ImportError("an element-wise op of backends/accepts.py has no formula here")


def unary_value(op, x, p0, p1):
    """Unary op `op` of x with its parameters: scale x*p0 + p1, clamp x to [p0, p1], fill with
    p0 (x unused), silu, gelu, gelu_quick, tanh, sqr, sqrt, log (ggml: logf, so -inf at 0 and
    NaN below), sigmoid."""
    if op == U_SCALE:
        return x * p0 + p1
    if op == U_CLAMP:
        return min(max(x, p0), p1)
    if op == U_FILL:
        return p0
    if op == U_SILU:
        return silu(x)
    if op == U_GELU:
        return gelu(x)
    if op == U_GELU_QUICK:  # ggml: x * (1 / (1 + expf(-1.702 x))), i.e. x * sigmoid(1.702 x)
        return x * sigmoid(np.float32(1.702) * x)
    if op == U_TANH:
        return math.tanh(x)
    if op == U_SQR:
        return x * x
    if op == U_SQRT:  # NaN below zero, as sqrtf (math.sqrt would raise on the CPU)
        return math.sqrt(x) if x >= 0 else np.float32(np.nan)
    if op == U_LOG:
        if x > 0:
            return math.log(x)
        return np.float32(-np.inf) if x == 0 else np.float32(np.nan)
    return sigmoid(x)


def binary_value(op, x, y):
    """Binary op `op` of x and y: x + y, x - y, x * y, x / y, swiglu silu(x) * y, geglu
    gelu(x) * y, silu_back (x the incoming gradient, y silu's input):
    x * s * (1 + y * (1 - s)), s = sigmoid(y)."""
    if op == B_ADD:
        return x + y
    if op == B_SUB:
        return x - y
    if op == B_MUL:
        return x * y
    if op == B_DIV:
        return x / y
    if op == B_GEGLU:
        return gelu(x) * y
    if op == B_SILU_BACK:
        s = sigmoid(y)
        return x * s * (np.float32(1.0) + y * (np.float32(1.0) - s))
    return silu(x) * y


def unary_row(op, x, p0, p1):
    """x[i] = unary_value(op, x[i], p0, p1) over the row x. The transcendental ops get a loop
    of their own calling their formula directly, so it vectorizes where the formula does (the
    CPU's exp-based silu/gelu/sigmoid: unary_value, all ops in one, is too big to inline into
    a loop), and so does scale; the others share one loop."""
    n = x.shape[0]
    if op == U_GELU:
        for i in range(n):
            x[i] = gelu(x[i])
    elif op == U_SILU:
        for i in range(n):
            x[i] = silu(x[i])
    elif op == U_SIGMOID:
        for i in range(n):
            x[i] = sigmoid(x[i])
    elif op == U_SCALE:  # attention's query scaling: a loop that vectorizes
        for i in range(n):
            x[i] = x[i] * p0 + p1
    else:
        for i in range(n):
            x[i] = unary_value(op, x[i], p0, p1)


def binary_row(op, x, y):
    """x[i] = binary_value(op, x[i], y[i % len(y)]) over the row x (y broadcast). Where y is
    as long as x, no modulo (an integer division per element) and, for swiglu, a loop of its
    own as in unary_row."""
    n, m = x.shape[0], y.shape[0]
    # the four arithmetic ops get loops of their own: binary_value is a call per element where
    # it is not inlined (a decode step's norm weight took 6 us over 1536 floats), and a loop
    # of one operation vectorizes. The values are binary_value's, one float32 operation each.
    if m != n:
        for i in range(n):
            x[i] = binary_value(op, x[i], y[i % m])
    elif op == B_ADD:
        for i in range(n):
            x[i] = x[i] + y[i]
    elif op == B_MUL:
        for i in range(n):
            x[i] = x[i] * y[i]
    elif op == B_SUB:
        for i in range(n):
            x[i] = x[i] - y[i]
    elif op == B_DIV:
        for i in range(n):
            x[i] = x[i] / y[i]
    elif op == B_SWIGLU:
        for i in range(n):
            x[i] = silu(x[i]) * y[i]
    else:
        for i in range(n):
            x[i] = binary_value(op, x[i], y[i])


def unflatten(k, n2, n1, n0):
    """(i3, i2, i1, i0) of flat index k of an (n3, n2, n1, n0) array in numpy order: the walk
    of every grid-stride loop over elements (or over (row, item of the row) with n0 items)."""
    i0 = k % n0
    r = k // n0
    i1 = r % n1
    r //= n1
    return r // n2, r % n2, i1, i0


I32_MAX = 0x7FFFFFFF


def unflatten_i32(k, n2, n1, n0):
    """`unflatten` (a GPU's override, backends/cuda/runtime.py) with 32-bit divisions whenever
    the index and sizes fit (every tensor under 2**31 elements): a GPU divides 64-bit integers
    in software, several times the instructions of a 32-bit division, and element-wise kernels
    divide three times per element. Larger ones take the 64-bit path; the results are the
    same."""
    if k <= I32_MAX and n0 <= I32_MAX and n1 <= I32_MAX and n2 <= I32_MAX:
        k32, m2, m1, m0 = np.int32(k), np.int32(n2), np.int32(n1), np.int32(n0)
        i0 = k32 % m0
        r = k32 // m0
        i1 = r % m1
        r = r // m1
        return np.int64(r // m2), np.int64(r % m2), np.int64(i1), np.int64(i0)
    i0 = k % n0
    r = k // n0
    i1 = r % n1
    r //= n1
    return r // n2, r % n2, i1, i0
