"""SIMD vector values for numba code on the CPU: the primitives the whole-row dot products of
backends/cpu/qrows.py are written in.

numba has no vector type, so the mat-vec dots used to reduce every 32-element block to a
scalar (a horizontal sum per block) and accumulate in scalar floats. Here a vector is a numba
type (`Vec`) whose data model is an LLVM vector, so numba code can keep one in a local
variable across loop iterations (an 8-lane float accumulator for a whole row, as ggml keeps a
__m256) and pass it between the intrinsics below, each a few LLVM vector instructions:

- loads: `ld32` (32 bytes), `nib32` (16 packed bytes as 32 nibbles), `nib_lo`/`nib_hi`
  (32 bytes' low or high nibbles), `q5_bits` (the fifth bits of Q5_x), `hplane` (the high
  bits of Q5_K's and Q6_K's values from their bit planes);
- integer products: `dot4`/`dot4_off`/`signed_dot` (bytes times bytes summed by 4 to i32,
  vpdpbusd with VNNI), `maddubs` (u8 x s8 pairs summed to i16, x86 vpmaddubsw),
  `madd1`/`madd_s`/`madd_2s` (i16 pairs times 1, one scale, or two scales summed to i32,
  vpmaddwd), `sub16`, `add32`;
- float accumulation: `f8_zero`, `f8_fma` (acc + float(ints) * s), `f8_sum`;
- for the prompt GEMM (backends/cpu/qgemm.py): `dot4_acc` (acc + dot4), `ldf8` (8 floats),
  `f8_blk` (acc + float(ints) * ws * as + wm * am, lane by lane).

With AVX2 (and VNNI) the products are the x86 instructions themselves (llvm.x86.*, for the
host numba compiles for); elsewhere the same sums in portable vector IR. Every value they see stays in
range: weights of at most 6 bits times int8 quants never saturate vpmaddubsw's i16 pairs.
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic, models, register_model


def _host_features() -> set[str]:
    """The features numba compiles for: NUMBA_CPU_FEATURES where set (numba then targets
    those, so the intrinsics chosen here must match; it also lets one host run another
    CPU's code paths: NUMBA_CPU_NAME=znver3 with the AVX-512 features off runs the AVX2
    ones), else the host's."""
    if numba_config.CPU_FEATURES:
        return {f.strip() for f in numba_config.CPU_FEATURES.split(",") if f.strip()}
    try:
        return set(llvm.get_host_cpu_features().flatten().split(","))
    except (AttributeError, RuntimeError, OSError):  # no feature query: portable IR
        return set()


FEATURES = _host_features()
AVX2 = "+avx2" in FEATURES
# vpdpbusd (u8 x s8 products summed by 4 into i32 lanes, one instruction): AVX512-VNNI with
# 256-bit vectors (AVX512VL) or AVX-VNNI; LLVM encodes the one intrinsic for either
VNNI = "+avxvnni" in FEATURES or {"+avx512vnni", "+avx512vl"} <= FEATURES

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_ELEM = {"i8": _I8, "i16": _I16, "i32": _I32, "f32": _F32}


