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
  VNNI, vpmaddubsw + vpmaddwd without), `lmul` (acc times R per-row bytes), `ld6` (four
  sub-blocks' 6-bit K-quant scales or mins of each row as its dword, decoded from the 12
  stored scale bytes as planes of R) and `lmulb` (acc times one byte of each row's dword),
  `lsubm`, `ladd`, `laddsh`, `lzero`, `lpin` (a value held in order);
- floats: `fzero`, `ldh` (R f16 row scales), `ffma`/`ffms` (acc +/- float(ints) *
  (scales * s)), `fmas` (acc + scales * s), `cf32`/`cf16` (each column's float), `fadd`,
  `fload`/`fstore` (R lanes of each column from/to a 2-D float array).

The memory side (prefetch per CPU, an unaligned word load, the threads' work counter) is
qmem.py's; the vector types, the host's instructions and the IR of the dots are lane_ir.py's.

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

from .lane_ir import (AVX2, AVX512, CF, F16, F32, FL, I1, I8, I32, I64, IL, R, UB, VNNI256,
                      VNNI512, WIDTHS, byte_dot, byte_splat, byte_vec, bytes_exact, column_loads,
                      concat, dot_bytes, flavor, float_vec, int_vec, lane_width,
                      literal_int, per_column, repeat_columns, row_lanes, splat_lanes,
                      split_columns)
from .qvec import load_at, ptr_at, vconst, x86_call

# ---- quants -------------------------------------------------------------------------------

@intrinsic
def ldq(typingctx, arr, off, r):
    """The 4r bytes of arr from byte off (r: a literal lane count)."""
    n = lane_width(r)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        return load_at(context, builder, sig, args, byte_vec(n))

    return UB(n)(arr, off, r), codegen


@intrinsic
def lo4(typingctx, v):
    n = row_lanes(v)

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], byte_splat(15, n))

    return v(v), codegen


@intrinsic
def hi4(typingctx, v):
    n = row_lanes(v)

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], byte_splat(4, n))

    return v(v), codegen


@intrinsic
def hi4x(typingctx, v):
    """v's high nibbles for `dpb`: in place (v & 0xF0, 16 times their value) where
    `bytes_exact`, else shifted down (hi4); `lnib` takes the sums of their products back to
    the nibbles' scale."""
    n = row_lanes(v)

    def codegen(context, builder, sig, args):
        if bytes_exact(n):
            return builder.and_(args[0], byte_splat(-16, n))
        return builder.lshr(args[0], byte_splat(4, n))

    return v(v), codegen


