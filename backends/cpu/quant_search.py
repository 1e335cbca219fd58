"""Numba ports of the scalar helpers and scale searches of ggml's CPU quantizers.

This module owns the pieces of `ggml/src/ggml-quants.c` that the per-type row kernels
(backends/cpu/quantize_rows.py, backends/cpu/quantize_rows_k.py) share: `nearest_int`,
`best_index_int8` over kvalues_iq4nl, ggml's f32 <-> f16 conversions, the x86 float -> int
conversion that C's `(int8_t)` / `(uint8_t)` casts of floats compile to, and the scale searches
make_qx_quants, make_q3_quants, make_qkx2_quants, make_qkx3_quants, make_qp_quants and the IQ4
search of quantize_row_iq4_nl_impl. Every function is `njit(cache=True, nogil=True)`.

Each search exists as the scalar port (one group: a 1-D float32 view, line for line the C) and,
for those that dominate the run time, as a lane version (`*_lanes`, backends/cpu/quant_lanes.py)
that searches every group of a row at once: same arithmetic per group, loops nested so that LLVM vectorizes across
groups (2-7x faster than libggml). The kernels use the lane versions where they win and the
scalar ones elsewhere (make_q3_quants, whose passes mostly skip work on branches, and the
small per-super-block searches); the tests check lane against scalar on every kind of data.

Bit-exactness with libggml-base (built with plain -O3 for x86-64, so without FMA contraction)
rests on the same rules as the numpy quantizers (ggraph/codecs/kquantize.py):

- float32 for every float value, one rounding per C operation, in C's association order
  (`w*x[i]*l` is `(w*x)*l`, integers become float32 exactly where C converts them). Numba
  types a Python float literal as float64, so every constant is a module-level np.float32 and
  every int meeting a float is converted with np.float32(...) first. No fastmath (it would
  allow FMA contraction and reassociation).
- Sums that C accumulates in a loop are accumulated in the same order, from the same start
  (`sum_w = weights[0]` in make_qkx2/3_quants, 0 elsewhere).
- `error_model="numpy"`: a float division by zero gives inf/NaN as in C instead of raising.
- `nearest_int` is ggml's float trick on the bits, so out-of-range arguments (inf from a
  division by a tiny number) give ggml's deterministic integer, not Python's rounding.
- Casts that wrap in C (`(uint8_t)int`, `(int8_t)int`) are masked explicitly; float -> int
  conversions follow x86's cvttss2si (INT_MIN for NaN and out-of-range values).
- Maxima keep C's comparisons: the first element of largest magnitude wins (strict `>`), and
  a variable never updated keeps its +0 start.

Only finite input is supported, as in ggml (which asserts or has undefined casts otherwise).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..half import bits_f32, f32_bits

__all__ = [
    "KVALUES_IQ4NL", "GROUP_MAX_EPS", "nearest_int", "nearest_int32", "nearest_clamped",
    "best_index_int8", "iq4_nl_index", "cvtt_i32", "low_i8", "roundf_i32", "fp32_to_fp16",
    "fp16_to_fp32", "put_f16", "make_qx_quants", "make_q3_quants", "make_qkx2_quants",
    "make_qkx3_quants", "make_qp_quants", "iq4_block_scale", "JIT", "F32", "ZERO", "ONE",
    "HALF", "TENTH",
]

# every kernel's decorator (the lane searches and the row kernels share it)
JIT = njit(cache=True, nogil=True, error_model="numpy")
_jit = JIT

F32 = np.float32
ZERO = F32(0.0)
ONE = F32(1.0)
HALF = F32(0.5)
TENTH = F32(0.1)               # C's 0.1f
GROUP_MAX_EPS = F32(1e-15)     # GROUP_MAX_EPS
_MAGIC = F32(12582912.0)       # 1.5 * 2^23: adding it leaves round-half-even(f) in the mantissa
_TWO31 = F32(2147483648.0)
_TWO23 = F32(8388608.0)
_F16_SUBNORMAL_UNIT = F32(2.0 ** -24)
_MINUS_127 = F32(-127.0)
# kvalues_iq4nl (ggml-common.h), as float32: C compares a float with these int8 values, which
# converts them exactly
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                          113], dtype=np.float32)


# ----------------------------------------------------------------------------- scalar helpers

@intrinsic
def nearest_int32(typingctx, fval):
    """ggml's nearest_int(float32) as an int32: bits(f + 12582912.f) & 0x7fffff - 0x400000
    (round half to even for |f| < 2^22, ggml's deterministic garbage beyond). Written in LLVM
    IR so that it stays 32-bit: numba would widen the integer steps to int64, which loops over
    lanes vectorize at half the width."""
    if fval != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.bitcast(builder.fadd(args[0], ir.Constant(ir.FloatType(), 12582912.0)), i32)
        return builder.sub(builder.and_(v, ir.Constant(i32, 0x7FFFFF)), ir.Constant(i32, 0x400000))

    return types.int32(types.float32), codegen


@_jit
def nearest_int(fval):
    """ggml's nearest_int(float32) as an int64 (see nearest_int32)."""
    return np.int64(nearest_int32(fval))


@_jit
def nearest_clamped(fval, lo, hi):
    """MAX(lo, MIN(hi, nearest_int(fval))) as a float32, lo <= hi float32 integers: exact (every
    value is an integer below 2^23), and branch-free so that loops over lanes vectorize."""
    v = F32(nearest_int32(fval))
    v = v if v < hi else hi
    return v if v > lo else lo


@_jit
def cvtt_i32(f):
    """C's (int)f as x86 compiles it (cvttss2si): truncation, INT_MIN for NaN / out of range."""
    if f >= -_TWO31 and f < _TWO31:
        return np.int64(np.int32(f))
    return np.int64(-2147483648)


@_jit
def low_i8(v):
    """The int8 C keeps of an int: its low byte, signed."""
    return ((v & 0xFF) ^ 0x80) - 0x80


@_jit
def roundf_i32(f):
    """(int)roundf(f) as x86 compiles it: half away from zero, INT_MIN for NaN / out of range."""
    a = abs(f)
    if not (a < _TWO31):
        return np.int64(-2147483648)
    if a >= _TWO23:                                  # already an integer
        return cvtt_i32(f)
    t = np.int64(np.int32(a))
    if a - F32(t) >= HALF:                           # exact: a and t share an exponent range
        t += 1
    return -t if f < ZERO else t


@_jit
def fp32_to_fp16(f):
    """GGML_FP32_TO_FP16: the IEEE half bits of f rounded to nearest even (inf on overflow,
    NaN as 0x7e00 with the sign), as an int in 0..0xffff."""
    b = np.int64(f32_bits(f))
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:
        return sign | 0x7E00
    if a >= 0x477FF000:                              # >= 65520: rounds to inf
        return sign | 0x7C00
    if a >= 0x38800000:                              # normal half: rebias, round on 13 bits
        return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
    # subnormal half (or zero): round |f| / 2^-24 to an integer, half to even
    e = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000 if e > 0 else a
    shift = 126 - (e if e > 0 else 1)                # |f| * 2^24 = mant * 2^-shift
    if shift > 24:
        return sign
    m = mant >> shift
    rem = mant & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rem > half or (rem == half and (m & 1) == 1):
        m += 1
    return sign | m


@_jit
def fp16_to_fp32(h):
    """GGML_FP16_TO_FP32: the float32 value of IEEE half bits h (exact)."""
    sign = np.int64(h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = np.int64(h & 0x3FF)
    if e == 0x1F:
        return bits_f32(sign | 0x7F800000 | (m << 13))
    if e == 0:
        v = F32(m) * _F16_SUBNORMAL_UNIT             # exact: m < 2^10
        return -v if sign != 0 else v
    return bits_f32(sign | ((np.int64(e) + 112) << 23) | (m << 13))


@_jit
def put_f16(out, at, h):
    """Store half bits h little-endian at out[at:at + 2]."""
    out[at] = h & 0xFF
    out[at + 1] = (h >> 8) & 0xFF


@_jit
def best_index_int8(n, val, x):
    """ggml's best_index_int8: index of the entry of the sorted table val nearest to x, the
    upper one on a tie (binary search, then one comparison, as in C)."""
    if x <= val[0]:
        return 0
    if x >= val[n - 1]:
        return n - 1
    ml = 0
    mu = n - 1
    while mu - ml > 1:
        mav = (ml + mu) >> 1
        if x < val[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - val[mu - 1] < val[mu] - x else mu


# ----------------------------------------------------------------------------- searches

@_jit
def make_qx_quants(n, nmax, x, L, qw, use_qw):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): L[i] in 0..2*nmax-1, returns the scale.

    Weights are qw[i] when use_qw, else x[i]*x[i] (qw == NULL). Tries the inverse scales
    -nmax/max and -(nmax + 0.1*is)/max, is = -9..9 (not 0), keeping the one that maximizes
    sumlx^2/suml2 (strictly). rmse_type 1 is the only one the ported quantizers reach."""
    vmax = ZERO
    amax = ZERO
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    if amax < GROUP_MAX_EPS:                        # all zero
        for i in range(n):
            L[i] = 0
        return ZERO
    fnmax = F32(nmax)
    iscale = F32(-nmax) / vmax
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l + nmax
        w = qw[i] if use_qw else x[i] * x[i]
        fl = F32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != ZERO else ZERO
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(fnmax + TENTH * F32(step)) / vmax
        sumlx = ZERO
        suml2 = ZERO
        for i in range(n):
            fl = F32(max(-nmax, min(nmax - 1, nearest_int(iscale * x[i]))))
            w = qw[i] if use_qw else x[i] * x[i]
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > ZERO and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_jit
def make_q3_quants(n, nmax, x, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): L[i] in 0..2*nmax-1, returns the scale.

    Quants from -nmax/max, then up to 5 passes that move one quant at a time to its best value
    given the others (weights x^2), stopping after a pass without change, as in C."""
    vmax = ZERO
    amax = ZERO
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    if amax < GROUP_MAX_EPS:                        # all zero
        for i in range(n):
            L[i] = 0
        return ZERO
    iscale = F32(-nmax) / vmax
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        fl = F32(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = np.int64(L[i])
            fli = F32(li)
            slx = sumlx - w * x[i] * fli
            if slx > ZERO:
                sl2 = suml2 - w * fli * fli
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != li:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if sl2 > ZERO and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > ZERO else ZERO


@_jit
def _make_qkx_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """The common body of make_qkx2_quants and make_qkx3_quants (with weights): returns
    (scale, the_min), L[i] in 0..nmax. The two C functions differ only in their flat test
    (`max == min` vs `max <= min`, equivalent once min <= 0 <= ... holds: max >= min always)
    and in qkx3's default weights, which none of the ported callers use."""
    vmin = x[0]
    vmax = x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        w = weights[i]
        sum_w += w
        sum_x += w * x[i]
    if vmin > ZERO:
        vmin = ZERO
    if vmax <= vmin:
        for i in range(n):
            L[i] = 0
        return ZERO, -vmin
    iscale = F32(nmax) / (vmax - vmin)
    scale = ONE / iscale
    best_error = ZERO
    for i in range(n):
        l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
        L[i] = l
        diff = scale * F32(l) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    if nstep < 1:
        return scale, -vmin
    fnmax = F32(nmax)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + fnmax) / (vmax - vmin)
        sum_l = ZERO
        sum_l2 = ZERO
        sum_xl = ZERO
        for i in range(n):
            l = max(0, min(nmax, nearest_int(iscale * (x[i] - vmin))))
            Laux[i] = l
            w = weights[i]
            fl = F32(l)
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > ZERO:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > ZERO:
                this_min = ZERO
                this_scale = sum_xl / sum_l2
            cur_error = ZERO
            for i in range(n):
                diff = this_scale * F32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@_jit
def make_qkx2_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants: weighted scale-and-min search; returns (scale, the_min), L in 0..nmax.

    Starts from (max - min)/nmax, then tries the inverse scales (rmin + rdelta*is + nmax) /
    (max - min), is = 0..nstep, fitting scale and min by weighted least squares for each and
    keeping a candidate only when its weighted error (|diff| when use_mad, else diff^2) is
    strictly smaller. rmin and rdelta are float32 (C's float parameters)."""
    return _make_qkx_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad)


@_jit
def make_qkx3_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """make_qkx3_quants with explicit weights (every caller ported here passes them): the same
    search as make_qkx2_quants; the importance-matrix paths call it with -0.9, 0.05, 36."""
    return _make_qkx_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad)


@_jit
def make_qp_quants(n, nmax, x, L, quant_weights):
    """make_qp_quants: quantize non-negative x (sub-block scales or mins) to 0..nmax with a
    single positive scale; returns it. L is a uint8 array: C's `L[i] = l` wraps there, and the
    wrapped value is what later passes read back."""
    vmax = ZERO
    for i in range(n):
        vmax = vmax if vmax > x[i] else x[i]          # MAX(max, x[i])
    if vmax < GROUP_MAX_EPS:                         # all zero
        for i in range(n):
            L[i] = 0
        return ZERO
    fnmax = F32(nmax)
    iscale = fnmax / vmax
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 0xFF
    scale = ONE / iscale
    best_mse = ZERO
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        w = quant_weights[i]
        best_mse += w * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (TENTH * F32(step) + fnmax) / vmax
        scale_is = ONE / iscale_is
        mse = ZERO
        for i in range(n):
            l = min(nmax, nearest_int(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            w = quant_weights[i]
            mse += w * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = ZERO
    suml2 = ZERO
    for i in range(n):
        l = min(nmax, nearest_int(iscale * x[i]))
        L[i] = l & 0xFF
        w = quant_weights[i]
        fl = F32(l)                                  # C uses the int l here, not L[i]
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            li = np.int64(L[i])
            fli = F32(li)
            slx = sumlx - w * x[i] * fli
            sl2 = suml2 - w * fli * fli
            if slx > ZERO and sl2 > ZERO:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != li:
                    fnl = F32(new_l)
                    slx += w * x[i] * fnl
                    sl2 += w * fnl * fnl
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > ZERO else ZERO


@_jit
def iq4_nl_index(x):
    """best_index_int8(16, kvalues_iq4nl, x) without branches: (index, kvalues_iq4nl[index]).

    The binary search ends on the bracket val[mu-1] <= x < val[mu], mu = 1 + #{j in 1..14:
    val[j] <= x}; the bracket's ends are found by selects over the increasing table, then C's
    final comparison `x - val[mu-1] < val[mu] - x ? mu-1 : mu`. x <= val[0] gives 0; x >=
    val[15] and NaN give 15, as C's search does."""
    mu = 1
    lo = KVALUES_IQ4NL[0]
    hi = KVALUES_IQ4NL[1]
    for j in range(1, 15):
        ge = x >= KVALUES_IQ4NL[j]
        mu = mu + 1 if ge else mu
        lo = KVALUES_IQ4NL[j] if ge else lo
        hi = KVALUES_IQ4NL[j + 1] if ge else hi
    up = not (x - lo < hi - x)
    idx = mu if up else mu - 1
    val = hi if up else lo
    if x <= KVALUES_IQ4NL[0]:
        idx = 0
        val = KVALUES_IQ4NL[0]
    if x >= KVALUES_IQ4NL[15] or x != x:
        idx = 15
        val = KVALUES_IQ4NL[15]
    return idx, val


@_jit
def iq4_block_scale(x, weight):
    """The scale search of quantize_row_iq4_nl_impl (ntry = 7) on one 32-value block x with
    weights weight: d0 = -max/-127 (max: the first value of largest |x|), then the inverse
    scales (itry - 127)/max, itry = -7..7, on the kvalues_iq4nl grid, keeping the weighted
    least-squares d = sumqx/sumq2 that maximizes sumqx^2/sumq2 (strictly). 0 for a block whose
    largest |x| is below GROUP_MAX_EPS. The reference for iq4_scale_lanes."""
    n = x.shape[0]
    vmax = ZERO
    amax = ZERO
    for j in range(n):
        ax = abs(x[j])
        if ax > amax:
            amax = ax
            vmax = x[j]
    if amax < GROUP_MAX_EPS:
        return ZERO
    d = -vmax / _MINUS_127
    inv = ONE / d
    sumqx = ZERO
    sumq2 = ZERO
    for j in range(n):
        q = KVALUES_IQ4NL[best_index_int8(16, KVALUES_IQ4NL, inv * x[j])]
        w = weight[j]
        sumqx += w * q * x[j]
        sumq2 += w * q * q
    d = sumqx / sumq2 if sumq2 > ZERO else ZERO
    best = d * sumqx
    for itry in range(-7, 8):
        inv = F32(itry - 127) / vmax
        sumqx = ZERO
        sumq2 = ZERO
        for j in range(n):
            q = KVALUES_IQ4NL[best_index_int8(16, KVALUES_IQ4NL, inv * x[j])]
            w = weight[j]
            sumqx += w * q * x[j]
            sumq2 += w * q * q
        if sumq2 > ZERO and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d
