"""CPU-only replacements for shared scalar math where the hardware or a table beats arithmetic.

f16 -> f32 is on the hot path of every F16 KV-cache read and every quantized block scale
(f32 -> f16 of every cache write and every activation block quantized for the dot products). On
x86 with F16C it is LLVM's `fpext half -> float` (one vcvtph2ps, which vectorizes over a
contiguous row: a K row of the cache converts 8-16 values per instruction); elsewhere a
65536-entry table (256 KiB, a compile-time constant in numba) turns it into one load. The
table is built by numpy's own conversion, and tests check both against the shared arithmetic
version (which the CUDA backend keeps) over all 65536 inputs.
"""
import numpy as np
from llvmlite import ir
from numba import types
from numba import njit
from numba.extending import intrinsic

from ..half import f32_to_half_hw as f32_to_half_f16c, fpext_half, fptrunc_half  # noqa: F401
from ..half import half_to_f32_hw as half_to_f32_f16c  # noqa: F401
from ..shared.bound import bound
from .qvec import FEATURES

# names each binding supplies (backends/shared/bound.py)
f32_to_half = bound("f32_to_half")

HALF_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


F16C = "+f16c" in FEATURES   # else the table


@intrinsic
def _f32_bits(typingctx, i):
    """The float32 whose bits are the low 32 bits of the integer i."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.zext(
                v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(i), codegen


# exp's range reduction and polynomial (the constants of Arm's optimized-routines expf, which
# ggml's vectorized ggml_v_expf uses as well): ~1 ulp, branch-free, so a loop of it vectorizes
_EXP_R = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer
_EXP_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_EXP_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_EXP_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C = tuple(np.float32(float.fromhex(c)) for c in
               ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2",
                "0x1.ffffecp-1"))
_EXP_LO, _EXP_HI = np.float32(-87.33654), np.float32(88.72284)


def expf(x):
    """exp of a float32 in float32 arithmetic, <= 2 ulp (libm's is exact to 0.5): 0 below
    e^-87.3 (the smallest normal), inf above e^88.7, NaN for NaN. The CPU's softmax and flash
    attention take it where they called math.exp in float64, one element at a time. Compile
    it without reassociation (numba fastmath "contract" at most): (y * log2e + R) - R must
    round to an integer."""
    c5, c4, c3, c2, c1 = _EXP_C
    y = min(max(x, _EXP_LO), _EXP_HI)
    n = (y * _EXP_LOG2E + _EXP_R) - _EXP_R
    b = (y - n * _EXP_LN2_HI) - n * _EXP_LN2_LO
    u = b * b
    p = ((c5 * b + c4) * u + (c3 * b + c2)) * u + (c1 * b + np.float32(1.0))
    k = np.int32(n)
    # 2^k as float bits; k = 128 (x near 88.7) as 2^127 * 2, so the product stays finite
    h = k if k < 128 else np.int32(127)
    r = p * _f32_bits((h + 127) << 23)
    if k >= 128:
        r = r * np.float32(2.0)
    if x != x:
        return x
    return r if x >= _EXP_LO else np.float32(0.0)


_expf = njit(fastmath={"contract"})(expf)  # a helper: not cached (backends/cpu/kernels.py)


def silu_expf(x):
    """numeric.silu with expf (a vectorizable loop where libm's exp is a call per element)."""
    return x / (np.float32(1.0) + _expf(-x))


def sigmoid_expf(x):
    return np.float32(1.0) / (np.float32(1.0) + _expf(-x))


def gelu_expf(x):
    """numeric.gelu with tanh(z) = 1 - 2 / (e^2z + 1) through expf (0 at z = 0 and +-1 at the
    ends, inf and 0 included); tanh's error stays below 2^-23 absolute, so 1 + tanh(z), all
    gelu reads, is within an ulp or two."""
    z = np.float32(0.7978845608028654) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    t = np.float32(1.0) - np.float32(2.0) / (_expf(np.float32(2.0) * z) + np.float32(1.0))
    return np.float32(0.5) * x * (np.float32(1.0) + t)


def half_to_f32_table(h):
    return HALF_TABLE[np.int64(h) & 0xFFFF]


def round_half_f16c(x):
    """float32 x rounded to the nearest half (ties to even) and back, as float32."""
    return fpext_half(fptrunc_half(np.float32(x)))


def round_half_soft(x):
    """round_half without F16C: the shared conversions (bound by the target's globals)."""
    return half_to_f32(f32_to_half(x))


def f32_identity(x):
    return np.float32(x)


def rint_np(x):
    """Round half to even by the CPU's own instruction (roundss; a loop of it vectorizes):
    backends/shared/numeric.rint's value for every finite float (the shared one is branches
    and floors, as numba-cuda has no rint), and an infinity or NaN as given."""
    return np.rint(x)


half_to_f32 = half_to_f32_f16c if F16C else half_to_f32_table
# the CPU target's replacements of shared scalar math (backends/jit.py Target overrides)
OVERRIDES = {"half_to_f32": half_to_f32, "silu": silu_expf, "sigmoid": sigmoid_expf,
             "gelu": gelu_expf, "rint": rint_np,
             **({"f32_to_half": f32_to_half_f16c} if F16C else {})}

