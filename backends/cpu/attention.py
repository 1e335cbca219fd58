"""flash_attn_ext on the CPU for batches of queries: blockwise online softmax over K/V chunks
with the products done by BLAS.

Each K/V head is decoded once to float32 (numpy's F16 conversion, or the shared row decoders
for BF16 and quantized caches) and serves all the query heads that map to it (GQA). Scores are
computed for CHUNK cells at a time, so memory stays O(queries x CHUNK) whatever n_kv is; the
running max, sum and output are rescaled as each chunk arrives, exactly the flash-attention
recurrence. Single queries (decode) keep the numba kernel, which has no BLAS call overhead.
"""
from __future__ import annotations

import numpy as np

from ggraph.tensor import Tensor
from ggraph.types import GGMLType as T

CHUNK = 1024


def decode_heads(arr: np.ndarray, t: Tensor, dec) -> np.ndarray:
    """(S, H, n, row) kernel view -> float32 (S, H, n, ne0)."""
    if t.type == T.F32:
        return arr
    if t.type == T.F16:
        return arr.view(np.float16).astype(np.float32)
    out = np.empty(arr.shape[:3] + (t.ne[0],), np.float32)
    for i3 in range(arr.shape[0]):
        for i2 in range(arr.shape[1]):
            for i1 in range(arr.shape[2]):
                dec(arr, i3, i2, i1, out[i3, i2, i1], t.ne[0])
    return out


def flash_attn_blocks(Q: np.ndarray, K: np.ndarray, V: np.ndarray, M: np.ndarray | None,
                      D: np.ndarray, scale: float, softcap: float, slopes: np.ndarray) -> None:
    """Q (S, H, T, Dk), K (Sk, Hkv, n_kv, Dk), V (Sk, Hkv, n_kv, Dv) float32; M (Sm, Hm, >=T,
    n_kv) or None; D (S, T, H, Dv). scale is pre-divided by softcap when softcap is set."""
    ns, nh, nt, _ = Q.shape
    hkv, nkv = K.shape[1], K.shape[2]
    rk2, rk3 = nh // hkv, ns // K.shape[0]
    for s in range(ns):
        for g in range(hkv):
            heads = range(g * rk2, (g + 1) * rk2)
            q = Q[s, g * rk2:(g + 1) * rk2].reshape(rk2 * nt, -1)   # the group's queries
            k, v = K[s // rk3, g], V[s // rk3, g]
            slope = np.repeat(slopes[g * rk2:(g + 1) * rk2], nt)[:, None]
            mx = np.full((rk2 * nt, 1), -np.inf, np.float32)
            ssum = np.zeros((rk2 * nt, 1), np.float32)
            acc = np.zeros((rk2 * nt, V.shape[3]), np.float32)
            for c0 in range(0, nkv, CHUNK):
                c1 = min(nkv, c0 + CHUNK)
                sc = q @ k[c0:c1].T * np.float32(scale)
                if softcap:
                    sc = np.float32(softcap) * np.tanh(sc)
                if M is not None:
                    m = np.stack([M[s % M.shape[0], h % M.shape[1], :nt, c0:c1] for h in heads])
                    sc = sc + slope * m.reshape(rk2 * nt, c1 - c0)
                new = np.maximum(mx, sc.max(axis=1, keepdims=True))
                ok = new > -np.inf            # rows with a visible cell so far
                corr = np.where(ok, np.exp(np.where(ok, mx - new, 0.0)), 1.0)
                p = np.exp(sc - np.where(ok, new, 0.0))
                p[~ok[:, 0]] = 0.0
                acc = acc * corr + p @ v[c0:c1]
                ssum = ssum * corr + p.sum(axis=1, keepdims=True)
                mx = new
            out = np.divide(acc, ssum, out=np.zeros_like(acc), where=ssum > 0)
            D[s, :, g * rk2:(g + 1) * rk2, :] = out.reshape(rk2, nt, -1).transpose(1, 0, 2)
