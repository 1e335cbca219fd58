"""Conversion between float32 rows and ggml's storage formats (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0 here; the K-quants, IQ4_NL, IQ4_XS and Q8_K in ggraph/codecs/quants_k.py).

This module owns the byte layout and the exact rounding of every float type ggraph stores:
`quantize` turns float rows into the bytes ggml would write, `dequantize` turns such bytes
back into float32. Both are vectorized numpy and bit-exact with ggml's reference C code
(`ggml-quants.c`, `ggml-impl.h`) on x86-64, hence with `gguf.quants`:

- Input is first converted to float32, as ggml's sources are f32; all block arithmetic is
  done in f32 with one rounding per C operation (no fused multiply-add). Only the stored
  scale `d` (and `m` for Q4_1) is rounded to f16; the quantization itself uses the f32 `d`
  and `id = 1/d` (0 when d == 0).
- Q8_0 rounds half away from zero, like C `roundf` (not numpy's half-to-even `rint`).
- Q4_0 / Q4_1 truncate `x*id + 8.5` / `(x-min)*id + 0.5` toward zero and cap at 15; Q5_0 /
  Q5_1 the same with `16.5` / `0.5`, capped at 31, the fifth bits packed in a 32-bit `qh`.
- When `1/d` overflows (a block whose largest magnitude is subnormal) or the input holds
  inf/NaN, the f32 value handed to the integer cast is not finite. C leaves that cast
  undefined; x86 (and gguf's numpy) yields 0, and so does this module, explicitly.
- BF16 keeps the upper 16 bits of the f32 with round-to-nearest-even; NaN becomes the quiet
  NaN `(bits >> 16) | 64`; values that round past the largest bf16 become inf.

All multi-byte fields are little-endian, as in GGUF files, whatever the host.

Each type's record (ggraph/ir/types.py) is registered here, by `register_type` next to
its numpy code: block layout, these kernels, its scale offsets, the names of its compiled
codecs in backends/shared/codecs.py and its roles (weight, KV cache, storable), and the type
ggml's CPU dot products round activations to for it (vec_dot_type).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ggraph.ir.types import TYPE_RECORDS, register_type
from ggraph.ir.types import GGMLType, row_size

__all__ = ["quantize", "dequantize", "f32_to_bf16_bits", "bf16_bits_to_f32", "first_nonfinite"]

# blocks handled per numpy pass: bounds the temporaries (a few MiB each) for huge tensors
_CHUNK_BLOCKS = 1 << 16

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> uint16 bf16 bits (ggml_compute_fp32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    # u + 0x7fff + lsb cannot wrap for non-NaN u (largest is 0xff800000 = -inf)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    quiet = (u >> np.uint32(16)) | np.uint32(64)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact: the bits become the upper half of the f32)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_quantize(x: np.ndarray) -> np.ndarray:
    return x.astype(_F32, copy=False)


def _f32_dequantize(data: np.ndarray) -> np.ndarray:
    return data.view(_F32).astype(np.float32)


def _f16_quantize(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond 65504 becomes inf, as in ggml
        return x.astype(_F16)


def _f16_dequantize(data: np.ndarray) -> np.ndarray:
    return data.view(_F16).astype(np.float32)


def _bf16_quantize(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x).astype(_U16, copy=False)


def _bf16_dequantize(data: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(data.view(_U16))


# element types: whole-array converters; (unsigned view, exponent mask): all-ones is inf/NaN
_ROLES = dict(weight=True, kv=True, storable=True)
register_type(GGMLType.F32, 1, 4, numpy_dtype="float32", quantize=_f32_quantize,
              dequantize=_f32_dequantize, float_bits=("<u4", 0x7F800000),
              codecs=("load_f32", "store_f32", "load1_f32"), vec_dot_type=GGMLType.F32, **_ROLES)
register_type(GGMLType.F16, 1, 2, numpy_dtype="float16", quantize=_f16_quantize,
              dequantize=_f16_dequantize, float_bits=("<u2", 0x7C00),
              codecs=("load_f16", "store_f16", "load1_f16"), vec_dot_type=GGMLType.F16, **_ROLES)
register_type(GGMLType.BF16, 1, 2, numpy_dtype="uint16",  # raw bits; converted here
              quantize=_bf16_quantize, dequantize=_bf16_dequantize, float_bits=("<u2", 0x7F80),
              codecs=("load_bf16", "store_bf16", "load1_bf16"), vec_dot_type=GGMLType.BF16,
              **_ROLES)
# Q4_1 and Q5_1 dot with ggml's Q8_1, which stores Q8_0's values plus their sum: ggraph, which
# only needs the rounded values, rounds to Q8_0
_Q8 = dict(vec_dot_type=GGMLType.Q8_0)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """(nb,) float32 -> (nb, 2) uint8: little-endian f16, round-to-nearest-even."""
    return v.astype(_F16).view(np.uint8).reshape(-1, 2)


def _f16_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """The f16 stored at byte offset `at` of each block, as a (nb, 1) float32 column."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(_F16).astype(np.float32)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1/d in f32, 0 where d == 0 (inf where 1/d overflows, as in C)."""
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _trunc_nibbles(v: np.ndarray) -> np.ndarray:
    """min(15, (int)v) for v >= 0 as uint8, with non-finite v -> 0 (x86 behavior)."""
    v = np.where(np.isfinite(v), v, np.float32(0))
    return np.clip(np.trunc(v), 0, 15).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(nb, 32) values 0..15 -> (nb, 16) bytes: qs[j] = q[j] | q[j + 16] << 4."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _unpack_nibbles(qs: np.ndarray, out: np.ndarray) -> None:
    """(nb, 16) bytes -> out (nb, 32) float32 holding the 4-bit values."""
    out[:, :16] = qs & np.uint8(0x0F)
    out[:, 16:] = qs >> np.uint8(4)


