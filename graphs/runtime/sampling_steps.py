"""The steps of llama.cpp's common sampler chain, one small class each (a llama_sampler's
apply/accept/reset on Candidates), and `STEPS`, the registry that builds them from
SamplerParams (graphs/runtime/sampling.py) by llama.cpp's sampler type names."""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from ggraph.graphs.runtime.candidates import (F32, Candidates, StdMT19937, logf32, resolve_seed,
                                              sum_f32, top_order)

# --- the steps: each mirrors one llama_sampler's apply/accept/reset on Candidates ---------

@dataclass
class Step:
    """One sampler in the chain; steps with state override accept/reset."""
    name: ClassVar[str] = ""  # llama.cpp's sampler name, as its chain printout shows it

    def apply(self, c: Candidates) -> Candidates:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class TopK(Step):
    name: ClassVar[str] = "top-k"
    k: int

    def apply(self, c: Candidates) -> Candidates:
        if self.k <= 0:
            return c
        k = min(self.k, c.size)
        if c.sorted:
            return c.take(slice(0, k), True)
        return c.take(top_order(c.logits, k), True)


@dataclass
class TopP(Step):
    name: ClassVar[str] = "top-p"
    p: float
    min_keep: int

    def apply(self, c: Candidates) -> Candidates:
        if self.p >= 1.0:
            return c
        c = c.softmax(do_sort=False)  # probs in the current order, as llama.cpp sums them
        p32, n = F32(self.p), c.size
        # llama.cpp first sorts only the top 256 of a large unsorted set, then all of it; the
        # cut is the same whatever prefix is sorted, so grow the prefix geometrically instead.
        tries = [k for k in (256, 4096, 32768) if k < n] + [n] if not c.sorted else [n]
        for k in tries:
            order = np.arange(k) if c.sorted else top_order(c.logits, k)
            ok = (np.cumsum(c.probs[order], dtype=F32) >= p32) & \
                (np.arange(1, k + 1) >= self.min_keep)
            if ok.any():
                return c.take(order[:int(ok.argmax()) + 1], True)
        return c.take(order, True)


@dataclass
class MinP(Step):
    name: ClassVar[str] = "min-p"
    p: float
    min_keep: int

    def apply(self, c: Candidates) -> Candidates:
        if self.p <= 0.0 or c.size == 0:
            return c
        logp = logf32(self.p)
        if not c.sorted:
            keep = c.logits >= F32(max(c.logits.max(), F32(-3.4028235e38)) + logp)
            n_keep = int(keep.sum())
            if n_keep > 0 and n_keep >= self.min_keep:
                return c.take(np.flatnonzero(keep), False)
            c = c.take(top_order(c.logits, c.size), True)
        below = c.logits[1:] < F32(c.logits[0] + logp)
        stop = below & (np.arange(1, c.size) >= self.min_keep)
        n = int(stop.argmax()) + 1 if stop.any() else c.size
        return c.take(slice(0, n), True)


@dataclass
class Typical(Step):
    name: ClassVar[str] = "typical"
    p: float
    min_keep: int

    def apply(self, c: Candidates) -> Candidates:
        if self.p >= 1.0:
            return c
        c = c.softmax(do_sort=True)
        with np.errstate(divide="ignore", invalid="ignore"):  # p = 0: -log p = inf, least
            logp = logf32(c.probs)                              # typical; 0 log 0 = 0
            terms = np.where(c.probs > 0, -c.probs * logp, F32(0))
        entropy = sum_f32(terms)
        order = np.argsort(np.abs(-logp - entropy), kind="stable")
        ok = np.cumsum(c.probs[order], dtype=F32) > F32(self.p)
        if self.min_keep > 0:
            ok &= np.arange(c.size) >= self.min_keep - 1
        n = int(ok.argmax()) + 1 if ok.any() else c.size
        return c.take(order[:n], False)


def _scale_temp(c: Candidates, temp: float) -> Candidates:
    """llama_sampler_temp_impl: divide by temp; temp <= 0 keeps only the first max logit."""
    if c.size == 0:
        return c
    if temp <= 0.0:
        i = int(c.logits.argmax())
        lg = np.full_like(c.logits, -np.inf)
        lg[i] = c.logits[i]
        return Candidates(c.ids, lg, c.probs, c.sorted)
    return Candidates(c.ids, c.logits / F32(temp), c.probs, c.sorted)


@dataclass
class TempExt(Step):
    """llama_sampler_temp_ext: the chain's 'temperature' (dynamic when delta > 0)."""
    name: ClassVar[str] = "temp-ext"
    temp: float
    delta: float
    exponent: float

    def apply(self, c: Candidates) -> Candidates:
        if self.delta <= 0:
            return _scale_temp(c, self.temp)
        if c.size <= 1:
            return c
        t, d = F32(self.temp), F32(self.delta)
        min_temp, max_temp = max(F32(0), F32(t - d)), F32(t + d)
        max_entropy = -logf32(F32(1) / F32(c.size))
        c = c.softmax(do_sort=True)
        pos = c.probs > 0
        entropy = -sum_f32(np.where(pos, c.probs * logf32(np.where(pos, c.probs, 1)), F32(0)))
        norm = F32(entropy / max_entropy)
        powv = F32(float(norm) ** float(F32(self.exponent)))
        c = _scale_temp(c, float(F32(min_temp + F32(max_temp - min_temp) * powv)))
        # probs in double, stored in float, divided by the double sum (as llama.cpp does)
        p = np.exp(c.logits.astype(np.float64) - float(c.logits[0]))
        probs = (p.astype(F32).astype(np.float64) / np.cumsum(p)[-1]).astype(F32)
        return Candidates(c.ids, c.logits, probs, c.sorted)


