"""Vectors whose lanes are weight rows: the primitives of the CPU's decode mat-vec over packed
weights (backends/cpu/qpack.py, backends/cpu/qtiles.py).

In the packed layout (qpack.py) R rows of a weight are interleaved by 4 bytes, so one load of
4R bytes holds 4 consecutive quant bytes of each of R rows, and one vpdpbusd against the
activation's 4 matching int8 quants, broadcast to every lane, adds 4 products to each row's
32-bit lane. A row's whole dot is then built in its own lane: no horizontal sum per row, each
activation load serves R rows, and per-row scales are loaded as vectors of R. R is 16 where
the host has AVX-512 (BW, VL: 512-bit vectors), else 8 (256-bit, AVX2 or portable IR); the
intrinsics that make a vector take the lane count as a literal (`r`), the others take it from
their vector arguments, so one layout width can be compiled and tested on any host.

- quants: `ldq` (4r bytes), `lo4`/`hi4` (nibbles; `hi4x` + `lnib`: high nibbles dotted where
  they lie, as 16 times their value, where the dot allows: `bytes_exact`), `bit5` (a fifth
  bit from a bit mask: Q5_0/Q5_1/Q5_K), `hi2` (2 high bits from a 2-bit plane: Q6_K), `lut16`
  (a 16-entry table lookup of nibbles: IQ4_XS);
- integer products: `dpb` (acc + 4-byte dot with a broadcast activation dword, vpdpbusd with
  VNNI, vpmaddubsw + vpmaddwd without), `dpw` (acc + 2 widened bytes per lane times a broadcast
  pair of i16 activation sums, vpdpwssd with VNNI), `lmul` (acc times R per-row bytes), `lsub`,
  `ladd`, `lzero`;
- floats: `fzero`, `ldh` (R f16 row scales), `ffma`/`ffms` (acc +/- float(ints) *
  (scales * s)), `fmas` (acc + scales * s), `cf32`/`cf16` (each column's float), `fadd`,
  `fload`/`fstore` (R lanes of each column from/to a 2-D float array).

The memory side (prefetch per CPU, an unaligned word load, the threads' work counter) is
qmem.py's.

Every offset is a byte offset into a 1-D uint8 array (an element offset for `fstore`'s
float32 array). Values stay in range: weights of at most 8 bits (unsigned) times int8 quants
summed by 4 in i32; without VNNI, vpmaddubsw's i16 pairs saturate above 127 * 127 * 2, so
weights above 127 are only packed where VNNI is present (qpack.py's Pack.full_u8).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from numba.extending import models, register_model

from .qvec import FEATURES, Vec, load_at, ptr_at, vconst, x86_call

AVX512 = {"+avx512f", "+avx512bw", "+avx512vl"} <= FEATURES
AVX2 = "+avx2" in FEATURES
VNNI512 = AVX512 and "+avx512vnni" in FEATURES
VNNI256 = "+avxvnni" in FEATURES or ({"+avx512vnni", "+avx512vl"} <= FEATURES)
# rows per packed group on this host: the i32 lanes of its widest vector (a layout may be
# built and run for the other width too: every intrinsic takes its width from its arguments)
R = 16 if AVX512 else 8
WIDTHS = (8, 16)


_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32, _F16 = ir.FloatType(), ir.HalfType()


def flavor() -> str:
    """The instructions the products compile to now (part of compiled kernels' names)."""
    return ("vnni512" if VNNI512 else "avx512" if AVX512 else
            "vnni256" if VNNI256 else "avx2" if AVX2 else "ir")


def _vb(r):
    return ir.VectorType(_I8, 4 * r)


def _vw(r):
    return ir.VectorType(_I16, 2 * r)


def _vi(r):
    return ir.VectorType(_I32, r)


def _vf(r):
    return ir.VectorType(_F32, r)


def _width(lit) -> int | None:
    """The lane count a literal argument names (8 or 16), else None (not typed yet)."""
    return lit.literal_value if isinstance(lit, types.IntegerLiteral) and \
        lit.literal_value in WIDTHS else None


def _rows(vec) -> int:
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
        elem = _I32 if fe_type.kind == "i32" else _F32
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


def _concat(builder, parts):
    """One vector of the equal-length vectors `parts`, in order."""
    while len(parts) > 1:
        nxt = []
        for a, b in zip(parts[0::2], parts[1::2]):
            n = a.type.count
            nxt.append(builder.shuffle_vector(a, b, vconst(ir.VectorType(_I32, 2 * n),
                                                           range(2 * n))))
        parts = nxt
    return parts[0]


def _split(builder, v, r, c):
    """The c column parts (<r x ..> each) of an <r * c> vector."""
    if c == 1:
        return [v]
    return [builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                   vconst(ir.VectorType(_I32, r), range(j * r, j * r + r)))
            for j in range(c)]


