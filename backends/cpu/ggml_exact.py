"""ggml's CPU arithmetic, bit for bit, for the ops of llama and Gemma 3 graphs: an opt-in mode
of the CPU backend (`CPUBackend(ggml_exact=True)`, `EngineConfig(ggml_exact=True)`, `ggraph run
--ggml-exact`) that makes SmolLM2's (Q4_1/Q8_0) and Gemma 3 270M Q4_K_M's (Q4_K, Q6_K, Q5_0,
Q8_0) logits equal llama.cpp's (benchmarks/compare_llama_cpp.py and
compare_gemma3_llama_cpp.py --ggml-exact; benchmarks/diverge_ggml.py compares node by node).

Why a mode: the default kernels are accurate, but ggml's own rounding differs from theirs by an
ulp here and there, and Q8 activation quantization turns an ulp into a flipped integer, so the
two drift apart by ~1e-3 NMSE over 30 layers. Reproducing each rounding step removes the drift:
- quantized mul_mat (Q4_0, Q8_0, Q4_1, Q5_0): activations quantized per 32 values with
  id = 127/amax and round-half-even, d and (Q8_1) s = d * sum(q) stored as f16; integer
  products summed in 8 lanes of 4, each lane accumulated over the blocks with one fma, lanes
  reduced pairwise, Q4_1's m * s terms summed apart (x86 quants.c; tinyBLAS's Q8_0/Q5_0 kernel
  for batches does the same operations);
- Q4_K and Q6_K: backends/cpu/ggml_exact_kquants.py (Q8_K activations; the repacked Q4_K
  gemm/gemv, vec_dot and the tiled path, each where ggml takes it);
- F16 x F32 mul_mat (K*Q, V*softmax): src1 rounded to f16, tinyBLAS's 16 lanes of fma, reduced
  by halves (llamafile sgemm, AVX512);
- rms_norm: f32 squares summed in f64, mean narrowed to f32, 1.0f/sqrtf;
- rope: cos/sin cache from theta *= powf(base, -2/n_dims), libm cosf/sinf, and each rotated
  pair one fma (ggml's C++ is compiled with FP contraction);
- soft_max and swiglu: the AVX512 ggml_v_expf polynomial, 16-lane sums added in f64;
- gelu: GGML_GELU_FP16's table, f16(x) looked up (geglu = that times the up projection).
Element-wise mul, add and scale, get_rows of Q8_0 and the F32 copies round as the default
kernels do already. The CPU backend's fusion pass must be off (GGRAPH_FUSE=0): its fused norm
chain rounds as ggraph does.
It matches ggml built for AVX512F/DQ (llama-cpp-python builds natively; `host_matches_ggml_build`).
It is slower than the default kernels (scalar lanes in numba, no BLAS).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from numba import njit, prange

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType

from ..shared.kernel_args import rope_args
from . import ggml_exact_kquants as kq
from .ggml_exact_f16 import bind_mul_mat_f16
from .ggml_exact_lanes import f2h, fma32, h2f, round_f16, sum_halves

F32 = np.float32
QK = 32
# dot_rows's weight layouts (Q5_0 and Q8_0 go through tinyBLAS for batches of 2 rows or more:
# the same per-block fma over 8 lanes of 4, the same reduction, so the same numbers)
KIND = {GGMLType.Q8_0: 0, GGMLType.Q4_0: 1, GGMLType.Q4_1: 2, GGMLType.Q5_0: 3}


@njit(parallel=True, cache=True)
def quantize_q8_x86(x, qs, d, s):
    """Rows x (R, K) f32 -> int8 quants qs (R, K), f16-rounded scales d (R, K/32) and, for
    Q8_1, f16-rounded block sums s (R, K/32) = d * sum(qs)."""
    R, K = x.shape
    nb = K // QK
    for r in prange(R):
        for b in range(nb):
            amax = F32(0.0)
            for j in range(QK):
                v = abs(x[r, b * QK + j])
                if v > amax:
                    amax = v
            dd = amax / F32(127.0)
            idv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
            tot = 0
            for j in range(QK):
                q = np.int32(np.rint(x[r, b * QK + j] * idv))
                qs[r, b * QK + j] = q
                tot += q
            d[r, b] = round_f16(dd)
            s[r, b] = round_f16(dd * F32(tot))


@njit(cache=True)
def _lanes(w, m, base, off, kind, qs, r, q0, lanes):
    """The 8 lane sums of one block: lane k holds the integer products of values 4k..4k+3
    (ggml's maddubs + madd over the 32 bytes of a block)."""
    for k in range(4):
        lo = 0
        hi = 0
        for j in range(4):
            e = 4 * k + j
            if kind == 0:
                lo += np.int32(np.int8(w[m, base + off + e])) * np.int32(qs[r, q0 + e])
                hi += np.int32(np.int8(w[m, base + off + 16 + e])) * np.int32(qs[r, q0 + 16 + e])
            else:
                byte = np.int32(w[m, base + off + e])
                wl = byte & 15
                wh = byte >> 4
                if kind == 1:
                    wl -= 8
                    wh -= 8
                elif kind == 3:      # Q5_0: the fifth bit of value i is bit i of qh, -16
                    qh = (np.int64(w[m, base + 2]) | (np.int64(w[m, base + 3]) << 8) |
                          (np.int64(w[m, base + 4]) << 16) | (np.int64(w[m, base + 5]) << 24))
                    wl += np.int32(((qh >> e) & 1) << 4) - 16
                    wh += np.int32(((qh >> (e + 16)) & 1) << 4) - 16
                lo += wl * np.int32(qs[r, q0 + e])
                hi += wh * np.int32(qs[r, q0 + 16 + e])
        lanes[k] = lo
        lanes[k + 4] = hi


@njit(parallel=True, cache=True)
def dot_rows(w, kind, qs, d, s, out):
    """out[r, m] = ggml's vec_dot of weight row w[m] (raw bytes) with activation row r.
    kind 0: Q8_0 weights, 1: Q4_0, 2: Q4_1 (with Q8_1 activations)."""
    M = w.shape[0]
    R, K = qs.shape
    nb = K // QK
    bs = 34 if kind == 0 else (18 if kind == 1 else (20 if kind == 2 else 22))
    off = 4 if kind == 2 else (6 if kind == 3 else 2)
    chunk = 16
    for c in prange((M + chunk - 1) // chunk):
        acc = np.empty((R, 8), np.float32)
        summs = np.empty(R, np.float32)
        lanes = np.empty(8, np.int32)
        for m in range(c * chunk, min(M, (c + 1) * chunk)):
            acc[:] = 0
            summs[:] = 0
            for b in range(nb):
                base = b * bs
                dw = h2f(np.uint16(w[m, base]) | (np.uint16(w[m, base + 1]) << np.uint16(8)))
                mw = F32(0.0)
                if kind == 2:
                    mw = h2f(np.uint16(w[m, base + 2]) |
                              (np.uint16(w[m, base + 3]) << np.uint16(8)))
                for r in range(R):
                    if kind == 2:
                        summs[r] = summs[r] + mw * s[r, b]
                    dd = dw * d[r, b]
                    _lanes(w, m, base, off, kind, qs, r, b * QK, lanes)
                    for k in range(8):
                        acc[r, k] = fma32(dd, F32(lanes[k]), acc[r, k])
            for r in range(R):
                out[r, m] = sum_halves(acc[r]) + summs[r]


def bind_mul_mat(a_type: GGMLType, b_type: GGMLType, A: np.ndarray, B: np.ndarray,
                 D: np.ndarray):
    """A call computing D = mul_mat(A, B) as ggml's CPU does, or None where this module does
    not apply (other weight types, 3-D weights, activations not F32)."""
    if a_type in kq.UNPACK:
        return kq.bind_mul_mat(a_type, b_type, A, B, D)
    if a_type not in KIND or b_type != GGMLType.F32 or A.shape[0] * A.shape[1] != 1:
        return None
    kind = KIND[a_type]
    W = A[0, 0]
    K = B.shape[3]
    R = B.shape[0] * B.shape[1] * B.shape[2]
    qs = np.empty((R, K), np.int8)
    d = np.empty((R, K // QK), np.float32)
    s = np.empty((R, K // QK), np.float32)
    out = np.empty((R, W.shape[0]), np.float32)

    def call() -> None:
        quantize_q8_x86(np.ascontiguousarray(B).reshape(R, K), qs, d, s)
        dot_rows(W, kind, qs, d, s, out)
        D[...] = out.reshape(D.shape)

    return call


@njit(parallel=True, cache=True)
def rms_norm_rows(x, y, eps):
    """ggml's rms_norm: squares in f32 summed in f64 in order, mean narrowed to f32, scale
    1.0f/sqrtf(mean + eps) in f32, y = x * scale in f32."""
    R, n = x.shape
    for r in prange(R):
        ss = 0.0
        for i in range(n):
            ss += np.float64(x[r, i] * x[r, i])
        mean = np.float32(ss / n)
        scale = F32(1.0) / np.sqrt(mean + eps)
        for i in range(n):
            y[r, i] = x[r, i] * scale


def bind_rms_norm(a_type: GGMLType, A: np.ndarray, D: np.ndarray, eps: float):
    """ggml's rms_norm over F32 rows, or None for other layouts."""
    if a_type != GGMLType.F32 or D.dtype != np.float32:
        return None
    n = A.shape[3]
    e = np.float32(eps)

    def call() -> None:
        x = np.ascontiguousarray(A).reshape(-1, n)
        out = np.empty_like(x)
        rms_norm_rows(x, out, e)
        D[...] = out.reshape(D.shape)

    return call


@njit(parallel=True, cache=True)
def rope_rows(x, pos, y, n_dims, neox, freq_base, freq_scale, attn_factor):
    """ggml's rope without YaRN extrapolation: per token a cache of cos/sin built with
    theta *= powf(base, -2/n_dims) from theta = pos, all in f32 (libm cosf/sinf, as numba's
    float32 cos/sin call), then each pair rotated with one fma each; dims past n_dims copied."""
    n3, n2, n1, n0 = x.shape
    theta_scale = np.float32(np.power(np.float32(freq_base), np.float32(-2.0) /
                                      np.float32(n_dims)))
    for t in prange(n3 * n2):
        i3, i2 = t // n2, t % n2
        cache = np.empty(n_dims, np.float32)
        theta = np.float32(pos[i2])
        for i0 in range(0, n_dims, 2):
            th = np.float32(freq_scale) * theta
            cache[i0] = np.cos(th) * np.float32(attn_factor)
            cache[i0 + 1] = np.sin(th) * np.float32(attn_factor)
            theta = theta * theta_scale
        half = n_dims // 2
        for i1 in range(n1):
            for i0 in range(0, n_dims, 2):
                c = cache[i0]
                sn = cache[i0 + 1]
                if neox:
                    j0, j1 = i0 // 2, i0 // 2 + half
                else:
                    j0, j1 = i0, i0 + 1
                x0 = x[i3, i2, i1, j0]
                x1 = x[i3, i2, i1, j1]
                # ggml's C++ is compiled with FMA contraction: x0*c - x1*s is one fma
                y[i3, i2, i1, j0] = fma32(x0, c, -(x1 * sn))
                y[i3, i2, i1, j1] = fma32(x0, sn, x1 * c)
            for i0 in range(n_dims, n0):
                y[i3, i2, i1, i0] = x[i3, i2, i1, i0]


def bind_rope(a_type: GGMLType, A: np.ndarray, P: np.ndarray, D: np.ndarray, args: tuple,
              has_ff: bool):
    """ggml's rope for F32 without YaRN extrapolation or frequency factors, else None.
    args: the default kernel's (backends/shared/kernel_args.py rope_args)."""
    n_dims, neox, freq_base, freq_scale, ext_factor, attn_factor, _, _ = args
    if a_type != GGMLType.F32 or D.dtype != np.float32 or ext_factor != 0.0 or has_ff:
        return None
    pos = P.reshape(-1)

    def call() -> None:
        rope_rows(A, pos, D, n_dims, neox, freq_base, freq_scale, attn_factor)

    return call


# ggml_v_expf (AVX512): a polynomial after range reduction, every step one fused op; the
# constants are the published ones of Arm's optimized-routines expf
_R = np.float32(12582912.0)            # 0x1.8p23
_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_P = (np.float32(float.fromhex("0x1.0e4020p-7")), np.float32(float.fromhex("0x1.573e2ep-5")),
      np.float32(float.fromhex("0x1.555e66p-3")), np.float32(float.fromhex("0x1.fffdb6p-2")),
      np.float32(float.fromhex("0x1.ffffecp-1")))
_C5, _C4, _C3, _C2, _C1 = _P


@njit(cache=True)
def v_expf(x):
    z = fma32(x, _LOG2E, _R)
    n = z - _R
    if not abs(n) <= F32(192.0):       # also NaN-free -inf: exp(-inf) = 0
        return F32(0.0) if n < 0 else np.float32(np.inf)
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    j = fma32(fma32(fma32(_C5, b, _C4), u, fma32(_C3, b, _C2)), u, fma32(_C1, b, F32(1.0)))
    return np.float32(j * np.float32(2.0) ** np.int32(n))


@njit(parallel=True, cache=True)
def soft_max_rows(x, m, y, scale, has_mask):
    """ggml's soft_max_f32 without ALiBi or sinks: w = x * scale + mask, e = v_expf(w - max)
    16 at a time (libm expf for a tail), sum in f64 of each 16-lane sum, y = e * (float)(1/sum)."""
    n3, n2, n1, n0 = x.shape
    for t in prange(n3 * n2 * n1):
        i3, i2, i1 = t // (n2 * n1), (t // n1) % n2, t % n1
        w = np.empty(n0, np.float32)
        for i in range(n0):
            w[i] = x[i3, i2, i1, i] * scale
            if has_mask:
                w[i] = w[i] + np.float32(m[i3 % m.shape[0], i2 % m.shape[1], i1 % m.shape[2], i])
        mx = -np.float32(np.inf)
        for i in range(n0):
            if w[i] > mx:
                mx = w[i]
        e = np.empty(n0, np.float32)
        lanes = np.empty(16, np.float32)
        total = 0.0
        i = 0
        while i + 15 < n0:
            for j in range(16):
                e[i + j] = lanes[j] = v_expf(w[i + j] - mx)
            total += np.float64(sum_halves(lanes))
            i += 16
        while i < n0:
            e[i] = np.exp(w[i] - mx)
            total += np.float64(e[i])
            i += 1
        inv = np.float32(1.0 / total)
        for k in range(n0):
            y[i3, i2, i1, k] = e[k] * inv


@njit(parallel=True, cache=True)
def swiglu_rows(g, u, y):
    """ggml's swiglu: silu(g) = g / (1 + v_expf(-g)) 16 at a time, times u, in f32."""
    n3, n2, n1, n0 = g.shape
    for t in prange(n3 * n2 * n1):
        i3, i2, i1 = t // (n2 * n1), (t // n1) % n2, t % n1
        vec_end = n0 - n0 % 16          # ggml's vector loop; a scalar tail with libm expf
        for i in range(n0):
            a = g[i3, i2, i1, i]
            if i < vec_end:
                s = a / (F32(1.0) + v_expf(F32(0.0) - a))
            else:
                s = a / (F32(1.0) + np.exp(-a))
            y[i3, i2, i1, i] = s * u[i3, i2, i1, i]


@njit(cache=True)
def gelu_table():
    """ggml_table_gelu_f16: for every f16 bit pattern h, f16(gelu_f32(h)) with the tanh form
    0.5x(1 + tanhf(sqrt(2/pi) x (1 + 0.044715 x^2))) in f32, 1 + 0.044715x*x one fma (GCC
    contracts it); checked against the library's own table by
    tests/backends/cpu/test_ggml_exact.py."""
    tab = np.empty(65536, np.uint16)
    for h in range(65536):
        x = h2f(np.uint16(h))
        inner = fma32(F32(0.044715) * x, x, F32(1.0))
        y = F32(0.5) * x * (F32(1.0) + np.tanh(F32(0.7978845608028654) * x * inner))
        tab[h] = f2h(y)
    return tab


@njit(parallel=True, cache=True)
def gelu_rows(x, y, tab):
    """ggml_vec_gelu_f32 (GGML_GELU_FP16): 0 at or below -10, x at or above 10, else the
    table's value at f16(x)."""
    n = x.shape[0]
    for i in prange(n):
        v = x[i]
        if v <= F32(-10.0):
            y[i] = F32(0.0)
        elif v >= F32(10.0):
            y[i] = v
        else:
            y[i] = h2f(tab[f2h(v)])


def bind_gelu(A: np.ndarray, D: np.ndarray):
    """ggml's gelu on contiguous F32, else None."""
    if A.dtype != np.float32 or D.dtype != np.float32 or not A.flags.c_contiguous or \
            not D.flags.c_contiguous or A.shape != D.shape:
        return None
    tab = _gelu_table()
    return lambda: gelu_rows(A.reshape(-1), D.reshape(-1), tab)


_TABLES: dict[str, np.ndarray] = {}


def _gelu_table() -> np.ndarray:
    if "gelu" not in _TABLES:
        _TABLES["gelu"] = gelu_table()
    return _TABLES["gelu"]


def bind_soft_max(A: np.ndarray, M, D: np.ndarray, p, has_sinks: bool):
    """ggml's soft_max_ext on F32 rows with an F32/F16 mask, without ALiBi or sinks."""
    if A.dtype != np.float32 or D.dtype != np.float32 or p.max_bias != 0.0 or has_sinks:
        return None
    mask = np.zeros((1, 1, 1, A.shape[3]), np.float32) if M is None else M
    conv = mask.dtype == np.uint16          # F16 mask bits
    scale = np.float32(p.scale)

    def call() -> None:
        mm = mask.view(np.float16).astype(np.float32) if conv else mask
        soft_max_rows(A, mm, D, scale, M is not None)

    return call


def bind_swiglu(G: np.ndarray, U: np.ndarray, D: np.ndarray):
    if G.dtype != np.float32 or U.dtype != np.float32 or D.dtype != np.float32 or \
            G.shape != U.shape or G.shape != D.shape:
        return None
    return lambda: swiglu_rows(G, U, D)


def host_matches_ggml_build() -> bool:
    """The mode reproduces ggml built for this CPU with AVX512F/DQ (llama-cpp-python builds
    natively): tinyBLAS's 16-lane F16 products and the AVX512 ggml_v_expf."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512f" in flags and " avx512dq" in flags


# -- the kernel table: each exact kernel binds where it applies, else the default one does ----

def _mul_mat(node: Tensor, s: Any):
    a, b = node.src
    A, B, D = s.arr(a), s.arr(b), s.arr(node)
    if a.type == GGMLType.F16 and b.type == GGMLType.F32:
        return bind_mul_mat_f16(A, B, D)
    return bind_mul_mat(a.type, b.type, A, B, D)


def _rms_norm(node: Tensor, s: Any):
    a = node.src[0]
    return bind_rms_norm(a.type, s.arr(a), s.arr(node), node.params.eps)


def _soft_max(node: Tensor, s: Any):
    a, mask, sinks = node.src
    return bind_soft_max(s.arr(a), s.arr(mask) if mask is not None else None, s.arr(node),
                         node.params, sinks is not None)


def _rope(node: Tensor, s: Any):
    a, pos, ff = node.src
    return bind_rope(a.type, s.arr(a), s.arr(pos), s.arr(node), rope_args(node), ff is not None)


def _swiglu(node: Tensor, s: Any):
    a, b = node.src
    return bind_swiglu(s.arr(a), s.arr(b), s.arr(node))


def _gelu(node: Tensor, s: Any):
    return bind_gelu(s.arr(node.src[0]), s.arr(node))


EXACT: dict[OpKind, Callable[[Tensor, Any], Any]] = {
    OpKind.MUL_MAT: _mul_mat, OpKind.RMS_NORM: _rms_norm, OpKind.SOFT_MAX: _soft_max,
    OpKind.ROPE: _rope, OpKind.SWIGLU: _swiglu, OpKind.GELU: _gelu}


def kernel_table(base: dict) -> dict:
    """The CPU kernel table with these ops computed as ggml does where the exact kernels
    apply (types, layouts), and by the default kernel elsewhere."""
    table = dict(base)
    for op, exact in EXACT.items():
        k = base[op]
        table[op] = dataclasses.replace(
            k, fn=lambda node, s, exact=exact, k=k: exact(node, s) or k.fn(node, s))
    return table