def _q4_0_quantize(x: np.ndarray, out: np.ndarray) -> None:
    rows = np.arange(x.shape[0])
    vmax = x[rows, np.abs(x).argmax(axis=1)]  # first element of largest |x|, sign kept
    d = vmax / np.float32(-8)
    id_ = _inverse(d)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:18] = _pack_nibbles(_trunc_nibbles(x * id_[:, None] + np.float32(8.5)))


def _q4_0_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    _unpack_nibbles(b[:, 2:18], out)
    out -= np.float32(8)
    out *= _f16_field(b, 0)


register_type(GGMLType.Q4_0, 32, 18, quantize=_q4_0_quantize, dequantize=_q4_0_dequantize,
              scale_fields=(0,), codecs=("dec_q4_0", "enc_q4_0", "dot_q4_0"),
              qdot="qdot_q4_0", **_ROLES, **_Q8)


def _q4_1_quantize(x: np.ndarray, out: np.ndarray) -> None:
    vmin = x.min(axis=1)
    vmax = x.max(axis=1)
    d = (vmax - vmin) / np.float32(15)
    id_ = _inverse(d)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(vmin)
    v = (x - vmin[:, None]) * id_[:, None] + np.float32(0.5)
    out[:, 4:20] = _pack_nibbles(_trunc_nibbles(v))


def _q4_1_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    _unpack_nibbles(b[:, 4:20], out)
    out *= _f16_field(b, 0)
    out += _f16_field(b, 2)


register_type(GGMLType.Q4_1, 32, 20, quantize=_q4_1_quantize, dequantize=_q4_1_dequantize,
              scale_fields=(0, 2), codecs=("dec_q4_1", "enc_q4_1", "dot_q4_1"),
              qdot="qdot_q4_1", **_ROLES, **_Q8)


def _q8_0_quantize(x: np.ndarray, out: np.ndarray) -> None:
    d = np.abs(x).max(axis=1) / np.float32(127)
    id_ = _inverse(d)
    v = x * id_[:, None]
    a = np.abs(v)
    r = np.floor(a)
    r += (a - r) >= np.float32(0.5)  # roundf: half away from zero; a - floor(a) is exact
    r = np.where(np.isfinite(v), np.copysign(r, v), np.float32(0))
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:34] = np.clip(r, -128, 127).astype(np.int8).view(np.uint8)


def _q8_0_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    out[:] = b[:, 2:34].view(np.int8)
    out *= _f16_field(b, 0)


register_type(GGMLType.Q8_0, 32, 34, quantize=_q8_0_quantize, dequantize=_q8_0_dequantize,
              scale_fields=(0,), codecs=("dec_q8_0", "enc_q8_0", "dot_q8_0"),
              qdot="qdot_q8_0", **_ROLES, **_Q8)


def _trunc_fives(v: np.ndarray) -> np.ndarray:
    """min(31, (int)v) for v >= 0 as uint8, with non-finite v -> 0 (x86 behavior)."""
    v = np.where(np.isfinite(v), v, np.float32(0))
    return np.clip(np.trunc(v), 0, 31).astype(np.uint8)


