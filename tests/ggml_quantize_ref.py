"""libggml's quantizer as a reference for tests: `ggml_quantize_chunk` from libggml-base through
ctypes (the library ggraph.check.ggml_cdefs finds), and the ggml_type ids it takes.

QUANTIZE_CHUNK is None where the library is absent, WHY saying why; `needs_ggml` skips a test
then, with that reason.
"""
from __future__ import annotations

import ctypes

import pytest

# ggml_type enum values (ggml.h)
GGML_TYPE_ID = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
                "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}


def _load_quantize_chunk():
    try:
        from ggraph.check.ggml_cdefs import GGMLUnavailable, find_libggml
    except ImportError as e:  # pragma: no cover - ggraph always ships it
        return None, f"ggraph.check.ggml_cdefs unavailable: {e}"
    try:
        lib = ctypes.CDLL(str(find_libggml() / "libggml-base.so"))
    except (GGMLUnavailable, OSError) as e:
        return None, str(e)
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn, ""


QUANTIZE_CHUNK, WHY = _load_quantize_chunk()
needs_ggml = pytest.mark.skipif(QUANTIZE_CHUNK is None, reason=f"libggml not available: {WHY}")