@intrinsic
def lnib(typingctx, acc):
    """Sums of `hi4x` nibbles times quants at the nibbles' own scale: acc >> 4 where they
    were dotted in place (exact: each sum is 16 times an integer), else acc itself."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        if bytes_exact(n):
            return builder.ashr(args[0], vconst(int_vec(n * k), [4] * (n * k)))
        return args[0]

    return acc(acc), codegen


@intrinsic
def bit5(typingctx, v, arr, off):
    """v | 16 in byte j where bit j of the 4r-bit little-endian mask at byte off is set."""
    n = row_lanes(v)

    def codegen(context, builder, sig, args):
        m = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                                ir.IntType(4 * n)), align=1)
        on = builder.bitcast(m, ir.VectorType(I1, 4 * n))
        return builder.or_(args[0], builder.select(on, byte_splat(16, n),
                                                   byte_splat(0, n)))

    return v(v, arr, off), codegen


@intrinsic
def hi2(typingctx, v, h, s):
    """v | (((h >> 2s) & 3) << 4) per byte: the 2 high bits of 6-bit values (Q6_K) from a
    vector of 2-bit fields, field s (a literal 0..3)."""
    if not isinstance(s, types.IntegerLiteral):
        return None
    k, n = s.literal_value, row_lanes(v)

    def codegen(context, builder, sig, args):
        h = args[1]
        if k < 2:
            h = builder.shl(h, byte_splat(4 - 2 * k, n))
        elif k == 3:
            h = builder.lshr(h, byte_splat(2, n))
        return builder.or_(args[0], builder.and_(h, byte_splat(0x30, n)))

    return v(v, h, s), codegen


@intrinsic
def lut16(typingctx, v, arr, off):
    """Byte j of v (0..15) replaced by byte v[j] of the 16-byte table at arr[off]."""
    n = row_lanes(v)

    def codegen(context, builder, sig, args):
        vb = byte_vec(n)
        t16 = load_at(context, builder, sig, args, ir.VectorType(I8, 16), 1, 2)
        if (n == 16 and AVX512) or (n == 8 and AVX2):
            # vpshufb looks up within each 16-byte lane: the table repeated in every one
            table = builder.shuffle_vector(t16, t16, vconst(ir.VectorType(I32, 4 * n),
                                                            [i % 16 for i in range(4 * n)]))
            name = "llvm.x86.avx512.pshuf.b.512" if n == 16 else "llvm.x86.avx2.pshuf.b"
            return x86_call(builder, name, vb, [vb, vb], [table, args[0]])
        out = ir.Constant(vb, ir.Undefined)
        for j in range(4 * n):
            idx = builder.extract_element(args[0], ir.Constant(I32, j))
            out = builder.insert_element(out, builder.extract_element(t16, idx),
                                         ir.Constant(I32, j))
        return out

    return v(v, arr, off), codegen


# ---- integer products (acc: r rows x c columns; per-column data in 2-D arrays, a row each) -

@intrinsic
def lzero(typingctx, r, c):
    n, k = lane_width(r), literal_int(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(I32, n * k), [0] * (n * k))

    return IL(n, k)(r, c), codegen


@intrinsic
def dpb(typingctx, acc, v, y, yo):
    """acc + sum_i v[4 l + i] * int8(y[j, yo + i]) in lane l of column j (each column's
    activation dword broadcast to its r lanes)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        ys = column_loads(context, builder, sig, args, 2, 3, I32, k)
        parts = split_columns(builder, args[0], n, k)
        return concat(builder, [
            dot_bytes(builder, a, args[1],
                      builder.bitcast(splat_lanes(builder, yj, n), byte_vec(n)), n)
            for a, yj in zip(parts, ys)])

    return acc(acc, v, y, yo), codegen


@intrinsic
def lmul(typingctx, acc, arr, off, signed):
    """acc times the r bytes at arr[off] (one per row, the same for every column), lane by
    lane (signed or unsigned: a literal bool)."""
    if not isinstance(signed, types.BooleanLiteral):
        return None
    sgn, n, k = signed.literal_value, acc.r, acc.c

    def codegen(context, builder, sig, args):
        b = builder.load(ptr_at(context, builder, sig.args[1], args[1], args[2],
                                ir.VectorType(I8, n)), align=1)
        e = builder.sext(b, int_vec(n)) if sgn else builder.zext(b, int_vec(n))
        return builder.mul(args[0], repeat_columns(builder, e, k))

    return acc(acc, arr, off, signed), codegen


def _row_words(context, builder, sig, args, o, n):
    """The 4 planes of r bytes from byte args[o] of the array args[0] (4r bytes, one line
    where r is 16), transposed so that row l's 4 bytes make its dword (plane i: byte i)."""
    bv = byte_vec(n)
    x = load_at(context, builder, sig, args, bv, 0, o)
    return builder.shuffle_vector(x, ir.Constant(bv, ir.Undefined),
                                  vconst(int_vec(4 * n), [n * i + l for l in range(n)
                                                          for i in range(4)]))


