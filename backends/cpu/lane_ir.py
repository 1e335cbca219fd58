"""The LLVM side of the row-lane vectors that backends/cpu/qlanes.py's intrinsics build: which
instructions this host has (AVX-512 with or without VNNI, AVX2) and so the lanes per packed
group (R), the vector types, the numba type of a lane vector (`Lanes`: r row lanes for each of c
activation columns) and the numba types the intrinsics return (UB, IL, FL, CF), the shuffles
that split, repeat and join columns' lanes, per-column loads from 2-D arrays, and the byte dot
product (`dot_bytes`) with the instructions it compiles to.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import models, register_model

from .qvec import FEATURES, Vec, vconst, x86_call

AVX512 = {"+avx512f", "+avx512bw", "+avx512vl"} <= FEATURES
AVX2 = "+avx2" in FEATURES
VNNI512 = AVX512 and "+avx512vnni" in FEATURES
VNNI256 = "+avxvnni" in FEATURES or ({"+avx512vnni", "+avx512vl"} <= FEATURES)
# rows per packed group on this host: the i32 lanes of its widest vector (a layout may be
# built and run for the other width too: every intrinsic takes its width from its arguments)
R = 16 if AVX512 else 8
WIDTHS = (8, 16)


I1, I8, I16, I32, I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
F32, F16 = ir.FloatType(), ir.HalfType()


def flavor() -> str:
    """The instructions the products compile to now (part of compiled kernels' names)."""
    return ("vnni512" if VNNI512 else "avx512" if AVX512 else
            "vnni256" if VNNI256 else "avx2" if AVX2 else "ir")


def byte_vec(r):
    return ir.VectorType(I8, 4 * r)


def word_vec(r):
    return ir.VectorType(I16, 2 * r)


def int_vec(r):
    return ir.VectorType(I32, r)


def float_vec(r):
    return ir.VectorType(F32, r)


def lane_width(lit) -> int | None:
    """The lane count a literal argument names (8 or 16), else None (not typed yet)."""
    return lit.literal_value if isinstance(lit, types.IntegerLiteral) and \
        lit.literal_value in WIDTHS else None


def row_lanes(vec) -> int:
    """The lane count of a row vector type (4r bytes, or r lanes of i32/f32)."""
    return vec.n // 4 if vec.kind == "i8" else vec.n


class Lanes(types.Type):
    """An <r * c> LLVM vector: r row lanes for each of c activation columns (column j in lanes
    j r .. j r + r - 1), of i32 or f32."""

    def __init__(self, r: int, c: int, kind: str) -> None:
        self.r, self.c, self.kind = r, c, kind
        super().__init__(name=f"Lanes{r}x{c}{kind}")


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = I32 if fe_type.kind == "i32" else F32
        super().__init__(dmm, fe_type, ir.VectorType(elem, fe_type.r * fe_type.c))


def UB(r):
    """4r weight bytes: 4 of each of r rows (the same for every column)."""
    return Vec(4 * r, "i8")


def IL(r, c=1):
    return Lanes(r, c, "i32")


def FL(r, c=1):
    return Lanes(r, c, "f32")


def CF(c):
    """One float per activation column."""
    return Vec(c, "f32")


def concat(builder, parts):
    """One vector of the equal-length vectors `parts`, in order."""
    while len(parts) > 1:
        nxt = []
        for a, b in zip(parts[0::2], parts[1::2]):
            n = a.type.count
            nxt.append(builder.shuffle_vector(a, b, vconst(ir.VectorType(I32, 2 * n),
                                                           range(2 * n))))
        parts = nxt
    return parts[0]


def split_columns(builder, v, r, c):
    """The c column parts (<r x ..> each) of an <r * c> vector."""
    if c == 1:
        return [v]
    return [builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                   vconst(ir.VectorType(I32, r), range(j * r, j * r + r)))
            for j in range(c)]


def repeat_columns(builder, v, c):
    """An <r> vector repeated for c columns."""
    if c == 1:
        return v
    r = v.type.count
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  vconst(ir.VectorType(I32, r * c), [i % r for i in range(r * c)]))