def _repeat(builder, v, c):
    """An <r> vector repeated for c columns."""
    if c == 1:
        return v
    r = v.type.count
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined),
                                  vconst(ir.VectorType(_I32, r * c), [i % r for i in range(r * c)]))


def _splat_lanes(builder, x, r):
    vt = ir.VectorType(x.type, r)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), vconst(ir.VectorType(_I32, r),
                                                                           [0] * r))


def _per_column(builder, xs, r):
    """<r * c>: scalar xs[j] in every lane of column j."""
    return _concat(builder, [_splat_lanes(builder, x, r) for x in xs])


def _at2(context, builder, aty, arr, row: int, col, colty, t):
    """Pointer to a value of LLVM type t at element `col` (numba type colty) of row `row` of
    the 2-D array arr, whose rows are contiguous (col: a byte offset for uint8 arrays, an
    element index otherwise)."""
    ary = context.make_array(aty)(context, builder, value=arr)
    strides = cgutils.unpack_tuple(builder, ary.strides, 2)
    item = context.get_abi_sizeof(context.get_data_type(aty.dtype))
    off = builder.add(builder.mul(ir.Constant(_I64, row), strides[0]),
                      builder.mul(context.cast(builder, col, colty, types.int64),
                                  ir.Constant(_I64, item)))
    return builder.inttoptr(builder.add(builder.ptrtoint(ary.data, _I64), off), t.as_pointer())


def _col_loads(context, builder, sig, args, a, o, t, c):
    """The value of type t at element args[o] of each of the first c rows of array args[a]."""
    return [builder.load(_at2(context, builder, sig.args[a], args[a], j, args[o], sig.args[o], t),
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


def _dp_bytes(builder, acc, x, y, r):
    """acc + sums of 4 adjacent products of x (unsigned bytes) and y (signed bytes), both
    <4r x i8>, per i32 lane."""
    vb, vw, vi = _vb(r), _vw(r), _vi(r)
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
        w = ir.VectorType(_I32, 4 * r)
        prod = builder.mul(builder.zext(x, w), builder.sext(y, w))
        d = None
        for k in range(4):
            part = builder.shuffle_vector(prod, prod, vconst(vi, range(k, 4 * r, 4)))
            d = part if d is None else builder.add(d, part)
    return builder.add(acc, d)


def _dp_words(builder, acc, x, y, r):
    """acc + x[2i] * y[2i] + x[2i+1] * y[2i+1] per i32 lane (x, y: <2r x i16>)."""
    vw, vi = _vw(r), _vi(r)
    if r == 16 and VNNI512:
        return x86_call(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [vi] * 3,
                        [acc, builder.bitcast(x, vi), builder.bitcast(y, vi)])
    if (r == 16 and AVX512) or (r == 8 and AVX2):
        name = "llvm.x86.avx512.pmaddw.d.512" if r == 16 else "llvm.x86.avx2.pmadd.wd"
        d = x86_call(builder, name, vi, [vw, vw], [x, y])
    else:
        w = ir.VectorType(_I32, 2 * r)
        prod = builder.mul(builder.sext(x, w), builder.sext(y, w))
        d = builder.add(builder.shuffle_vector(prod, prod, vconst(vi, range(0, 2 * r, 2))),
                        builder.shuffle_vector(prod, prod, vconst(vi, range(1, 2 * r, 2))))
    return builder.add(acc, d)


def _bytes_splat(c: int, r: int):
    return vconst(_vb(r), [c] * (4 * r))


# ---- quants -------------------------------------------------------------------------------

@intrinsic
def ldq(typingctx, arr, off, r):
    """The 4r bytes of arr from byte off (r: a literal lane count)."""
    n = _width(r)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        return load_at(context, builder, sig, args, _vb(n))

    return UB(n)(arr, off, r), codegen


@intrinsic
def lo4(typingctx, v):
    n = _rows(v)

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _bytes_splat(15, n))

    return v(v), codegen


@intrinsic
def hi4(typingctx, v):
    n = _rows(v)

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _bytes_splat(4, n))

    return v(v), codegen


