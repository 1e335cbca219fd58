"""IEEE half and bf16 <-> float32 conversions in LLVM instructions, for any numba target: half
as one conversion (F16C's vcvtph2ps / vcvtps2ph on x86 CPUs that have it:
backends/cpu/fastmath.py; cvt.f32.f16 / cvt.rn.f16.f32 on NVIDIA GPUs: backends/cuda/runtime.py),
bf16 as integer operations on a float32's bits (GPUs). Bit for bit the shared software
conversions of backends/shared/numeric.py (round to nearest even, inf on overflow, NaN as
0x7E00 / a quiet NaN), which compute in float64 and stay for targets without these (the CUDA
simulator, CPUs without F16C). tests/backends/shared/test_shared_math.py checks them equal on the
CPU.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _width(builder, v, bits: int):
    """Integer v truncated or zero-extended to `bits` bits."""
    w = v.type.width
    if w == bits:
        return v
    return builder.trunc(v, ir.IntType(bits)) if w > bits else builder.zext(v, ir.IntType(bits))


@intrinsic
def fpext_half(typingctx, h):
    """IEEE half bits in the low 16 bits of an integer -> float32 (exact; NaN stays NaN)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i16 = _width(builder, args[0], 16)
        return builder.fpext(builder.bitcast(i16, ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def fptrunc_half(typingctx, x):
    """float32 -> IEEE half bits (uint16), round to nearest even, inf on overflow."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


def half_to_f32_hw(h):
    """IEEE half bits -> float32 in one conversion."""
    return fpext_half(h)


def f32_to_half_hw(x):
    """The shared f32_to_half (round to nearest even, inf on overflow, NaN as 0x7E00) in one
    instruction (vcvtps2ph, cvt.rn.f16.f32): the hardware keeps a NaN's sign and payload, so NaN
    is canonicalized first."""
    if x != x:
        return np.uint16(0x7E00)
    return fptrunc_half(np.float32(x))


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32 as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, b):
    """The float32 whose IEEE bits are the low 32 bits of integer b."""
    if not isinstance(b, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(_width(builder, args[0], 32), ir.FloatType())

    return types.float32(b), codegen


def bf16_to_f32_hw(h):
    """The shared bf16_to_f32 as a shift and a bit cast (bf16 is float32's upper half)."""
    return bits_f32(np.uint32(h & 0xFFFF) << np.uint32(16))


def f32_to_bf16_hw(x):
    """The shared f32_to_bf16 in integer arithmetic on the float32's bits: round to nearest
    even on the 16 bits dropped (carrying into the exponent as the shared version does, to inf
    above the largest bf16), NaN as a quiet NaN with the sign."""
    b = f32_bits(np.float32(x))
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(np.uint32(0x7FC0) | ((b >> np.uint32(16)) & np.uint32(0x8000)))
    b = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return np.uint16(b >> np.uint32(16))
