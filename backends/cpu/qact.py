"""The CPU's activation quantizer for the K-quants' integer dots: a float32 row to Q8_K blocks
(their vec_dot_type), as every such product quantizes its activations before it reads a
weight, in loops that LLVM vectorizes.

`enc_q8_k` gives the shared encoder's bytes (backends/shared/codecs_k.enc_q8_k: ggml's
quantize_row_q8_K_ref; tests/backends/cpu/test_qact.py compares every byte, zero blocks, NaN,
ties of the largest magnitude and rounding halves included) with the same call
(v, x, i3, i2, i1, n), so the kernels bind it as `enc_r` in the shared one's place. That one
is a loop of scalar steps whose 16-element sums never reach their vectorized loop: one decode
column took 4.2 us for 1536 elements and 23 us for 8960 (Intel Xeon Ice Lake), on one thread
before the product's threads start, ~2% of a Qwen2.5 1.5B decode step, twice that share at 2
threads. Here (1.9 and 8.4 us):
- the largest magnitude is an integer max over the float bits with the sign cleared (NaN
  bit patterns, above infinity's, count as 0: skipped, as the shared strict compare skips
  them), and the first element of that magnitude an integer min over indices;
- halves round to even by the CPU's instruction (np.rint: LLVM's rint, vroundps; not by
  adding and taking off 1.5 * 2^23, which the fast-math kernels that inline this fold
  away), and a product that is not finite gives 0, as the shared `_finite_or_zero`;
- the 16-element sums come from a tree of pairwise adds, each level a loop that vectorizes.

An infinite activation makes the scale infinite (1 / -0, ggml's value) where the shared
encoder, compiled with Python's division, raises ZeroDivisionError.

Q8_0 (the 32-element types' vec_dot_type) keeps the shared encoder: loops over 32-element
blocks did not vectorize in any form tried (no faster than it at 8960 elements).
"""
from __future__ import annotations

import numpy as np

from ggraph.ir.types import GGMLType

MAG = np.int32(0x7FFFFFFF)    # the bits of a float32 without its sign
INF = np.int32(0x7F800000)    # infinity's bits: above them, NaN


def enc_q8_k(v, x, i3, i2, i1, n):
    """Q8_K blocks of v[:n] into x[i3, i2, i1]: per 256, f32 d = 1 / iscale with iscale =
    -127 / (the first element of the largest magnitude), q = min(127, round(iscale * v)),
    the int16 sum of each 16 q (all zero for a block without a nonzero magnitude)."""
    row = x[i3, i2, i1]
    qs = np.empty(256, np.int32)
    a = np.empty(128, np.int32)
    c = np.empty(64, np.int32)
    for b in range(n // 256):
        vs = v[256 * b:256 * b + 256]
        out = row[292 * b:292 * b + 292]
        bits = vs.view(np.int32)
        mu = np.int32(0)
        for j in range(256):
            u = bits[j] & MAG
            mu = max(mu, u if u <= INF else np.int32(0))
        if mu == 0:
            out[:] = 0
            continue
        first = np.int32(256)
        for j in range(256):
            first = min(first, np.int32(j) if bits[j] & MAG == mu else np.int32(256))
        mx = vs[first]
        iscale = np.float32(np.float32(-127.0) / mx)
        for j in range(256):
            f = np.float32(iscale * vs[j])
            r = np.rint(f) if abs(f) <= np.float32(128.0) else np.float32(0.0)
            qs[j] = min(np.int32(127), np.int32(r))
        for j in range(256):
            out[4 + j] = np.uint8(qs[j] & 0xFF)
        for j in range(128):
            a[j] = qs[2 * j] + qs[2 * j + 1]
        for j in range(64):
            c[j] = a[2 * j] + a[2 * j + 1]
        for j in range(32):
            a[j] = c[2 * j] + c[2 * j + 1]
        sums = out[260:292].view(np.int16)
        for j in range(16):
            sums[j] = np.int16(a[2 * j] + a[2 * j + 1])
        # 1 / -0 (an infinite mx) is ggml's infinite d, without a division by zero
        d = np.float32(np.float32(1.0) / iscale) if iscale != 0 else (
            np.float32(-np.inf) if mx > 0 else np.float32(np.inf))
        out[0:4].view(np.float32)[0] = d


# the vec_dot_type -> its encoder here (the shared codec's enc for any other)
ENCODERS = {GGMLType.Q8_K: enc_q8_k}