@intrinsic
def hi4x(typingctx, v):
    """v's high nibbles for `dpb`: in place (v & 0xF0, 16 times their value) where
    `bytes_exact`, else shifted down (hi4); `lnib` takes the sums of their products back to
    the nibbles' scale."""
    n = _rows(v)

    def codegen(context, builder, sig, args):
        if bytes_exact(n):
            return builder.and_(args[0], _bytes_splat(-16, n))
        return builder.lshr(args[0], _bytes_splat(4, n))

    return v(v), codegen


@intrinsic
def lnib(typingctx, acc):
    """Sums of `hi4x` nibbles times quants at the nibbles' own scale: acc >> 4 where they
    were dotted in place (exact: each sum is 16 times an integer), else acc itself."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        if bytes_exact(n):
            return builder.ashr(args[0], vconst(_vi(n * k), [4] * (n * k)))
        return args[0]

    return acc(acc), codegen


@intrinsic
def bit5(typingctx, v, arr, off):
    """v | 16 in byte j where bit j of the 4r-bit little-endian mask at byte off is set."""
    n = _rows(v)

    def codegen(context, builder, sig, args):
        m = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                                ir.IntType(4 * n)), align=1)
        on = builder.bitcast(m, ir.VectorType(_I1, 4 * n))
        return builder.or_(args[0], builder.select(on, _bytes_splat(16, n),
                                                   _bytes_splat(0, n)))

    return v(v, arr, off), codegen


@intrinsic
def hi2(typingctx, v, h, s):
    """v | (((h >> 2s) & 3) << 4) per byte: the 2 high bits of 6-bit values (Q6_K) from a
    vector of 2-bit fields, field s (a literal 0..3)."""
    if not isinstance(s, types.IntegerLiteral):
        return None
    k, n = s.literal_value, _rows(v)

    def codegen(context, builder, sig, args):
        h = args[1]
        if k < 2:
            h = builder.shl(h, _bytes_splat(4 - 2 * k, n))
        elif k == 3:
            h = builder.lshr(h, _bytes_splat(2, n))
        return builder.or_(args[0], builder.and_(h, _bytes_splat(0x30, n)))

    return v(v, h, s), codegen


@intrinsic
def lut16(typingctx, v, arr, off):
    """Byte j of v (0..15) replaced by byte v[j] of the 16-byte table at arr[off]."""
    n = _rows(v)

    def codegen(context, builder, sig, args):
        vb = _vb(n)
        t16 = load_at(context, builder, sig, args, ir.VectorType(_I8, 16), 1, 2)
        if (n == 16 and AVX512) or (n == 8 and AVX2):
            # vpshufb looks up within each 16-byte lane: the table repeated in every one
            table = builder.shuffle_vector(t16, t16, vconst(ir.VectorType(_I32, 4 * n),
                                                            [i % 16 for i in range(4 * n)]))
            name = "llvm.x86.avx512.pshuf.b.512" if n == 16 else "llvm.x86.avx2.pshuf.b"
            return x86_call(builder, name, vb, [vb, vb], [table, args[0]])
        out = ir.Constant(vb, ir.Undefined)
        for j in range(4 * n):
            idx = builder.extract_element(args[0], ir.Constant(_I32, j))
            out = builder.insert_element(out, builder.extract_element(t16, idx),
                                         ir.Constant(_I32, j))
        return out

    return v(v, arr, off), codegen


# ---- integer products (acc: r rows x c columns; per-column data in 2-D arrays, a row each) -

def _lit(x) -> int | None:
    return x.literal_value if isinstance(x, types.IntegerLiteral) else None


@intrinsic
def lzero(typingctx, r, c):
    n, k = _width(r), _lit(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(_I32, n * k), [0] * (n * k))

    return IL(n, k)(r, c), codegen


@intrinsic
def dpb(typingctx, acc, v, y, yo):
    """acc + sum_i v[4 l + i] * int8(y[j, yo + i]) in lane l of column j (each column's
    activation dword broadcast to its r lanes)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        ys = _col_loads(context, builder, sig, args, 2, 3, _I32, k)
        parts = _split(builder, args[0], n, k)
        return _concat(builder, [
            _dp_bytes(builder, a, args[1], builder.bitcast(_splat_lanes(builder, yj, n), _vb(n)),
                      n) for a, yj in zip(parts, ys)])

    return acc(acc, v, y, yo), codegen