@intrinsic
def ld6(typingctx, arr, a, b, mode, r):
    """Four sub-blocks' 6-bit K-quant scales or mins of each of r rows, byte i of row l's
    dword the i-th (ggml's get_scale_min_k4), from the 12 scale bytes stored as planes of r
    (plane i: byte i of every row): mode 0 the low 6 bits of the planes from byte a
    (sub-blocks 0-3), 1 their low nibbles and 2 their high nibbles under the top 2 bits of
    the planes from byte b (sub-blocks 4-7: scales, mins). Four planes are one 4r-byte load
    (a line where r is 16), transposed (vpermb), where a plane was a 16-byte load as each
    sub-block's sum was scaled (qtiles.k_tile: the header's lines read whole, first)."""
    n, m = lane_width(r), literal_int(mode)
    if n is None or m is None:
        return None

    def codegen(context, builder, sig, args):
        x = _row_words(context, builder, sig, args, 1, n)
        if m == 0:
            return builder.and_(x, byte_splat(63, n))
        y = _row_words(context, builder, sig, args, 2, n)
        top = builder.lshr(builder.and_(y, byte_splat(-64, n)), byte_splat(2, n))
        low = builder.and_(x, byte_splat(15, n)) if m == 1 else builder.lshr(x, byte_splat(4, n))
        return builder.or_(low, top)

    return UB(n)(arr, a, b, mode, r), codegen


@intrinsic
def lmulb(typingctx, acc, v, i):
    """acc times byte i (a literal 0-3) of each row's dword in v (`ld6`'s), lane by lane,
    the same for every column."""
    j, n, k = literal_int(i), acc.r, acc.c
    if j is None:
        return None

    def codegen(context, builder, sig, args):
        e = builder.bitcast(args[1], int_vec(n))
        if j:
            e = builder.lshr(e, vconst(int_vec(n), [8 * j] * n))
        if j != 3:
            e = builder.and_(e, vconst(int_vec(n), [255] * n))
        return builder.mul(args[0], repeat_columns(builder, e, k))

    return acc(acc, v, i), codegen


@intrinsic
def laddsh(typingctx, a, b, s):
    """a + (b << s), s a literal."""
    sh, n, k = literal_int(s), a.r, a.c
    if sh is None:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], builder.shl(args[1], vconst(int_vec(n * k), [sh] * (n * k))))

    return a(a, b, s), codegen


@intrinsic
def lsubm(typingctx, acc, arr, i):
    """acc - arr[j, i] in the lanes of column j (arr a 2-D int32 array)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        xs = column_loads(context, builder, sig, args, 1, 2, I32, k)
        return builder.sub(args[0], per_column(builder, xs, n))

    return acc(acc, arr, i), codegen


@intrinsic
def lpin(typingctx, acc):
    """acc, computed before any load that follows: an empty asm that takes each column's
    lanes in a vector register and gives them back, clobbering memory (no code). LLVM keeps
    a Q4_K pair of sub-blocks' loads in order behind qmem.in_order but may sink the pair's
    dots past the next pair's loads, holding the loaded lines in spilled registers (a Q4_K
    tile on `ld6` ran 0.81x cold so, Zen 4). Portable IR: acc as is."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        if not (AVX512 or AVX2):
            return args[0]
        t = int_vec(n)
        pin = ir.FunctionType(t, [t])
        return concat(builder, [builder.asm(pin, "", "=v,0,~{memory}" if AVX512 else
                                            "=x,0,~{memory}", [part], True)
                                for part in split_columns(builder, args[0], n, k)])

    return acc(acc), codegen


@intrinsic
def ladd(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])

    return a(a, b), codegen


# ---- floats -------------------------------------------------------------------------------