class Vec(types.Type):
    """An LLVM vector of `n` lanes of `kind` (i8, i16, i32, f32) as a numba value."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind
        super().__init__(name=f"Vec{n}x{kind}")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_ELEM[fe_type.kind], fe_type.n))


U8x32, I16x16, I32x8, F32x8 = Vec(32, "i8"), Vec(16, "i16"), Vec(8, "i32"), Vec(8, "f32")
_V8, _V16, _V32 = ir.VectorType(_I8, 16), ir.VectorType(_I16, 16), ir.VectorType(_I8, 32)


def vconst(t, vals):
    return ir.Constant(t, list(vals))


def ptr_at(context, builder, aty, arr, off, t):
    """Pointer to a value of LLVM type t at byte `off` of 1-D uint8 array `arr`."""
    ary = context.make_array(aty)(context, builder, value=arr)
    return builder.bitcast(builder.gep(ary.data, [off]), t.as_pointer())


def load_at(context, builder, sig, args, t, a=0, o=1):
    return builder.load(ptr_at(context, builder, sig.args[a], args[a], args[o], t), align=1)


def splat(context, builder, ty, x, vt):
    """Vector type vt with every lane the scalar x (numba type ty)."""
    x = context.cast(builder, x, ty, {_I8: types.uint8, _I16: types.int16, _I32: types.int32,
                                      _F32: types.float32}[vt.element])
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                                  vconst(ir.VectorType(_I32, vt.count), [0] * vt.count))


def pair_sums(builder, v, n):
    """Sum of adjacent lane pairs of an n-lane vector (n/2 lanes)."""
    ev = vconst(ir.VectorType(_I32, n // 2), range(0, n, 2))
    od = vconst(ir.VectorType(_I32, n // 2), range(1, n, 2))
    return builder.add(builder.shuffle_vector(v, v, ev), builder.shuffle_vector(v, v, od))


def x86_call(builder, name, ret, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, argtys), name)
    return builder.call(fn, args)


def _maddubs(builder, x, y):
    """<16 x i16>: x[2i]*y[2i] + x[2i+1]*y[2i+1], x unsigned and y signed bytes."""
    if AVX2:
        return x86_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16, [_V32, _V32], [x, y])
    w = ir.VectorType(_I16, 32)
    return pair_sums(builder, builder.mul(builder.zext(x, w), builder.sext(y, w)), 32)


def _madd(builder, p, w):
    """<8 x i32>: p[2i]*w[2i] + p[2i+1]*w[2i+1] (signed i16)."""
    if AVX2:
        return x86_call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8), [_V16, _V16],
                    [p, w])
    w32 = ir.VectorType(_I32, 16)
    return pair_sums(builder, builder.mul(builder.sext(p, w32), builder.sext(w, w32)), 16)


def _dot4(builder, x, y, acc=None):
    """<8 x i32>: sums of 4 adjacent products of x (unsigned bytes) and y (signed bytes),
    added to acc (<8 x i32>) where given."""
    v8 = ir.VectorType(_I32, 8)
    if VNNI:
        return x86_call(builder, "llvm.x86.avx512.vpdpbusd.256", v8, [v8, v8, v8],
                    [vconst(v8, [0] * 8) if acc is None else acc, builder.bitcast(x, v8),
                     builder.bitcast(y, v8)])
    d = _madd(builder, _maddubs(builder, x, y), vconst(_V16, [1] * 16))
    return d if acc is None else builder.add(acc, d)


# ---- loads -------------------------------------------------------------------------------

@intrinsic
def ld32(typingctx, arr, off):
    """The 32 bytes of arr from byte off."""
    def codegen(context, builder, sig, args):
        return load_at(context, builder, sig, args, _V32)

    return U8x32(arr, off), codegen


@intrinsic
def nib32(typingctx, arr, off):
    """16 packed bytes from byte off as 32 values: the low nibbles, then the high ones."""
    def codegen(context, builder, sig, args):
        b = load_at(context, builder, sig, args, _V8)
        lo = builder.and_(b, vconst(_V8, [15] * 16))
        hi = builder.lshr(b, vconst(_V8, [4] * 16))
        return builder.shuffle_vector(lo, hi, vconst(ir.VectorType(_I32, 32), range(32)))

    return U8x32(arr, off), codegen


@intrinsic
def nib_lo(typingctx, arr, off):
    """The low nibbles of the 32 bytes from byte off."""
    def codegen(context, builder, sig, args):
        return builder.and_(load_at(context, builder, sig, args, _V32), vconst(_V32, [15] * 32))

    return U8x32(arr, off), codegen


@intrinsic
def nib_hi(typingctx, arr, off):
    """The high nibbles of the 32 bytes from byte off."""
    def codegen(context, builder, sig, args):
        return builder.lshr(load_at(context, builder, sig, args, _V32), vconst(_V32, [4] * 32))

    return U8x32(arr, off), codegen


@intrinsic
def q5_bits(typingctx, x, arr, off):
    """x | 16 where bit j of the little-endian 32-bit word at byte off is set (lane j)."""
    def codegen(context, builder, sig, args):
        w = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                             ir.VectorType(_I8, 4)), align=1)
        spread = builder.shuffle_vector(w, w, vconst(ir.VectorType(_I32, 32),
                                                     [j // 8 for j in range(32)]))
        bit = builder.and_(spread, vconst(_V32, [1 << (j % 8) for j in range(32)]))
        on = builder.icmp_unsigned("!=", bit, vconst(_V32, [0] * 32))
        return builder.or_(args[0], builder.select(on, vconst(_V32, [16] * 32),
                                                   vconst(_V32, [0] * 32)))

    return U8x32(x, arr, off), codegen


@intrinsic
def hplane(typingctx, x, arr, off, s, m):
    """x | (((arr[off + j] >> s) & m) << 4), j < 32: the high bits above a nibble, from a bit
    plane (Q5_K: m = 1) or a 2-bit plane (Q6_K: m = 3) of 32 bytes."""
    def codegen(context, builder, sig, args):
        h = load_at(context, builder, sig, args, _V32, 1, 2)
        sv = splat(context, builder, sig.args[3], args[3], _V32)
        mv = splat(context, builder, sig.args[4], args[4], _V32)
        h = builder.shl(builder.and_(builder.lshr(h, sv), mv), vconst(_V32, [4] * 32))
        return builder.or_(args[0], h)

    return U8x32(x, arr, off, s, m), codegen


# ---- integer products ----------------------------------------------------------------------

@intrinsic
def maddubs(typingctx, x, y):
    """<16 x i16>: sums of adjacent pairs of x (unsigned bytes) times y (signed bytes)."""
    def codegen(context, builder, sig, args):
        return _maddubs(builder, args[0], args[1])

    return I16x16(x, y), codegen


@intrinsic
def maddubs_c(typingctx, c, y):
    """maddubs of the constant byte c in every lane with y: c times y's pair sums."""
    def codegen(context, builder, sig, args):
        return _maddubs(builder, splat(context, builder, sig.args[0], args[0], _V32), args[1])

    return I16x16(c, y), codegen


