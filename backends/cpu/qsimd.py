"""CPU versions of the integer block sums of backends/shared/qdot.py, written as LLVM vector IR.

The shared helpers (`_isum_i8`, `_isum_nib`, `_isum_nib_h`, `_isum_q4`, `_isum_q5`, `_sum_i8`) sum the
products of k weight values (bit fields of stored bytes) with k int8 activation quants. As
plain loops of 16 or 32 iterations LLVM either unrolls them and vectorizes the block loop around
them with gathers, or vectorizes them with runtime trip-count checks and 64-bit products
(numba widens int32 arithmetic). Here each is one straight-line vector expression on
<k x i8> loads: widen, shift/mask the fields, multiply, `llvm.vector.reduce.add`; LLVM's
x86 backend turns the i16-range multiply-add into vpmaddwd (or vpdpbusd/vpdpwssd with VNNI)
and the reduction into a few shuffles. Same arguments and results as the shared versions (the
tests compare them on random bytes); the CPU target binds these in their place
(Target overrides), the CUDA target compiles the shared loops.

k must be a literal at the call site (16 or 32: the vector length); every offset is a byte
offset into a 1-D uint8 array whose bytes are contiguous (a row of a block type).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _lanes(k) -> int | None:
    return k.literal_value if isinstance(k, types.IntegerLiteral) and \
        k.literal_value in (8, 16, 32, 64) else None


def _bytes(context, builder, aty, arr, off, k: int):
    """<k x i8>: the k bytes of 1-D uint8 array `arr` from byte `off` (unaligned load)."""
    ary = context.make_array(aty)(context, builder, value=arr)
    p = builder.gep(ary.data, [off])
    vt = ir.VectorType(_I8, k)
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)


def _vec(k: int, values) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I16, k), list(values))


def _splat(context, builder, ty, x, k: int):
    """<k x i16> of scalar x (numba type ty)."""
    vt = ir.VectorType(_I16, k)
    x = context.cast(builder, x, ty, types.int16)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, k), [0] * k))


def _dot(builder, v16, y8, k: int):
    """sum_j v16[j] * y8[j] (i16 weights, int8 quants) as an int64: i32 products of values in
    i16 range (vpmaddwd) and one reduction."""
    wt = ir.VectorType(_I32, k)
    prod = builder.mul(builder.sext(v16, wt), builder.sext(y8, wt))
    fnty = ir.FunctionType(_I32, [wt])
    fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.add.v{k}i32")
    return builder.sext(builder.call(fn, [prod]), _I64)


def _field(context, builder, sig, args, k, a, ao, s, lm):
    """((a[ao + j] >> s) & lm) for j < k, as <k x i16>."""
    va = builder.zext(_bytes(context, builder, sig.args[a], args[a], args[ao], k),
                      ir.VectorType(_I16, k))
    sh = _splat(context, builder, sig.args[s], args[s], k)
    return builder.and_(builder.lshr(va, sh), _splat(context, builder, sig.args[lm], args[lm], k))


def _nibbles(context, builder, aty, arr, off):
    """The 32 values of 16 packed bytes: low nibbles then high nibbles, as <32 x i16>."""
    b = _bytes(context, builder, aty, arr, off, 16)
    b = builder.shuffle_vector(b, ir.Constant(ir.VectorType(_I8, 16), ir.Undefined),
                               ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
    v = builder.zext(b, ir.VectorType(_I16, 32))
    return builder.and_(builder.lshr(v, _vec(32, [0] * 16 + [4] * 16)), _vec(32, [15] * 32))


def _minus_dot(context, builder, sig, args, k, v, off, b, bo):
    """sum_j (v_j - off) * int8(b[bo + j])."""
    v = builder.sub(v, _splat(context, builder, sig.args[off], args[off], k))
    return _dot(builder, v, _bytes(context, builder, sig.args[b], args[b], args[bo], k), k)


@intrinsic
def isum_i8(typingctx, a, ao, b, bo, k):
    """sum_j int8(a[ao + j]) * int8(b[bo + j]), j < k."""
    n = _lanes(k)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        x = builder.sext(_bytes(context, builder, sig.args[0], args[0], args[1], n),
                         ir.VectorType(_I16, n))
        return _dot(builder, x, _bytes(context, builder, sig.args[2], args[2], args[3], n), n)

    return types.int64(a, ao, b, bo, k), codegen


@intrinsic
def sum_i8(typingctx, b, bo, k):
    """sum_j int8(b[bo + j]), j < k."""
    n = _lanes(k)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        wt = ir.VectorType(_I32, n)
        v = builder.sext(_bytes(context, builder, sig.args[0], args[0], args[1], n), wt)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [wt]),
                                            f"llvm.vector.reduce.add.v{n}i32")
        return builder.sext(builder.call(fn, [v]), _I64)

    return types.int64(b, bo, k), codegen


@intrinsic
def isum_nib(typingctx, a, ao, s, lm, off, b, bo, k):
    """sum_j (((a[ao + j] >> s) & lm) - off) * int8(b[bo + j]), j < k."""
    n = _lanes(k)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        v = _field(context, builder, sig, args, n, 0, 1, 2, 3)
        return _minus_dot(context, builder, sig, args, n, v, 4, 5, 6)

    return types.int64(a, ao, s, lm, off, b, bo, k), codegen


@intrinsic
def isum_nib_h(typingctx, a, ao, s, lm, h, ho, hs, hm, up, off, b, bo, k):
    """sum_j ((((a[ao+j] >> s) & lm) | (((h[ho+j] >> hs) & hm) << up)) - off) * int8(b[bo+j])."""
    n = _lanes(k)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        lo = _field(context, builder, sig, args, n, 0, 1, 2, 3)
        hi = _field(context, builder, sig, args, n, 4, 5, 6, 7)
        hi = builder.shl(hi, _splat(context, builder, sig.args[8], args[8], n))
        return _minus_dot(context, builder, sig, args, n, builder.or_(lo, hi), 9, 10, 11)

    return types.int64(a, ao, s, lm, h, ho, hs, hm, up, off, b, bo, k), codegen


@intrinsic
def isum_q4(typingctx, a, ao, off, b, bo):
    """sum_j<16 ((a[ao+j] & 15) - off) * int8(b[bo+j]) + ((a[ao+j] >> 4) - off) * int8(b[bo+16+j])
    (a 32-element block of packed nibbles: Q4_0, Q4_1)."""
    def codegen(context, builder, sig, args):
        v = _nibbles(context, builder, sig.args[0], args[0], args[1])
        return _minus_dot(context, builder, sig, args, 32, v, 2, 3, 4)

    return types.int64(a, ao, off, b, bo), codegen


@intrinsic
def isum_q5(typingctx, a, ao, qh, off, b, bo):
    """isum_q4 with bit j of the 32-bit qh as bit 4 of value j (Q5_0, Q5_1)."""
    def codegen(context, builder, sig, args):
        v = _nibbles(context, builder, sig.args[0], args[0], args[1])
        wt = ir.VectorType(_I32, 32)
        word = context.cast(builder, args[2], sig.args[2], types.int32)
        w = builder.insert_element(ir.Constant(wt, ir.Undefined), word, ir.Constant(_I32, 0))
        w = builder.shuffle_vector(w, ir.Constant(wt, ir.Undefined), ir.Constant(wt, [0] * 32))
        bits = builder.and_(builder.lshr(w, ir.Constant(wt, list(range(32)))),
                            ir.Constant(wt, [1] * 32))
        bits = builder.trunc(bits, ir.VectorType(_I16, 32))
        v = builder.or_(v, builder.shl(bits, _vec(32, [4] * 32)))
        return _minus_dot(context, builder, sig, args, 32, v, 3, 4, 5)

    return types.int64(a, ao, qh, off, b, bo), codegen


def _pair_scaled(context, builder, sig, args, a, ao, sc1, sc2):
    """The 64 values of 32 packed bytes (low nibbles then high nibbles), the low ones times
    sc1 and the high ones times sc2, as <64 x i16> (|value| <= 15 * 63: no i16 overflow)."""
    b = _bytes(context, builder, sig.args[a], args[a], args[ao], 32)
    b = builder.shuffle_vector(b, ir.Constant(ir.VectorType(_I8, 32), ir.Undefined),
                               ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
    v = builder.zext(b, ir.VectorType(_I16, 64))
    v = builder.and_(builder.lshr(v, _vec(64, [0] * 32 + [4] * 32)), _vec(64, [15] * 64))
    s1 = _splat(context, builder, sig.args[sc1], args[sc1], 64)
    s2 = _splat(context, builder, sig.args[sc2], args[sc2], 64)
    mask = ir.Constant(ir.VectorType(ir.IntType(1), 64), [1] * 32 + [0] * 32)
    return builder.mul(v, builder.select(mask, s1, s2))


@intrinsic
def isum_q4k(typingctx, a, ao, sc1, sc2, b, bo):
    """sum_j<32 sc1 * (a[ao+j] & 15) * int8(b[bo+j]) + sc2 * (a[ao+j] >> 4) * int8(b[bo+32+j])
    (a Q4_K sub-block pair with its two 6-bit scales: one reduction per 64 elements)."""
    def codegen(context, builder, sig, args):
        v = _pair_scaled(context, builder, sig, args, 0, 1, 2, 3)
        return _dot(builder, v, _bytes(context, builder, sig.args[4], args[4], args[5], 64), 64)

    return types.int64(a, ao, sc1, sc2, b, bo), codegen


@intrinsic
def f32_row(typingctx, row, o):
    """The little-endian float32 at byte o of a uint8 row (one unaligned load)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        p = builder.gep(ary.data, [context.cast(builder, args[1], sig.args[1], types.intp)])
        return builder.load(builder.bitcast(p, ir.FloatType().as_pointer()), align=1)

    return types.float32(row, o), codegen


# shared helper name -> its CPU version (backends/jit.py Target overrides)
OVERRIDES = {"_isum_i8": isum_i8, "_sum_i8": sum_i8, "_isum_nib": isum_nib,
             "_isum_nib_h": isum_nib_h, "_isum_q4": isum_q4, "_isum_q5": isum_q5, "_isum_q4k": isum_q4k,
             "_f32_row": f32_row}
