"""backends/cpu/qact.py: the vectorized Q8_K activation encoder writes the shared encoder's
bytes (backends/shared/codecs_k.enc_q8_k, ggml's quantize_row_q8_K_ref) on every kind of
row, and an infinite activation gives ggml's infinite scale instead of an error."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from ggraph.backends.cpu.compile import TARGET
from ggraph.backends.cpu.kernels import act_encoder
from ggraph.ir.types import GGMLType as T

SHARED = TARGET.codec(T.Q8_K).enc
FAST = act_encoder(T.Q8_K)


@numba.njit(cache=False)
def _shared(v, x, n):
    SHARED(v, x, 0, 0, 0, n)


@numba.njit(cache=False)
def _fast(v, x, n):
    FAST(v, x, 0, 0, 0, n)


def _rows(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(n).astype(np.float32)
    halves = (np.round(normal * 8) / 4).astype(np.float32)  # iscale * v lands on .5 often
    ties = normal.copy()
    ties[7] = -np.abs(normal[:256]).max() * 2          # the largest magnitude twice,
    ties[100] = -ties[7]                               # opposite signs: the first one wins
    nan = normal.copy()
    nan[3::97] = np.nan
    zero_block = normal.copy()
    zero_block[:256] = 0.0
    zero_block[256:260] = -0.0
    return {
        "normal": normal, "halves": halves, "ties": ties, "nan": nan, "zero_block": zero_block,
        "tiny": normal * np.float32(1e-39), "huge": normal * np.float32(1e37),
        "one_signed": np.abs(normal), "constant": np.full(n, -3.25, np.float32),
        "sparse": np.where(rng.random(n) < 0.05, normal, 0).astype(np.float32),
        "outlier": np.where(np.arange(n) == n // 3, 1e4, normal).astype(np.float32),
    }


@pytest.mark.parametrize("n", [256, 1536, 8960])
def test_same_bytes_as_the_shared_encoder(n: int) -> None:
    for kind, v in _rows(n, n).items():
        want = np.zeros((1, 1, 1, 292 * n // 256), np.uint8)
        got = np.full_like(want, 0xA5)  # every byte must be written
        _shared(v, want, n)
        _fast(v, got, n)
        assert np.array_equal(got, want), kind


def test_infinite_activation_gives_ggmls_infinite_scale() -> None:
    v = np.linspace(-1, 1, 512, dtype=np.float32)
    v[5], v[300] = np.inf, -np.inf
    x = np.zeros((1, 1, 1, 584), np.uint8)
    _fast(v, x, 512)
    d = x[0, 0, 0].view(np.float32)
    assert d[0] == -np.inf and d[292 // 4] == np.inf   # 1 / (-127 / +-inf)
    q = x[0, 0, 0].view(np.int8)
    assert not q[4:260].any() and not q[296:552].any()   # 0 * v, and NaN for the infinity
