"""The scalar math shared by the backends (backends/shared/numeric.py) against numpy over
every f16 and bf16 bit pattern, both as the shared arithmetic (what CUDA compiles) and as the
CPU target's compiled functions (where f16 -> f32 is a table); the element-wise formulas, op
codes and index walk (shared/elementwise.py) and the kernel arguments (shared/kernel_args.py)."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from ggraph import Context, build_graph, ops

from ggraph.codecs import quants
from ggraph.backends import accepts
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.cpu.kernels import TARGET
from ggraph.backends.jit import Target
from ggraph.backends.shared import elementwise as E, kernel_args as KA
from ggraph.ir.opkind import OpKind

ALL16 = np.arange(65536, dtype=np.uint16)
SHARED = Target("shared-arith", numba.njit(cache=True))


def _map(fn, xs, out_dtype):
    @numba.njit
    def run(xs, out):
        for i in range(xs.size):
            out[i] = fn(xs[i])
    out = np.zeros(xs.size, out_dtype)
    run(xs, out)
    return out


def _floats():
    rng = np.random.default_rng(0)
    f16 = ALL16.view(np.float16).astype(np.float32)
    return np.concatenate([f16[~np.isnan(f16)], rng.normal(0, 1e3, 50000),
                           rng.uniform(-1e-4, 1e-4, 50000), [0.0, -0.0, 65519.0, 65520.0, 1e9,
                                                             -np.inf, np.inf]]).astype(np.float32)


@pytest.mark.parametrize("target", [SHARED, TARGET], ids=["shared", "cpu"])
def test_half_to_f32_all_patterns(target):
    got = _map(target.fn("half_to_f32"), ALL16, np.float32)
    ref = ALL16.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan], ref[~nan]) and np.isnan(got[nan]).all()


def test_f32_to_half_rounds_like_numpy():
    x = _floats()
    got = _map(SHARED.fn("f32_to_half"), x, np.uint16)
    with np.errstate(over="ignore"):  # 65520 and above round to inf, as intended
        ref = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, ref)


def test_bf16_both_ways():
    ref = quants.bf16_bits_to_f32(ALL16)
    got = _map(SHARED.fn("bf16_to_f32"), ALL16, np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan], ref[~nan]) and np.isnan(got[nan]).all()
    x = _floats()
    assert np.array_equal(_map(SHARED.fn("f32_to_bf16"), x, np.uint16), quants.f32_to_bf16_bits(x))


def test_bit_level_conversions_equal_the_shared_ones():
    """backends/half.py (the GPU's f16/bf16 conversions, and the CPU's F16C ones) against the
    shared float64 versions, compiled for the CPU: every half and bf16 pattern, and floats
    around every rounding tie of bf16, NaN, inf, subnormals and the largest values."""
    from ggraph.backends import half

    for name, fn in (("half_to_f32", half.half_to_f32_hw), ("bf16_to_f32", half.bf16_to_f32_hw)):
        got, ref = _map(numba.njit(fn), ALL16, np.float32), _map(SHARED.fn(name), ALL16,
                                                                 np.float32)
        assert np.array_equal(got.view(np.uint32)[~np.isnan(ref)],
                              ref.view(np.uint32)[~np.isnan(ref)]), name
        assert np.isnan(got[np.isnan(ref)]).all(), name
    hi = np.arange(65536, dtype=np.uint32) << 16
    x = np.concatenate([_specials(), (hi | 0x8000).view(np.float32),
                        (hi | 0x7FFF).view(np.float32), (hi | 0x8001).view(np.float32)])
    for name, fn in (("f32_to_half", half.f32_to_half_hw), ("f32_to_bf16", half.f32_to_bf16_hw)):
        with np.errstate(over="ignore", invalid="ignore"):
            assert np.array_equal(_map(numba.njit(fn), x, np.uint16),
                                  _map(SHARED.fn(name), x, np.uint16)), name


# -- element-wise formulas, op codes, index walk, kernel arguments (shared/elementwise.py,
#    shared/kernel_args.py) -----------------------------------------------------------------

def _specials() -> np.ndarray:
    x = _floats()[::7].copy()
    return np.concatenate([x, [np.nan, -np.nan, 0.0, -0.0, 1e-45, -1e-45, 3.4e38]]).astype(
        np.float32)


def test_op_codes_are_the_shared_rules_positions():
    assert list(E.UNARY_CODE) == list(accepts.UNARY_OPS)
    assert list(E.BINARY_CODE) == list(accepts.BINARY_OPS)
    assert sorted(E.UNARY_CODE.values()) == list(range(len(accepts.UNARY_OPS)))
    assert (E.U_SCALE, E.U_FILL, E.B_ADD, E.B_SWIGLU) == (
        E.UNARY_CODE[OpKind.SCALE], E.UNARY_CODE[OpKind.FILL], E.BINARY_CODE[OpKind.ADD],
        E.BINARY_CODE[OpKind.SWIGLU])


@numba.njit
def _unary_all(fn, op, x, p0, p1, out):
    for i in range(x.size):
        out[i] = fn(op, x[i], p0, p1)


@numba.njit
def _binary_all(fn, op, x, y, out):
    for i in range(x.size):
        out[i] = fn(op, x[i], y[i])


@pytest.mark.parametrize("op", accepts.UNARY_OPS, ids=str)
def test_unary_value_compiled_for_the_cpu(op):
    """Each code picks its formula, in float32 with the kernels' rounding points (the same
    bits as numpy's float32 arithmetic for the linear ops)."""
    x = _specials()
    p0, p1 = np.float32(-0.75), np.float32(1.25)
    got = np.zeros_like(x)
    _unary_all(TARGET.fn("unary_value"), E.UNARY_CODE[op], x, p0, p1, got)
    with np.errstate(all="ignore"):
        if op == OpKind.SCALE:
            ref = x * p0 + p1
        elif op == OpKind.CLAMP:
            ref = np.where(np.isnan(x), x, np.minimum(np.maximum(x, p0), p1))
        elif op == OpKind.FILL:
            ref = np.full_like(x, p0)
        elif op == OpKind.GELU_QUICK:  # ggml's x / (1 + exp(-1.702 x)), the target's sigmoid
            sig = TARGET.fn("sigmoid")
            ref = _map(numba.njit(lambda v: v * sig(np.float32(1.702) * v)), x, np.float32)
        elif op == OpKind.TANH:
            ref = _map(numba.njit(lambda v: math.tanh(v)), x, np.float32)
        elif op == OpKind.SQR:
            ref = x * x
        elif op == OpKind.SQRT:
            ref = np.sqrt(x)
        elif op == OpKind.LOG:  # logf: -inf at 0, NaN below (numpy's float32 log is 1 ulp off)
            pos = np.where(x > 0, x, np.float32(1))
            ref = np.where(x > 0, _map(numba.njit(lambda v: math.log(v)), pos, np.float32),
                           np.where(x == 0, np.float32(-np.inf), np.float32(np.nan)))
        else:
            ref = _map(TARGET.fn(op.value), x, np.float32)
    assert got.dtype == np.float32
    assert np.array_equal(got, ref, equal_nan=True)