@intrinsic
def dot4(typingctx, x, y):
    """<8 x i32>: sums of 4 adjacent products of x (unsigned bytes) and y (signed bytes):
    vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without."""
    def codegen(context, builder, sig, args):
        return _dot4(builder, args[0], args[1])

    return I32x8(x, y), codegen


@intrinsic
def dot4_acc(typingctx, acc, x, y):
    """acc + dot4(x, y): one vpdpbusd with VNNI."""
    def codegen(context, builder, sig, args):
        return _dot4(builder, args[1], args[2], args[0])

    return I32x8(acc, x, y), codegen


@intrinsic
def dot4_off(typingctx, x, y, off):
    """dot4 of (x - off) with y, x - off as signed values: dot4(x, y) - off * y's sums."""
    def codegen(context, builder, sig, args):
        o = splat(context, builder, sig.args[2], args[2], _V32)
        return builder.sub(_dot4(builder, args[0], args[1]), _dot4(builder, o, args[1]))

    return I32x8(x, y, off), codegen


@intrinsic
def signed_dot(typingctx, x, y):
    """<8 x i32>: sums of 4 adjacent products of two signed byte vectors (|x| times y with
    x's sign, as ggml's Q8_0 dot does: vpmaddubsw takes an unsigned left side)."""
    def codegen(context, builder, sig, args):
        x, y = args
        zero = vconst(_V32, [0] * 32)
        neg = builder.icmp_signed("<", x, zero)
        ax = builder.select(neg, builder.sub(zero, x), x)
        sy = builder.select(neg, builder.sub(zero, y), y)
        return _dot4(builder, ax, sy)

    return I32x8(x, y), codegen


@intrinsic
def sub16(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])

    return I16x16(a, b), codegen


@intrinsic
def madd1(typingctx, p):
    """<8 x i32>: sums of adjacent i16 pairs."""
    def codegen(context, builder, sig, args):
        return _madd(builder, args[0], vconst(_V16, [1] * 16))

    return I32x8(p), codegen


@intrinsic
def madd_s(typingctx, p, s):
    """<8 x i32>: sums of adjacent i16 pairs times the integer scale s."""
    def codegen(context, builder, sig, args):
        return _madd(builder, args[0], splat(context, builder, sig.args[1], args[1], _V16))

    return I32x8(p, s), codegen


@intrinsic
def madd_2s(typingctx, p, s1, s2):
    """madd_s with scale s1 for the first 8 lanes of p (its first 16 bytes' pairs) and s2 for
    the last 8."""
    def codegen(context, builder, sig, args):
        a = splat(context, builder, sig.args[1], args[1], _V16)
        b = splat(context, builder, sig.args[2], args[2], _V16)
        return _madd(builder, args[0], builder.shuffle_vector(
            a, b, vconst(ir.VectorType(_I32, 16), list(range(8)) + list(range(24, 32)))))

    return I32x8(p, s1, s2), codegen


@intrinsic
def i32_zero(typingctx):
    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(_I32, 8), [0] * 8)

    return I32x8(), codegen


@intrinsic
def add32(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return I32x8(a, b), codegen


# ---- float accumulation --------------------------------------------------------------------

@intrinsic
def f8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(_F32, 8), [0.0] * 8)

    return F32x8(), codegen


@intrinsic
def f8_fma(typingctx, acc, v, s):
    """acc + float(v) * s, lane by lane (v: <8 x i32>, s: a float scalar)."""
    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_F32, 8)
        f = builder.sitofp(args[1], vt)
        return builder.fadd(args[0], builder.fmul(f, splat(context, builder, sig.args[2],
                                                            args[2], vt)))

    return F32x8(acc, v, s), codegen


@intrinsic
def ldf8(typingctx, arr, off):
    """The 8 floats of the float32 array arr from element off."""
    def codegen(context, builder, sig, args):
        return load_at(context, builder, sig, args, ir.VectorType(_F32, 8))

    return F32x8(arr, off), codegen


@intrinsic
def f8_blk(typingctx, acc, v, ws, as_, wm, am):
    """acc + float(v) * (ws * as_) + wm * am, lane by lane (v: <8 x i32>, the rest 8 floats):
    a GEMM's 8 sub-block sums scaled by weight and activation scales, plus their offsets."""
    def codegen(context, builder, sig, args):
        acc, v, ws, as_, wm, am = args
        f = builder.sitofp(v, ir.VectorType(_F32, 8))
        c = ("contract",)  # fused multiply-adds: one rounding fewer, the same on every thread
        acc = builder.fadd(acc, builder.fmul(f, builder.fmul(ws, as_, flags=c), flags=c), flags=c)
        return builder.fadd(acc, builder.fmul(wm, am, flags=c), flags=c)

    return F32x8(acc, v, ws, as_, wm, am), codegen


@intrinsic
def f8_sum(typingctx, acc):
    """The sum of the 8 lanes (in any order: a tree of adds)."""
    def codegen(context, builder, sig, args):
        vt = ir.VectorType(_F32, 8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, vt]),
                                            "llvm.vector.reduce.fadd.v8f32")
        c = builder.call(fn, [ir.Constant(_F32, 0.0), args[0]])
        c.fastmath.add("reassoc")
        return c

    return types.float32(acc), codegen


# -- float dot products in a fixed order --------------------------------------------------------
# A sum written as a loop is vectorized by LLVM only under the fast-math flag reassoc, and then
# in whatever order its passes choose. numba optimizes a parallel kernel's loop body twice when
# it caches the kernel (once on its own, again linked into the kernel's module) but runs the
# once-optimized body in the process that compiled it, so under reassoc one kernel summed in
# two orders: a decode step's attention differed by an ulp between a first run and a warm one,
# enough to change a greedy token (tests/backends/cpu/test_fixed_order.py). These sum in one
# order, fixed here: lane i of the accumulator takes elements i, i + 16, ... by fused
# multiply-adds (each exactly rounded), then the lanes fold in halves.

F32x16 = Vec(16, "f32")
_VF16 = ir.VectorType(_F32, 16)


@intrinsic
def f16_zero(typingctx):
    def codegen(context, builder, sig, args):
        return vconst(_VF16, [0.0] * 16)

    return F32x16(), codegen


@intrinsic
def f16_fma(typingctx, acc, x, xo, y, yo):
    """acc + x[xo:xo+16] * y[yo:yo+16], lane by lane, each a fused multiply-add (x, y: 1-D
    float32 arrays, offsets in elements)."""
    def codegen(context, builder, sig, args):
        acc, x, xo, y, yo = args
        a = builder.load(ptr_at(context, builder, sig.args[1], x, xo, _VF16), align=4)
        b = builder.load(ptr_at(context, builder, sig.args[3], y, yo, _VF16), align=4)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VF16, [_VF16] * 3), "llvm.fma.v16f32")
        return builder.call(fn, [a, b, acc])

    return F32x16(acc, x, xo, y, yo), codegen


@intrinsic
def f16_fold(typingctx, acc):
    """The 16 lanes' sum: lanes i and i + 8 added, then i and i + 4, i + 2, i + 1."""
    def codegen(context, builder, sig, args):
        v, n = args[0], 16
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, vconst(ir.VectorType(_I32, n), range(n)))
            hi = builder.shuffle_vector(v, v, vconst(ir.VectorType(_I32, n), range(n, 2 * n)))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(acc), codegen