@intrinsic
def dpw(typingctx, acc, arr, off, y, yo, signed):
    """acc + w[2 l] * s0 + w[2 l + 1] * s1 in lane l of column j: w the 2r bytes at arr[off]
    (signed or unsigned: a literal bool), s0, s1 the two i16 at y[j, yo] (a byte offset)."""
    if not isinstance(signed, types.BooleanLiteral):
        return None
    sgn, n, k = signed.literal_value, acc.r, acc.c

    def codegen(context, builder, sig, args):
        b = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                                ir.VectorType(_I8, 2 * n)), align=1)
        w = builder.sext(b, _vw(n)) if sgn else builder.zext(b, _vw(n))
        ys = _col_loads(context, builder, sig, args, 3, 4, _I32, k)
        parts = _split(builder, args[0], n, k)
        return _concat(builder, [
            _dp_words(builder, a, w, builder.bitcast(_splat_lanes(builder, yj, n), _vw(n)), n)
            for a, yj in zip(parts, ys)])

    return acc(acc, arr, off, y, yo, signed), codegen


@intrinsic
def lmul(typingctx, acc, arr, off, signed):
    """acc times the r bytes at arr[off] (one per row, the same for every column), lane by
    lane (signed or unsigned: a literal bool)."""
    if not isinstance(signed, types.BooleanLiteral):
        return None
    sgn, n, k = signed.literal_value, acc.r, acc.c

    def codegen(context, builder, sig, args):
        b = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                                ir.VectorType(_I8, n)), align=1)
        e = builder.sext(b, _vi(n)) if sgn else builder.zext(b, _vi(n))
        return builder.mul(args[0], _repeat(builder, e, k))

    return acc(acc, arr, off, signed), codegen


@intrinsic
def lsubm(typingctx, acc, arr, i):
    """acc - arr[j, i] in the lanes of column j (arr a 2-D int32 array)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        xs = _col_loads(context, builder, sig, args, 1, 2, _I32, k)
        return builder.sub(args[0], _per_column(builder, xs, n))

    return acc(acc, arr, i), codegen


@intrinsic
def ladd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return a(a, b), codegen


# ---- floats -------------------------------------------------------------------------------

@intrinsic
def fzero(typingctx, r, c):
    n, k = _width(r), _lit(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(_F32, n * k), [0.0] * (n * k))

    return FL(n, k)(r, c), codegen


@intrinsic
def ldh(typingctx, arr, off, r):
    """The r f16 values at arr[off] (per-row scales) as float32 lanes (vcvtph2ps)."""
    n = _width(r)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        h = builder.load(ptr_at(context, builder, sig.args[0], args[0], args[1],
                                ir.VectorType(_F16, n)), align=1)
        return builder.fpext(h, _vf(n))

    return FL(n, 1)(arr, off, r), codegen


def _scaled(builder, sc, s, n, k):
    """Per-row scales sc (<r>) times each column's scalar s[j] (<c>), as <r * c>."""
    cols = [builder.extract_element(s, ir.Constant(_I32, j)) for j in range(k)]
    return builder.fmul(_repeat(builder, sc, k), _per_column(builder, cols, n))


