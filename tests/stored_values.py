"""Values as a tensor type stores them, decoded by gguf-py (independent of ggraph): the oracle
side of the op tests that run on stored (F16, quantized) weights and caches."""
from __future__ import annotations

import gguf
import gguf.quants as gq
import numpy as np

from ggraph import GGMLType


def stored(values: np.ndarray, type: GGMLType) -> np.ndarray:
    """Values as they read back after storing in `type`, float64, in values' shape."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    if type == GGMLType.F32:
        return x.astype(np.float64)
    if type == GGMLType.F16:
        return x.astype(np.float16).astype(np.float64)
    qt = gguf.GGMLQuantizationType[type.name]
    return gq.dequantize(gq.quantize(x, qt), qt).astype(np.float64).reshape(x.shape)