def _pack_fives(q: np.ndarray, out: np.ndarray) -> None:
    """(nb, 32) values 0..31 -> out (nb, 20): qh (bit j: the fifth bit of q[j]), then nibbles."""
    out[:, 0:4] = np.packbits(q >> np.uint8(4), axis=1, bitorder="little")
    out[:, 4:20] = _pack_nibbles(q & np.uint8(15))


def _unpack_fives(b: np.ndarray, out: np.ndarray) -> None:
    """(nb, 20) bytes (qh, nibbles) -> out (nb, 32) float32 holding the 5-bit values."""
    _unpack_nibbles(b[:, 4:20], out)
    out += np.unpackbits(b[:, 0:4], axis=1, bitorder="little").astype(np.float32) * 16


def _q5_0_quantize(x: np.ndarray, out: np.ndarray) -> None:
    rows = np.arange(x.shape[0])
    vmax = x[rows, np.abs(x).argmax(axis=1)]
    d = vmax / np.float32(-16)
    id_ = _inverse(d)
    out[:, 0:2] = _f16_bytes(d)
    _pack_fives(_trunc_fives(x * id_[:, None] + np.float32(16.5)), out[:, 2:22])


def _q5_0_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    _unpack_fives(b[:, 2:22], out)
    out -= np.float32(16)
    out *= _f16_field(b, 0)


register_type(GGMLType.Q5_0, 32, 22, quantize=_q5_0_quantize, dequantize=_q5_0_dequantize,
              scale_fields=(0,), codecs=("dec_q5_0", "enc_q5_0", "dot_q5_0"),
              qdot="qdot_q5_0", **_ROLES, **_Q8)


def _q5_1_quantize(x: np.ndarray, out: np.ndarray) -> None:
    vmin = x.min(axis=1)
    d = (x.max(axis=1) - vmin) / np.float32(31)
    id_ = _inverse(d)
    out[:, 0:2] = _f16_bytes(d)
    out[:, 2:4] = _f16_bytes(vmin)
    v = (x - vmin[:, None]) * id_[:, None] + np.float32(0.5)
    _pack_fives(_trunc_fives(v), out[:, 4:24])


def _q5_1_dequantize(b: np.ndarray, out: np.ndarray) -> None:
    _unpack_fives(b[:, 4:24], out)
    out *= _f16_field(b, 0)
    out += _f16_field(b, 2)


register_type(GGMLType.Q5_1, 32, 24, quantize=_q5_1_quantize, dequantize=_q5_1_dequantize,
              scale_fields=(0, 2), codecs=("dec_q5_1", "enc_q5_1", "dot_q5_1"),
              qdot="qdot_q5_1", **_ROLES, **_Q8)

from ggraph.codecs import quants_k as _quants_k  # noqa: E402,F401  (K-quants, IQ4, Q8_K: same registry)

# index types: stored, never converted; compiled as plain integer loads/stores
register_type(GGMLType.I32, 1, 4, numpy_dtype="int32", integer=True,
              codecs=("load_int", "store_int", "load1_f32"))
register_type(GGMLType.I64, 1, 8, numpy_dtype="int64", integer=True,
              codecs=("load_int", "store_int", "load1_f32"))
_missing = [t for t in GGMLType if t not in TYPE_RECORDS]
assert not _missing, f"types without a record: {_missing}"

_Kernel = Callable[[np.ndarray, np.ndarray], None]