@intrinsic
def ffma(typingctx, acc, v, sc, s):
    """acc + float(v) * (sc * s): integer lanes v, per-row float scales sc (ldh), one float
    per column s."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], ir.VectorType(_F32, n * k))
        m = builder.fmul(f, _scaled(builder, args[2], args[3], n, k), flags=("contract",))
        return builder.fadd(args[0], m, flags=("contract",))

    return acc(acc, v, sc, s), codegen


@intrinsic
def ffms(typingctx, acc, v, sc, s):
    """acc - float(v) * (sc * s) (ffma's terms taken off)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], ir.VectorType(_F32, n * k))
        m = builder.fmul(f, _scaled(builder, args[2], args[3], n, k), flags=("contract",))
        return builder.fsub(args[0], m, flags=("contract",))

    return acc(acc, v, sc, s), codegen


@intrinsic
def fmas(typingctx, acc, sc, s):
    """acc + sc * s (per-row float lanes sc, one float per column s)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], _scaled(builder, args[1], args[2], n, k),
                            flags=("contract",))

    return acc(acc, sc, s), codegen


def _col_vector(context, builder, sig, args, t, k):
    """<k x t>: the value of type t at element args[1] of each of the first k rows of the
    2-D array args[0]."""
    out = ir.Constant(ir.VectorType(t, k), ir.Undefined)
    for j, x in enumerate(_col_loads(context, builder, sig, args, 0, 1, t, k)):
        out = builder.insert_element(out, x, ir.Constant(_I32, j))
    return out


@intrinsic
def cf32(typingctx, y, off, c):
    """The float32 at element off of each of the c rows of y: Q8_K's d where y holds bytes
    (off a byte offset, unaligned), a value of a 2-D float32 array otherwise."""
    k = _lit(c)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        return _col_vector(context, builder, sig, args, _F32, k)

    return CF(k)(y, off, c), codegen


@intrinsic
def cf16(typingctx, y, off, c):
    """The little-endian f16 at byte off of each of the c rows of y, as floats (Q8_0's d)."""
    k = _lit(c)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(_col_vector(context, builder, sig, args, _F16, k),
                             ir.VectorType(_F32, k))

    return CF(k)(y, off, c), codegen


@intrinsic
def fadd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return a(a, b), codegen


@intrinsic
def fload(typingctx, d, c0, r, c):
    """Rows c0 .. c0 + c - 1 of the 2-D float32 array d (r floats each, from element 0), as
    an <r * c> vector: fstore's inverse."""
    n, k = _width(r), _lit(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        strides = cgutils.unpack_tuple(builder, ary.strides, 2)
        base = builder.ptrtoint(ary.data, _I64)
        row0 = context.cast(builder, args[1], sig.args[1], types.int64)
        parts = []
        for j in range(k):
            a = builder.add(base, builder.mul(builder.add(row0, ir.Constant(_I64, j)),
                                              strides[0]))
            parts.append(builder.load(builder.inttoptr(a, _vf(n).as_pointer()), align=4))
        return _concat(builder, parts)

    return FL(n, k)(d, c0, r, c), codegen


@intrinsic
def fstore(typingctx, d, c0, off, v):
    """Store column j's r lanes of v into d[c0 + j, off:off + r] (d a 2-D float32 array)."""
    n, k = v.r, v.c

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        strides = cgutils.unpack_tuple(builder, ary.strides, 2)
        base = builder.ptrtoint(ary.data, _I64)
        row0 = context.cast(builder, args[1], sig.args[1], types.int64)
        col = builder.mul(context.cast(builder, args[2], sig.args[2], types.int64),
                          ir.Constant(_I64, 4))
        for j, part in enumerate(_split(builder, args[3], n, k)):
            row = builder.add(row0, ir.Constant(_I64, j))
            a = builder.add(base, builder.add(builder.mul(row, strides[0]), col))
            builder.store(part, builder.inttoptr(a, _vf(n).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(d, c0, off, v), codegen


__all__ = ["AVX512", "AVX2", "VNNI512", "VNNI256", "R", "WIDTHS", "flavor", "ldq", "lo4", "hi4",
           "hi4x", "lnib", "byte_dot", "bytes_exact",
           "bit5", "hi2", "lut16", "lzero", "dpb", "dpw", "lmul", "lsubm", "ladd", "fzero", "ldh",
           "ffma", "ffms", "fmas", "cf32", "cf16", "fadd", "fload", "fstore"]