def splat_lanes(builder, x, r):
    vt = ir.VectorType(x.type, r)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), vconst(ir.VectorType(I32, r),
                                                                           [0] * r))


def per_column(builder, xs, r):
    """<r * c>: scalar xs[j] in every lane of column j."""
    return concat(builder, [splat_lanes(builder, x, r) for x in xs])


def row_ptr(context, builder, aty, arr, row: int, col, colty, t):
    """Pointer to a value of LLVM type t at element `col` (numba type colty) of row `row` of
    the 2-D array arr, whose rows are contiguous (col: a byte offset for uint8 arrays, an
    element index otherwise)."""
    ary = context.make_array(aty)(context, builder, value=arr)
    strides = cgutils.unpack_tuple(builder, ary.strides, 2)
    item = context.get_abi_sizeof(context.get_data_type(aty.dtype))
    off = builder.add(builder.mul(ir.Constant(I64, row), strides[0]),
                      builder.mul(context.cast(builder, col, colty, types.int64),
                                  ir.Constant(I64, item)))
    return builder.inttoptr(builder.add(builder.ptrtoint(ary.data, I64), off), t.as_pointer())


def column_loads(context, builder, sig, args, a, o, t, c):
    """The value of type t at element args[o] of each of the first c rows of array args[a]."""
    return [builder.load(row_ptr(context, builder, sig.args[a], args[a], j, args[o], sig.args[o],
                                 t),
                         align=1) for j in range(c)]


def byte_dot(r: int) -> str:
    """How `dpb` sums r-row lanes on this host: "vnni" (vpdpbusd, i32 sums), "pmadd"
    (vpmaddubsw + vpmaddwd: i16 pairs, which saturate above 2 * 127 * 127) or "ir" (portable,
    i32 products). Read when a kernel compiles, as the flags are."""
    if VNNI512 if r == 16 else VNNI256:
        return "vnni"
    return "pmadd" if (AVX512 if r == 16 else AVX2) else "ir"


def bytes_exact(r: int) -> bool:
    """Whether `dpb` over r-row lanes sums unsigned bytes up to 255 times int8 quants exactly:
    quants that reach 128..255 may be packed (qpack.packable), and a high nibble can be
    dotted where it lies, as 16 times its value (`hi4x`): one vpand instead of a byte shift,
    which x86 lacks (LLVM emits vgf2p8affineqb with GFNI, vpsrlw + vpand without)."""
    return byte_dot(r) != "pmadd"


def dot_bytes(builder, acc, x, y, r):
    """acc + sums of 4 adjacent products of x (unsigned bytes) and y (signed bytes), both
    <4r x i8>, per i32 lane."""
    vb, vw, vi = byte_vec(r), word_vec(r), int_vec(r)
    xi, yi = builder.bitcast(x, vi), builder.bitcast(y, vi)
    kind = byte_dot(r)
    if kind == "vnni":
        name = "llvm.x86.avx512.vpdpbusd." + ("512" if r == 16 else "256")
        return x86_call(builder, name, vi, [vi] * 3, [acc, xi, yi])
    if kind == "pmadd":
        ub, wd = (("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if r == 16
                  else ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"))
        p = x86_call(builder, ub, vw, [vb, vb], [x, y])
        d = x86_call(builder, wd, vi, [vw, vw], [p, vconst(vw, [1] * (2 * r))])
    else:  # portable IR: widen, multiply, sum lanes by 4
        w = ir.VectorType(I32, 4 * r)
        prod = builder.mul(builder.zext(x, w), builder.sext(y, w))
        d = None
        for k in range(4):
            part = builder.shuffle_vector(prod, prod, vconst(vi, range(k, 4 * r, 4)))
            d = part if d is None else builder.add(d, part)
    return builder.add(acc, d)


def byte_splat(c: int, r: int):
    return vconst(byte_vec(r), [c] * (4 * r))



def literal_int(x) -> int | None:
    return x.literal_value if isinstance(x, types.IntegerLiteral) else None