@intrinsic
def fzero(typingctx, r, c):
    n, k = lane_width(r), literal_int(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        return vconst(ir.VectorType(F32, n * k), [0.0] * (n * k))

    return FL(n, k)(r, c), codegen


@intrinsic
def ldh(typingctx, arr, off, r):
    """The r f16 values at arr[off] (per-row scales) as float32 lanes (vcvtph2ps)."""
    n = lane_width(r)
    if n is None:
        return None

    def codegen(context, builder, sig, args):
        h = builder.load(ptr_at(context, builder, sig.args[0], args[0], args[1],
                                ir.VectorType(F16, n)), align=1)
        return builder.fpext(h, float_vec(n))

    return FL(n, 1)(arr, off, r), codegen


def _scaled(builder, sc, s, n, k):
    """Per-row scales sc (<r>) times each column's scalar s[j] (<c>), as <r * c>."""
    cols = [builder.extract_element(s, ir.Constant(I32, j)) for j in range(k)]
    return builder.fmul(repeat_columns(builder, sc, k), per_column(builder, cols, n))


@intrinsic
def ffma(typingctx, acc, v, sc, s):
    """acc + float(v) * (sc * s): integer lanes v, per-row float scales sc (ldh), one float
    per column s."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], ir.VectorType(F32, n * k))
        m = builder.fmul(f, _scaled(builder, args[2], args[3], n, k), flags=("contract",))
        return builder.fadd(args[0], m, flags=("contract",))

    return acc(acc, v, sc, s), codegen


@intrinsic
def ffms(typingctx, acc, v, sc, s):
    """acc - float(v) * (sc * s) (ffma's terms taken off)."""
    n, k = acc.r, acc.c

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], ir.VectorType(F32, n * k))
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
    for j, x in enumerate(column_loads(context, builder, sig, args, 0, 1, t, k)):
        out = builder.insert_element(out, x, ir.Constant(I32, j))
    return out


@intrinsic
def cf32(typingctx, y, off, c):
    """The float32 at element off of each of the c rows of y: Q8_K's d where y holds bytes
    (off a byte offset, unaligned), a value of a 2-D float32 array otherwise."""
    k = literal_int(c)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        return _col_vector(context, builder, sig, args, F32, k)

    return CF(k)(y, off, c), codegen


@intrinsic
def cf16(typingctx, y, off, c):
    """The little-endian f16 at byte off of each of the c rows of y, as floats (Q8_0's d)."""
    k = literal_int(c)
    if k is None:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(_col_vector(context, builder, sig, args, F16, k),
                             ir.VectorType(F32, k))

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
    n, k = lane_width(r), literal_int(c)
    if n is None or k is None:
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        strides = cgutils.unpack_tuple(builder, ary.strides, 2)
        base = builder.ptrtoint(ary.data, I64)
        row0 = context.cast(builder, args[1], sig.args[1], types.int64)
        parts = []
        for j in range(k):
            a = builder.add(base, builder.mul(builder.add(row0, ir.Constant(I64, j)),
                                              strides[0]))
            parts.append(builder.load(builder.inttoptr(a, float_vec(n).as_pointer()), align=4))
        return concat(builder, parts)

    return FL(n, k)(d, c0, r, c), codegen


@intrinsic
def fstore(typingctx, d, c0, off, v):
    """Store column j's r lanes of v into d[c0 + j, off:off + r] (d a 2-D float32 array)."""
    n, k = v.r, v.c

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        strides = cgutils.unpack_tuple(builder, ary.strides, 2)
        base = builder.ptrtoint(ary.data, I64)
        row0 = context.cast(builder, args[1], sig.args[1], types.int64)
        col = builder.mul(context.cast(builder, args[2], sig.args[2], types.int64),
                          ir.Constant(I64, 4))
        for j, part in enumerate(split_columns(builder, args[3], n, k)):
            row = builder.add(row0, ir.Constant(I64, j))
            a = builder.add(base, builder.add(builder.mul(row, strides[0]), col))
            builder.store(part, builder.inttoptr(a, float_vec(n).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(d, c0, off, v), codegen


__all__ = ["AVX512", "AVX2", "VNNI512", "VNNI256", "R", "WIDTHS", "flavor", "ldq", "lo4", "hi4",
           "hi4x", "lnib", "byte_dot", "bytes_exact", "bit5", "hi2", "lut16", "lzero", "dpb",
           "ld6", "lmul", "lmulb", "lpin", "lsubm", "ladd", "laddsh", "fzero", "ldh",
           "ffma", "ffms", "fmas", "cf32", "cf16", "fadd", "fload", "fstore"]
