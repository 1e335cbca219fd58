"""What llama.cpp's samplers work on, shared by the steps (sampling_steps.py) and the chain
(sampling.py): `Candidates` (llama_token_data_array: ids, logits, probs, `sorted`), the float32
arithmetic llama.cpp does them in (expf/logf as correctly rounded results, in-order float
sums, the top-k order), and `StdMT19937` (std::mt19937 plus libstdc++'s
uniform_real_distribution) with llama.cpp's seeding (LLAMA_DEFAULT_SEED asks for a random
seed)."""
from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

F32 = np.float32


# --- float32 helpers: llama.cpp computes in float with expf/logf; float64 then rounding
# gives the correctly rounded float, which is what glibc's expf/logf return almost always.

def expf32(x: np.ndarray) -> np.ndarray:
    return np.exp(x.astype(np.float64)).astype(F32)


def logf32(x: np.ndarray | float) -> np.ndarray:
    return np.log(np.asarray(x, dtype=F32).astype(np.float64)).astype(F32)


def sum_f32(x: np.ndarray) -> np.float32:
    """A float accumulator summed in order (`s += x[i]`); np.sum would sum pairwise."""
    return np.cumsum(x, dtype=F32)[-1] if x.size else F32(0)


def top_order(logits: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest logits, largest first (ties: lower position first)."""
    n = logits.size
    if k >= n:
        return np.argsort(-logits, kind="stable")
    if n >= 8192 and k * 32 <= n:
        # The k-th largest of every 16th logit is a bound that at least k logits reach (those
        # k do), so a cheap partition of the subsample shrinks the full one ~16-fold.
        sub = logits[::16]
        bound = np.partition(sub, sub.size - k)[sub.size - k]
        if bound == -np.inf:
            # a grammar's masked logits: nearly all -inf, so the bound keeps everything and
            # the partition below would sort 262k ties (8 ms on Gemma 3); the finite ones,
            # then the lowest positions of the -inf ties
            part = np.flatnonzero(logits > -np.inf)
            if part.size >= k:
                part = part[np.argpartition(logits[part], part.size - k)[part.size - k:]]
            else:
                # (the first k + size positions hold at least k of the -inf ones)
                head = logits[:k + part.size]
                part = np.concatenate([part, np.flatnonzero(head == -np.inf)[:k - part.size]])
        else:
            part = np.flatnonzero(logits >= bound)
            part = part[np.argpartition(logits[part], part.size - k)[part.size - k:]]
    else:
        part = np.argpartition(logits, n - k)[n - k:]
    return part[np.lexsort((part, -logits[part]))]


@functools.lru_cache(maxsize=4)
def vocab_ids(n: int) -> np.ndarray:
    """0..n-1, shared read-only: steps select ids into new arrays, never write them."""
    ids = np.arange(n, dtype=np.int32)
    ids.flags.writeable = False
    return ids


@dataclass
class Candidates:
    """llama_token_data_array: token ids, their logits, probs (None until a step sets them,
    then the values that step computed, as llama.cpp leaves them) and `sorted` (descending by
    logit)."""
    ids: np.ndarray
    logits: np.ndarray
    probs: np.ndarray | None = None
    sorted: bool = False

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> "Candidates":
        lg = np.asarray(logits)
        if lg.ndim != 1 or lg.size == 0:
            raise ValueError(f"sampling: logits must be a non-empty 1-D vector, got shape "
                             f"{lg.shape}")
        lg = np.array(lg, dtype=F32)  # a copy: steps write logits
        bad = np.isnan(lg) | (lg == np.inf)
        if bad.any():
            raise ValueError(f"sampling: logits contain NaN or +inf at ids "
                             f"{np.flatnonzero(bad)[:8].tolist()}")
        if not (lg > -np.inf).any():
            raise ValueError("sampling: every logit is -inf; nothing can be sampled")
        return cls(vocab_ids(lg.size), lg)

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, idx: np.ndarray | slice, sorted: bool) -> "Candidates":
        return Candidates(self.ids[idx], self.logits[idx],
                          None if self.probs is None else self.probs[idx], sorted)

    def softmax(self, do_sort: bool = False) -> "Candidates":
        """llama_sampler_softmax_impl: probs = softmax(logits) in float, optionally sorted."""
        c = self.take(top_order(self.logits, self.size), True) if do_sort and not self.sorted \
            else self
        max_l = c.logits[0] if c.sorted else c.logits.max()
        p = expf32(c.logits - max_l)
        return Candidates(c.ids, c.logits, p / sum_f32(p), c.sorted)


class StdMT19937:
    """std::mt19937 (numpy's MT19937 core given the state std::mt19937(seed) starts from)
    plus libstdc++'s uniform_real_distribution<double|float>(0, 1) on it."""

    def __init__(self, seed: int) -> None:
        self.bitgen = np.random.MT19937()
        self.seed(seed)

    def seed(self, seed: int) -> None:
        key = np.empty(624, dtype=np.uint32)  # init_genrand, as std::mt19937::seed does
        key[0] = x = seed & 0xFFFFFFFF
        for i in range(1, 624):
            x = (1812433253 * (x ^ (x >> 30)) + i) & 0xFFFFFFFF
            key[i] = x
        self.bitgen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}

    def uniform_double(self) -> float:
        # generate_canonical<double, 53> with a 32-bit engine: two draws, low word first.
        lo, hi = (float(v) for v in self.bitgen.random_raw(2))
        r = (lo + hi * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_float(self) -> np.float32:
        r = F32(F32(int(self.bitgen.random_raw())) / F32(4294967296.0))
        return r if r < 1 else np.nextafter(F32(1), F32(0))


def resolve_seed(seed: int) -> int:
    """get_rng_seed: LLAMA_DEFAULT_SEED asks for a fresh random seed."""
    return secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed
