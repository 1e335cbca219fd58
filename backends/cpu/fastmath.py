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
from numba.extending import intrinsic

HALF_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def _host_has_f16c() -> bool:
    try:
        import llvmlite.binding as llvm

        return "+f16c" in llvm.get_host_cpu_features().flatten().split(",")
    except (ImportError, AttributeError, RuntimeError, OSError):  # no feature query: the table
        return False


F16C = _host_has_f16c()


def half_to_f32_table(h):
    return HALF_TABLE[np.int64(h) & 0xFFFF]


@intrinsic
def _fpext_half(typingctx, h):
    """IEEE half bits in the low 16 bits of an integer -> float32 (exact; NaN stays NaN)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        w = v.type.width
        i16 = builder.trunc(v, ir.IntType(16)) if w > 16 else (
            builder.zext(v, ir.IntType(16)) if w < 16 else v)
        return builder.fpext(builder.bitcast(i16, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def _fptrunc_half(typingctx, x):
    """float32 -> IEEE half bits (uint16), round to nearest even, inf on overflow."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def half_to_f32_f16c(h):
    return _fpext_half(h)


def f32_to_half_f16c(x):
    """The shared f32_to_half (round to nearest even, inf on overflow, NaN as 0x7E00) in one
    vcvtps2ph: the hardware keeps a NaN's sign and payload, so NaN is canonicalized first."""
    if x != x:
        return np.uint16(0x7E00)
    return _fptrunc_half(np.float32(x))


def round_half_f16c(x):
    """float32 x rounded to the nearest half (ties to even) and back, as float32."""
    return _fpext_half(_fptrunc_half(np.float32(x)))


def round_half_soft(x):
    """round_half without F16C: the shared conversions (bound by the target's globals)."""
    return half_to_f32(f32_to_half(x))  # noqa: F821


half_to_f32 = half_to_f32_f16c if F16C else half_to_f32_table
# the CPU target's replacements of shared scalar math (backends/jit.py Target overrides)
OVERRIDES = {"half_to_f32": half_to_f32, **({"f32_to_half": f32_to_half_f16c} if F16C else {})}