@pytest.mark.parametrize("op", accepts.BINARY_OPS, ids=str)
def test_binary_value_compiled_for_the_cpu(op):
    """x / 0 is inf or NaN (IEEE, as ggml), never an exception, in serial kernels too."""
    x = _specials()
    y = np.roll(x, 3)
    y[:4] = 0.0
    got = np.zeros_like(x)
    _binary_all(TARGET.fn("binary_value"), E.BINARY_CODE[op], x, y, got)
    with np.errstate(all="ignore"):
        sig = _map(TARGET.fn("sigmoid"), y, np.float32)
        one = np.float32(1.0)
        ref = {OpKind.ADD: lambda: x + y, OpKind.MUL: lambda: x * y, OpKind.DIV: lambda: x / y,
               OpKind.SUB: lambda: x - y,
               OpKind.SWIGLU: lambda: _map(TARGET.fn("silu"), x, np.float32) * y,
               OpKind.GEGLU: lambda: _map(TARGET.fn("gelu"), x, np.float32) * y,
               # silu_back(dy, x): dy * s * (1 + x (1 - s)), s = sigmoid(x)
               OpKind.SILU_BACK: lambda: x * sig * (one + y * (one - sig))}[op]()
    assert np.array_equal(got, ref, equal_nan=True)


def test_unflatten_is_numpy_order():
    f = TARGET.fn("unflatten")

    @numba.njit
    def walk(n2, n1, n0, total, out):
        for k in range(total):
            i3, i2, i1, i0 = f(k, n2, n1, n0)
            out[k, 0], out[k, 1], out[k, 2], out[k, 3] = i3, i2, i1, i0

    for shape in ((2, 3, 4, 5), (1, 1, 1, 7), (3, 1, 2, 1)):
        total = int(np.prod(shape))
        ref = np.stack(np.unravel_index(np.arange(total), shape), axis=1)
        got = np.zeros((total, 4), np.int64)
        walk(shape[1], shape[2], shape[3], total, got)
        assert np.array_equal(got, ref)
        assert [E.unflatten(k, *shape[1:]) for k in range(total)] == [tuple(r) for r in ref]


