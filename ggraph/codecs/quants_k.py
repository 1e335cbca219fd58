"""The K-quants (Q2_K .. Q6_K), IQ4_NL, IQ4_XS and Q8_K: their block layouts, numpy codecs
and records (ggraph/ir/types.py), in the same registry as ggraph/codecs/quants.py's types.

K-quants pack 256 elements per block ("super-block") in 16 or 8 sub-blocks with their own
small integer scales (and mins), times one or two f16 super-block scales. IQ4_NL maps 4-bit
indices through a fixed non-linear table of 16 int8 values (32 per block); IQ4_XS uses the same
table with 6-bit sub-block scales over 256. Q8_K (f32 scale, int8 values, int16 sums of 16) is
never a tensor's type: it is what ggml's CPU rounds activations to before dotting them with a
K-quant or IQ4_XS weight (its vec_dot_type).

Every `dequantize` kernel is bit-exact with gguf.quants (one f32 rounding per C operation, in
ggml's order: `d * sc` first, then times the quant, then minus `dmin * m`). Quantizers here:
IQ4_NL (ggml's quantize_row_iq4_nl_ref, the conversion set_rows/cpy use) and Q8_K
(quantize_row_q8_K_ref); the K-quant and IQ4_XS records have no quantizer yet (quantize=None:
`ggraph.codecs.quants.quantize` refuses them by name).
"""
from __future__ import annotations

import numpy as np

from ggraph.codecs.kquantize import KQUANT_KERNELS
from ggraph.ir.types import register_type
from ggraph.ir.types import GGMLType

__all__ = ["KVALUES_IQ4NL", "QK_K"]

QK_K = 256  # elements per K-quant super-block
# IQ4_NL / IQ4_XS dequantization table (ggml-common.h kvalues_iq4nl)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                          1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_KV_F32 = KVALUES_IQ4NL.astype(np.float32)
_F16 = np.dtype("<f2")
_F32 = np.dtype("<f4")
_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT4 = np.array([0, 4], dtype=np.uint8)
_BITS8 = np.arange(8, dtype=np.uint8)