@dataclass
class Xtc(Step):
    """Exclude Top Choices: with probability `probability`, drop every token at or above
    `threshold` except the least likely of them."""
    name: ClassVar[str] = "xtc"
    probability: float
    threshold: float
    min_keep: int
    seed: int
    rng: StdMT19937 = field(init=False)

    def __post_init__(self) -> None:
        self.rng = StdMT19937(resolve_seed(self.seed))

    def apply(self, c: Candidates) -> Candidates:
        if self.probability <= 0 or self.threshold > 0.5 or c.size < 2:
            return c
        if self.rng.uniform_float() > F32(self.probability):
            return c
        c = c.softmax(do_sort=True)
        above = c.probs >= F32(self.threshold)
        pos_last = int(above.argmin()) - 1 if not above.all() else c.size - 1
        pos_last = max(pos_last, 0)
        if c.size - pos_last >= self.min_keep and pos_last > 0:
            return c.take(slice(pos_last, None), True)
        return c

    def reset(self) -> None:
        self.rng.seed(resolve_seed(self.seed))


@dataclass
class TopNSigma(Step):
    name: ClassVar[str] = "top-n-sigma"
    n: float

    def apply(self, c: Candidates) -> Candidates:
        if self.n <= 0 or c.size <= 1:
            return c
        valid = c.logits != -np.inf
        v = c.logits[valid]
        mx = F32(max(c.logits[0], v.max())) if v.size else c.logits[0]
        mean = F32(sum_f32(v) / F32(v.size)) if v.size else F32(0)
        acc = ((v.astype(np.float64) - float(mean)) ** 2).sum()  # float64: see module doc
        std = F32(math.sqrt(F32(acc) / F32(v.size))) if v.size else F32(0)
        lg = np.where(c.logits < F32(mx - F32(F32(self.n) * std)), F32(-np.inf), c.logits)
        return Candidates(c.ids, lg.astype(F32), c.probs, c.sorted)


@dataclass
class Penalties(Step):
    """Repetition (divide positive / multiply non-positive logits), frequency (count * f) and
    presence (p once present) penalties over the last `last_n` accepted tokens."""
    name: ClassVar[str] = "penalties"
    last_n: int
    repeat: float
    freq: float
    present: float
    history: deque = field(init=False)
    counts: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=None if self.last_n < 0 else self.last_n)

    def accept(self, token: int) -> None:
        if self.history.maxlen is not None and len(self.history) == self.history.maxlen:
            old = self.history[0]
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.history.append(int(token))
        self.counts[int(token)] += 1

    def reset(self) -> None:
        self.history.clear()
        self.counts.clear()

    def apply(self, c: Candidates) -> Candidates:
        lg = c.logits.copy()
        if self.counts:
            toks = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            cnt = np.fromiter(self.counts.values(), dtype=np.int64, count=len(self.counts))
            fits = toks < c.size
            if fits.all() and (c.ids[toks] == toks).all():
                pos = toks  # ids are unique: a token found at its own index is there only
            else:
                inv = np.full(int(max(c.ids.max(), toks.max())) + 1, -1, dtype=np.int64)
                inv[c.ids] = np.arange(c.size)
                pos = inv[toks]
            hit = pos >= 0
            pos, cnt = pos[hit], cnt[hit]
            x = lg[pos]
            x = np.where(x <= 0, x * F32(self.repeat), x / F32(self.repeat)).astype(F32)
            lg[pos] = x - (cnt.astype(F32) * F32(self.freq) + F32(1) * F32(self.present))
        return Candidates(c.ids, lg, c.probs, False)


# The registry: llama.cpp sampler type name -> factory (params -> step, or None where
# llama.cpp's init builds an empty sampler). New steps add an entry here.
# (each factory takes sampling.py's SamplerParams, which imports this module)
STEPS: dict[str, Callable[[Any], Step | None]] = {
    "penalties": lambda p: None if p.penalty_last_n == 0 or (
        p.penalty_repeat == 1.0 and p.penalty_freq == 0.0 and p.penalty_present == 0.0)
    else Penalties(p.penalty_last_n, p.penalty_repeat, p.penalty_freq, p.penalty_present),
    "dry": lambda p: None,  # only reachable with dry_multiplier 0 (validated)
    "top_n_sigma": lambda p: TopNSigma(p.top_n_sigma) if p.top_n_sigma > 0 else None,
    "top_k": lambda p: TopK(p.top_k) if p.top_k > 0 else None,
    "typ_p": lambda p: Typical(p.typ_p, p.min_keep) if p.typ_p < 1.0 else None,
    "top_p": lambda p: TopP(p.top_p, p.min_keep) if p.top_p < 1.0 else None,
    "min_p": lambda p: MinP(p.min_p, p.min_keep) if p.min_p > 0.0 else None,
    "xtc": lambda p: Xtc(p.xtc_probability, p.xtc_threshold, p.min_keep, p.seed)
    if p.xtc_probability > 0 and p.xtc_threshold <= 0.5 else None,
    "temperature": lambda p: None if p.temp == 1.0 and p.dynatemp_range <= 0
    else TempExt(p.temp, p.dynatemp_range, p.dynatemp_exponent),
}