def test_unflatten_i32_equals_unflatten():
    """The GPU's 32-bit walk (a compiled override) gives the shared walk's indices, at the
    edges of the 32-bit range and past it (where it takes the 64-bit path)."""
    fast, ref = numba.njit(E.unflatten_i32), numba.njit(E.unflatten)
    big = 2 ** 31
    for n2, n1, n0 in ((3, 4, 5), (1, 1, 7), (2, 3, big // 6 + 1), (big + 3, 1, 2),
                       (5, 7, 3 * big)):
        total = (n2 * n1 * n0) * 2
        for k in {0, 1, n0 - 1, n0, big - 2, big - 1, big, big + 1, total - 1,
                  total // 3}:
            if 0 <= k < total:
                assert fast(k, n2, n1, n0) == ref(k, n2, n1, n0) == E.unflatten(k, n2, n1,
                                                                                    n0), k


def test_kernel_args_from_params():
    ctx = Context()
    a = ctx.new_tensor("f32", (8, 3, 2))
    assert KA.unary_args(ops.scale(a, 2.5, -1.0)) == (E.U_SCALE, 2.5, -1.0)
    assert KA.unary_args(ops.clamp(a, -1.0, 3.0)) == (E.U_CLAMP, -1.0, 3.0)
    assert KA.unary_args(ops.fill(a, 0.1))[1] == np.float32(0.1)
    assert all(type(v) is np.float32 for v in KA.unary_args(ops.silu(a))[1:])
    assert KA.binary_args(ops.swiglu(a, a)) == (E.B_SWIGLU,)
    assert KA.argsort_args(ops.top_k(a, 3)) == (True, 3)
    assert KA.argsort_args(ops.argsort(a)) == (False, 8)
    pos = ctx.new_tensor("i32", (2,))
    r = KA.rope_args(ops.rope_ext(a, pos, n_dims=8, mode=2, n_ctx_orig=4096, ext_factor=1.0))
    assert r[:2] == (8, True) and all(type(v) is float for v in r[2:])
    assert 0.0 <= r[6] <= r[7] <= 7.0


def test_small_and_large_division_by_zero_agree():
    """A node small enough for the serial kernel divides by zero as the parallel one does."""
    for n in (8, 1 << 17):
        ctx = Context()
        x = ctx.new_tensor("f32", (n,), name="x").set_input()
        y = ctx.new_tensor("f32", (n,), name="y").set_input()
        out = ops.div(x, y)
        out.set_output()
        g = build_graph(out)
        xv = np.ones(n, np.float32)
        xv[1] = 0.0
        got = CPUBackend().session().run(g, {x: xv, y: np.zeros(n, np.float32)}).read(out)
        assert np.isinf(got.ravel()[0]) and np.isnan(got.ravel()[1])


def test_cpu_rint_equals_the_shared_rint():
    """The CPU binds rint to its rounding instruction (fastmath.OVERRIDES: the quantizers'
    loops vectorize); on finite floats it is the shared rint exactly, ties to even included."""
    from ggraph.backends.shared import numeric

    rng = np.random.default_rng(7)
    x = np.concatenate([
        np.arange(-300, 300, 0.25, dtype=np.float32),            # every tie in range
        rng.standard_normal(100_000).astype(np.float32) * 200,
        np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 8388607.5, -8388607.5, 1e9, -1e9,
                  np.nextafter(np.float32(0.5), np.float32(0)), 0.0, -0.0], np.float32)])
    got = _map(TARGET.fn("rint"), x, np.float64)
    want = _map(numba.njit(numeric.rint), x, np.float64)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", ["silu", "sigmoid", "gelu"])
def test_cpu_exp_based_activations_near_the_shared_formulas(name):
    """The CPU binds silu, sigmoid and gelu through its float32 expf (fastmath.OVERRIDES: loops
    of them vectorize); they stay within 1e-6 of the shared formulas (libm exp and tanh),
    relative to max(1, |value|), with the same inf/NaN behaviour."""
    from ggraph.backends.shared import numeric

    with np.errstate(all="ignore"):
        x = np.concatenate([np.linspace(-30, 30, 200_001, dtype=np.float32), _specials()])
    got = _map(TARGET.fn(name), x, np.float32)
    want = _map(numba.njit(getattr(numeric, name)), x, np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)])
    err = np.abs(got[finite] - want[finite]) / np.maximum(1.0, np.abs(want[finite]))
    assert err.max() <= 1e-6, (name, float(err.max()), x[finite][np.argmax(err)])