def _f16_at(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte offset `at` of each block, as a (nb, 1) float32 column."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(_F16).astype(np.float32)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes per block -> (scales, mins), 8 six-bit values each (nb, 8)."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q2_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    sc = b[:, 0:16]
    dl = _f16_at(b, 80) * (sc & 15).astype(np.float32)
    ml = _f16_at(b, 82) * (sc >> 4).astype(np.float32)
    # element n*128 + j*32 + l: bits 2j of byte n*32 + l; sub-block (16 elements) n*8 + 2j + l//16
    q = (b[:, 16:80].reshape(nb, 2, 1, 32) >> _SHIFT2[:, None]) & 3
    q = q.reshape(nb, 16, 16).astype(np.float32)
    out[:] = (dl[:, :, None] * q - ml[:, :, None]).reshape(nb, QK_K)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K: 12 bytes -> 16 signed six-bit scales (nb, 16) float32: low nibbles from bytes 0-7
    (then their high nibbles), two high bits from bytes 8-11, offset by 32."""
    nb = s.shape[0]
    low = np.concatenate([s[:, 0:8] & 15, s[:, 0:8] >> 4], axis=1)
    high = ((s[:, 8:12].reshape(nb, 1, 4) >> _SHIFT2[:, None]) & 3).reshape(nb, 16)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.float32)


def _q3_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    dl = _f16_at(b, 108) * _q3_k_scales(b[:, 96:108])
    q = (b[:, 32:96].reshape(nb, 2, 1, 32) >> _SHIFT2[:, None]) & 3      # (nb, 2, 4, 32)
    h = (b[:, 0:32].reshape(nb, 1, 32) >> _BITS8[:, None]) & 1          # bit n*4 + j
    v = q.astype(np.int8) - ((h.reshape(nb, 2, 4, 32) ^ 1) << 2).astype(np.int8)
    out[:] = (dl[:, :, None] * v.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K)


def _q4_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = _f16_at(b, 0) * sc
    dm = _f16_at(b, 2) * mn
    q = (b[:, 16:144].reshape(nb, 4, 1, 32) >> _SHIFT4[:, None]) & 15   # sub-block 2j + hi
    q = q.reshape(nb, 8, 32).astype(np.float32)
    out[:] = (d[:, :, None] * q - dm[:, :, None]).reshape(nb, QK_K)


def _q5_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = _f16_at(b, 0) * sc
    dm = _f16_at(b, 2) * mn
    ql = ((b[:, 48:176].reshape(nb, 4, 1, 32) >> _SHIFT4[:, None]) & 15).reshape(nb, 8, 32)
    qh = (b[:, 16:48].reshape(nb, 1, 32) >> _BITS8[:, None]) & 1       # sub-block i: bit i
    q = (ql | (qh << 4)).astype(np.float32)
    out[:] = (d[:, :, None] * q - dm[:, :, None]).reshape(nb, QK_K)


def _q6_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    d = _f16_at(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)     # (nb, 16)
    ql = ((b[:, 0:128].reshape(nb, 2, 1, 64) >> _SHIFT4[:, None]) & 15).reshape(nb, 8, 32)
    qh = ((b[:, 128:192].reshape(nb, 2, 1, 32) >> _SHIFT2[:, None]) & 3).reshape(nb, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int8) - np.int8(32)).reshape(nb, 16, 16)
    out[:] = (d[:, :, None] * q.astype(np.float32)).reshape(nb, QK_K)


def _iq4_nl_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    qs = b[:, 2:18]
    out[:, :16] = _KV_F32[qs & 15]
    out[:, 16:] = _KV_F32[qs >> 4]
    out *= _f16_at(b, 0)


def _iq4_xs_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    nb = b.shape[0]
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")                    # (nb, 1)
    lo = ((b[:, 4:8].reshape(nb, 4, 1) >> _SHIFT4) & 15).reshape(nb, 8)
    hi = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    dl = _f16_at(b, 0) * ls.astype(np.float32)                          # (nb, 8)
    qs = b[:, 8:136].reshape(nb, 8, 1, 16) >> _SHIFT4[:, None]           # (nb, 8, 2, 16)
    v = _KV_F32[(qs & 15).reshape(nb, 8, 32)]
    out[:] = (dl[:, :, None] * v).reshape(nb, QK_K)


def _best_index_iq4(v: np.ndarray) -> np.ndarray:
    """ggml's best_index_int8 over KVALUES_IQ4NL, element-wise: the nearest table entry, the
    upper one on a tie; NaN -> 15 (as the C binary search ends)."""
    mu = np.clip(np.searchsorted(_KV_F32, v, side="right"), 1, 15)
    lo, hi = _KV_F32[mu - 1], _KV_F32[mu]
    idx = np.where(v - lo < hi - v, mu - 1, mu)
    idx = np.where(v <= _KV_F32[0], 0, idx)
    return np.where(v >= _KV_F32[15], 15, idx).astype(np.uint8)


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(largest |x|, the first x holding it) per row, skipping NaN as C's `ax > amax` does."""
    a = np.abs(x)
    a = np.where(np.isnan(a), np.float32(-1), a)
    i = a.argmax(axis=1)
    rows = np.arange(x.shape[0])
    return np.maximum(a[rows, i], np.float32(0)), x[rows, i]


def _iq4_nl_quantize(x: np.ndarray, out: np.ndarray) -> None:
    """quantize_row_iq4_nl_ref (no importance weights, no scale search): indices from
    d0 = max / -127, then the weighted least-squares scale sum(w q x) / sum(w q q), w = x*x,
    summed in element order (f32, one rounding per operation). An all-zero block (largest |x|
    below 1e-15) stores d = 0 and index 0; ggml leaves that block's indices unwritten."""
    amax, vmax = _first_absmax(x)
    live = amax >= np.float32(1e-15)
    d0 = np.where(live, vmax, np.float32(1)) / np.float32(-127)
    L = _best_index_iq4((np.float32(1) / d0)[:, None] * x)
    q = _KV_F32[L]
    w = x * x
    sqx = np.zeros(x.shape[0], np.float32)
    sq2 = np.zeros(x.shape[0], np.float32)
    for j in range(32):  # C's order, not numpy's pairwise sum
        wq = w[:, j] * q[:, j]
        sqx += wq * x[:, j]
        sq2 += wq * q[:, j]
    d = np.where(sq2 > 0, sqx / np.where(sq2 > 0, sq2, np.float32(1)), np.float32(0))
    d = np.where(live, d, np.float32(0))
    L = np.where(live[:, None], L, np.uint8(0))
    out[:, 0:2] = d.astype(_F16).view(np.uint8).reshape(-1, 2)
    out[:, 2:18] = L[:, :16] | (L[:, 16:] << np.uint8(4))


def _q8_k_quantize(x: np.ndarray, out: np.ndarray) -> None:
    """quantize_row_q8_K_ref: iscale = -127 / (the first x of largest |x|), q = round half to
    even (ggml's nearest_int) of iscale*x capped at 127, d = 1/iscale; int16 sums of each 16.
    An all-zero block stores zeros (ggml leaves its sums unwritten)."""
    amax, vmax = _first_absmax(x)
    live = amax > 0
    iscale = np.float32(-127) / np.where(live, vmax, np.float32(1))
    v = np.rint(iscale[:, None] * x)
    v = np.where(np.isfinite(v) & live[:, None], v, np.float32(0))
    q = np.minimum(v, np.float32(127)).astype(np.int8)
    d = np.where(live, np.float32(1) / iscale, np.float32(0)).astype(_F32)
    out[:, 0:4] = d.view(np.uint8).reshape(-1, 4)
    out[:, 4:260] = q.view(np.uint8)
    sums = q.reshape(-1, 16, 16).astype(np.int16).sum(axis=2, dtype=np.int16).astype("<i2")
    out[:, 260:292] = sums.view(np.uint8).reshape(-1, 32)


def _q8_k_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    d = np.ascontiguousarray(b[:, 0:4]).view(_F32).astype(np.float32)
    out[:] = d * b[:, 4:260].view(np.int8).astype(np.float32)


# K-quants and IQ4_XS: weights only (ggml has no K-quant KV cache); dotted with Q8_K
# activations. Their quantizers (ggraph/codecs/kquantize.py) are ggml's reference quantizers, bit
# for
# bit; numpy only (no compiled encoder: nothing stores them at run time).
_K = dict(weight=True, vec_dot_type=GGMLType.Q8_K)


def _kq(name: str):
    return KQUANT_KERNELS[name][0]


register_type(GGMLType.Q2_K, QK_K, 84, quantize=_kq("Q2_K"),
              dequantize=_q2_k_dequantize, scale_fields=(80, 82),
              codecs=("dec_q2_k", "", "dot_q2_k"), qdot="qdot_q2_k", **_K)
register_type(GGMLType.Q3_K, QK_K, 110, quantize=_kq("Q3_K"),
              dequantize=_q3_k_dequantize, scale_fields=(108,),
              codecs=("dec_q3_k", "", "dot_q3_k"), qdot="qdot_q3_k", **_K)
register_type(GGMLType.Q4_K, QK_K, 144, quantize=_kq("Q4_K"),
              dequantize=_q4_k_dequantize, scale_fields=(0, 2),
              codecs=("dec_q4_k", "", "dot_q4_k"), qdot="qdot_q4_k", **_K)
register_type(GGMLType.Q5_K, QK_K, 176, quantize=_kq("Q5_K"),
              dequantize=_q5_k_dequantize, scale_fields=(0, 2),
              codecs=("dec_q5_k", "", "dot_q5_k"), qdot="qdot_q5_k", **_K)
register_type(GGMLType.Q6_K, QK_K, 210, quantize=_kq("Q6_K"),
              dequantize=_q6_k_dequantize, scale_fields=(208,),
              codecs=("dec_q6_k", "", "dot_q6_k"), qdot="qdot_q6_k", **_K)
# IQ4_NL: llama.cpp accepts it as a KV cache type (-ctk/-ctv iq4_nl); dotted with Q8_0
register_type(GGMLType.IQ4_NL, 32, 18, quantize=_iq4_nl_quantize, dequantize=_iq4_nl_dequantize,
              scale_fields=(0,), codecs=("dec_iq4_nl", "enc_iq4_nl", "dot_iq4_nl"),
              weight=True, kv=True, storable=True, vec_dot_type=GGMLType.Q8_0)
register_type(GGMLType.IQ4_XS, QK_K, 136, quantize=_kq("IQ4_XS"),
              dequantize=_iq4_xs_dequantize, scale_fields=(0,),
              codecs=("dec_iq4_xs", "", "dot_iq4_xs"), **_K)
# Q8_K: activations only (no role); its scale is an f32, so no f16 scale fields
register_type(GGMLType.Q8_K, QK_K, 292, quantize=_q8_k_quantize, dequantize=_q8_k_dequantize,
              codecs=("dec_q8_k", "enc_q8_k", "dot_q8_k"))