def _over_blocks(kernel: _Kernel, src: np.ndarray, out: np.ndarray) -> None:
    """Apply `kernel` to (nb, ...) `src` writing (nb, ...) `out`, a chunk of blocks at a time."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for s in range(0, src.shape[0], _CHUNK_BLOCKS):
            kernel(src[s:s + _CHUNK_BLOCKS], out[s:s + _CHUNK_BLOCKS])


def _storable(t: GGMLType | str | int, action: str) -> GGMLType:
    t = GGMLType.parse(t)
    if not (t.is_float or t.is_quantized):
        raise ValueError(f"cannot {action} type {t}: not a float or quantized type")
    return t


def quantize(t: GGMLType, x: np.ndarray) -> np.ndarray:
    """Float rows (..., n) -> uint8 (..., row_size(t, n)): the bytes ggml stores for type `t`.

    `x` is converted to float32 first; n must be a multiple of t's block size.
    """
    t = _storable(t, "quantize to")
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"cannot quantize a scalar to {t}; expected an array of shape (..., n)")
    if x.dtype.kind not in "fiub":
        raise TypeError(f"cannot quantize {x.dtype} data to {t}; expected real numbers")
    n = x.shape[-1]
    if n % t.block_size:
        raise ValueError(f"cannot quantize rows of {n} elements to {t}: {n} is not a "
                         f"multiple of its block size {t.block_size}")
    lead = x.shape[:-1]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rec = TYPE_RECORDS[t]
    if rec.quantize is None:
        raise NotImplementedError(f"no quantizer for {t}: ggraph can read and compute with {t} "
                                  f"data but cannot yet write it")
    if not rec.is_quantized:
        raw = rec.quantize(x)
    else:
        blocks = x.reshape(-1, t.block_size)
        raw = np.empty((blocks.shape[0], t.type_size), dtype=np.uint8)
        _over_blocks(rec.quantize, blocks, raw)
    return raw.view(np.uint8).reshape(*lead, row_size(t, n))


def dequantize(t: GGMLType, data: np.ndarray, n: int | None = None) -> np.ndarray:
    """uint8 rows (..., nbytes) of type `t` -> float32 (..., n).

    n, the elements per row, defaults to what nbytes holds; when given it must match.
    """
    t = _storable(t, "dequantize")
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise TypeError(f"dequantize expects uint8 bytes, got {data.dtype}")
    if data.ndim == 0:
        raise ValueError("cannot dequantize a scalar; expected bytes of shape (..., nbytes)")
    nbytes = data.shape[-1]
    if nbytes % t.type_size:
        raise ValueError(f"cannot dequantize {t}: {nbytes} bytes per row is not a multiple "
                         f"of its type size {t.type_size}")
    n_have = nbytes // t.type_size * t.block_size
    if n is not None and n != n_have:
        raise ValueError(f"{nbytes} bytes per row of {t} hold {n_have} elements, not {n}")
    lead = data.shape[:-1]
    data = np.ascontiguousarray(data)
    rec = TYPE_RECORDS[t]
    if not rec.is_quantized:
        out = rec.dequantize(data)
    else:
        blocks = data.reshape(-1, t.type_size)
        out = np.empty((blocks.shape[0], t.block_size), dtype=np.float32)
        _over_blocks(rec.dequantize, blocks, out)
    return out.reshape(*lead, n_have)


# where the f16 scales sit in each block (the only floats a quantized block stores), and the
# (unsigned view, exponent mask) of the float element types: derived from the records
_SCALE_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    t: r.scale_fields for t, r in TYPE_RECORDS.items() if r.scale_fields}
_FLOAT_BITS: dict[GGMLType, tuple[str, int]] = {
    t: r.float_bits for t, r in TYPE_RECORDS.items() if r.float_bits}


def first_nonfinite(t: GGMLType, raw: np.ndarray) -> int:
    """Index of the first element (float types) or block (quantized types) of the bytes
    `raw` that holds inf or NaN, -1 when all are finite (llama.cpp's --check-tensors:
    floats, and the f16 scales of quantized blocks). Reads the bits, converts nothing."""
    raw = np.asarray(raw).reshape(-1)
    if t in _FLOAT_BITS:
        dt, mask = _FLOAT_BITS[t]
        bits = raw[:raw.nbytes - raw.nbytes % np.dtype(dt).itemsize].view(dt)
        fields = [bits]
    elif t in _SCALE_FIELDS:
        blocks = raw[:raw.nbytes - raw.nbytes % t.type_size].reshape(-1, t.type_size)
        mask = 0x7C00
        fields = [blocks[:, at:at + 2] for at in _SCALE_FIELDS[t]]
    else:
        return -1 if t.is_int else _first_nonfinite_decoded(t, raw)
    n, step = fields[0].shape[0], 1 << 22  # bounds the temporaries
    for s in range(0, n, step):
        bad = None
        for f in fields:
            chunk = f[s:s + step]
            if chunk.ndim == 2:  # a (blocks, 2) byte column: one little-endian f16 each
                chunk = np.ascontiguousarray(chunk).view("<u2").reshape(-1)
            hits = np.flatnonzero((chunk & mask) == mask)
            if hits.size:
                bad = hits[0] if bad is None else min(bad, hits[0])
        if bad is not None:
            return s + int(bad)
    return -1


def _first_nonfinite_decoded(t: GGMLType, raw: np.ndarray) -> int:
    """The slow path for a type without a scale table: dequantize block rows and look."""
    blocks = raw[:raw.nbytes - raw.nbytes % t.type_size].reshape(-1, t.type_size)
    for s in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        vals = dequantize(t, blocks[s:s + _CHUNK_BLOCKS]).reshape(-1, t.block_size)
        bad = np.flatnonzero(~np.isfinite(vals).all(axis=1))
        if bad.size:
            return s + int(bad[0])
    return -1
