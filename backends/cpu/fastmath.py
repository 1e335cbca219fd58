"""CPU-only replacements for shared scalar math where a table beats arithmetic.

f16 -> f32 is on the hot path of every F16 KV-cache read and every quantized block scale; a
65536-entry table (256 KiB, a compile-time constant in numba) turns it into one load. The
table is built by numpy's own conversion, and tests check it against the shared arithmetic
version (which the CUDA backend keeps) over all 65536 inputs.
"""
import numpy as np

HALF_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def half_to_f32(h):
    return HALF_TABLE[np.int64(h) & 0xFFFF]
