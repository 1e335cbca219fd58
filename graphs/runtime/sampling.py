"""Token sampling as llama.cpp's common sampler chain does it, in numpy over one logits vector.

Owns: `SamplerParams` (common_params_sampling's field names and defaults, validated with the
llama-cli flag named), `Candidates` (llama_token_data_array: ids, logits, probs, `sorted`), the
steps (one small class per llama.cpp sampler) and `STEPS`, the registry that builds them in the
order of `SamplerParams.samplers` (llama.cpp's default: penalties, dry, top_n_sigma, top_k,
typ_p, top_p, min_p, xtc, temperature), `StdMT19937` (std::mt19937 plus libstdc++'s
uniform_real_distribution), `Dist` and `Sampler` (the chain with its RNG and token history:
`accept`, `sample`, `candidates`, `reset`).

Reproduced exactly (checked against llama.cpp's samplers in
tests/graphs/runtime/test_sampling.py): every
step's kept set, candidate order and logits, using llama.cpp's float32 arithmetic (in-order
float sums via cumsum, expf/logf as correctly rounded results; probs agree to 2 ulp where glibc
rounds differently); `dist` draws from std::mt19937 seeded as llama.cpp seeds it (0xFFFFFFFF =
LLAMA_DEFAULT_SEED = a random seed) through libstdc++'s generate_canonical and picks by the same
double running sum, so a seed gives llama.cpp's token sequence for the same logits. Not
reproduced: the order of tied sort keys (std::sort is unstable; ties here keep index order, and
which of several logits tied at a cut survive may differ); top_n_sigma's mixed float/double
variance sum (float64 here); typical/dynatemp entropies take 0*log(0) as 0 where llama.cpp gets
NaN; DRY and mirostat are not implemented (enabling them is an error); penalty_last_n = -1
means "the whole history since reset" (this llama.cpp's library clamps -1 to 0, i.e. off).
"""
from __future__ import annotations

import functools
import math
import secrets
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable, Protocol

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                    "xtc", "temperature")
# llama.cpp's --sampler-seq characters (common_sampler_type_to_chr).
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
                 "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature"}
# The llama-cli flag that sets each field, so errors name what the user typed.
CLI_FLAGS = {"seed": "--seed", "min_keep": "--min-keep", "top_k": "--top-k", "top_p": "--top-p",
             "min_p": "--min-p", "xtc_probability": "--xtc-probability",
             "xtc_threshold": "--xtc-threshold", "typ_p": "--typical",
             "temp": "--temp", "dynatemp_range": "--dynatemp-range",
             "dynatemp_exponent": "--dynatemp-exp", "penalty_last_n": "--repeat-last-n",
             "penalty_repeat": "--repeat-penalty", "penalty_freq": "--frequency-penalty",
             "penalty_present": "--presence-penalty", "top_n_sigma": "--top-n-sigma",
             "dry_multiplier": "--dry-multiplier", "mirostat": "--mirostat",
             "samplers": "--samplers"}

F32 = np.float32


def samplers_from_chars(chars: str) -> tuple[str, ...]:
    """--sampler-seq: one character per step (e.g. "edskypmxt", the default order)."""
    bad = [c for c in chars if c not in SAMPLER_CHARS]
    if bad:
        raise ValueError(f"--sampler-seq: unknown sampler character(s) {bad!r}; "
                         f"known: {''.join(SAMPLER_CHARS)}")
    return tuple(SAMPLER_CHARS[c] for c in chars)


# field -> (valid?, what the error says); off values follow llama.cpp's flags.
_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "seed": (lambda v: 0 <= v <= 0xFFFFFFFF, "must be in [0, 2**32-1] (4294967295 = random)"),
    "min_keep": (lambda v: v >= 0, "must be >= 0"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1] (1 = off)"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1] (0 = off)"),
    "typ_p": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1] (1 = off)"),
    "xtc_probability": (lambda v: 0.0 <= v <= 1.0, "must be in [0, 1] (0 = off)"),
    "penalty_last_n": (lambda v: v >= -1, "must be >= -1 (0 = off, -1 = whole history)"),
    "penalty_repeat": (lambda v: v > 0.0, "must be > 0 (1 = off)"),
    "dry_multiplier": (lambda v: v == 0.0, "DRY needs the vocabulary's token strings and is "
                       "not implemented here; use 0"),
    "mirostat": (lambda v: v == 0, "mirostat is not implemented here; use 0"),
}


@dataclass(frozen=True)
class SamplerParams:
    """common_params_sampling's sampling fields with llama.cpp's defaults."""
    seed: int = LLAMA_DEFAULT_SEED
    min_keep: int = 0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.10
    typ_p: float = 1.0
    temp: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    top_n_sigma: float = -1.0
    dry_multiplier: float = 0.0
    mirostat: int = 0
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS
    # GBNF text ("" = none): only tokens that keep the output in it are sampled, and the end
    # of generation only when it is complete (graphs/grammar/)
    grammar: str = ""

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"sampling parameter {name} ({CLI_FLAGS[name]}) = "
                              f"{getattr(self, name)!r}: {why}")
        for name in ("seed", "min_keep", "top_k", "penalty_last_n", "mirostat"):
            if not isinstance(getattr(self, name), (int, np.integer)) or \
                    isinstance(getattr(self, name), bool):
                raise bad(name, "must be an integer")
        for name in ("top_p", "min_p", "xtc_probability", "xtc_threshold", "typ_p", "temp",
                     "dynatemp_range", "dynatemp_exponent", "penalty_repeat", "penalty_freq",
                     "penalty_present", "top_n_sigma", "dry_multiplier"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.floating, np.integer)) or math.isnan(v):
                raise bad(name, "must be a number (not NaN)")
            if math.isinf(v) and name != "temp":
                raise bad(name, "must be finite")
        for name, (ok, why) in _RULES.items():
            if not ok(getattr(self, name)):
                raise bad(name, why)
        if isinstance(self.samplers, str) or not all(isinstance(s, str) for s in self.samplers):
            raise bad("samplers", "must be a sequence of sampler names")
        unknown = [s for s in self.samplers if s not in STEPS]
        if unknown:
            raise bad("samplers", f"unknown sampler(s) {unknown}; known: {sorted(STEPS)}")
        object.__setattr__(self, "samplers", tuple(self.samplers))
        if not isinstance(self.grammar, str):
            raise ValueError(f"sampling parameter grammar must be GBNF text, got "
                             f"{type(self.grammar).__name__}")


# --- float32 helpers: llama.cpp computes in float with expf/logf; float64 then rounding
# gives the correctly rounded float, which is what glibc's expf/logf return almost always.

def _expf(x: np.ndarray) -> np.ndarray:
    return np.exp(x.astype(np.float64)).astype(F32)


def _logf(x: np.ndarray | float) -> np.ndarray:
    return np.log(np.asarray(x, dtype=F32).astype(np.float64)).astype(F32)


def _sum_f32(x: np.ndarray) -> np.float32:
    """A float accumulator summed in order (`s += x[i]`); np.sum would sum pairwise."""
    return np.cumsum(x, dtype=F32)[-1] if x.size else F32(0)


def _top_order(logits: np.ndarray, k: int) -> np.ndarray:
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
def _vocab_ids(n: int) -> np.ndarray:
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
        return cls(_vocab_ids(lg.size), lg)

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def take(self, idx: np.ndarray | slice, sorted: bool) -> "Candidates":
        return Candidates(self.ids[idx], self.logits[idx],
                          None if self.probs is None else self.probs[idx], sorted)

    def softmax(self, do_sort: bool = False) -> "Candidates":
        """llama_sampler_softmax_impl: probs = softmax(logits) in float, optionally sorted."""
        c = self.take(_top_order(self.logits, self.size), True) if do_sort and not self.sorted \
            else self
        max_l = c.logits[0] if c.sorted else c.logits.max()
        p = _expf(c.logits - max_l)
        return Candidates(c.ids, c.logits, p / _sum_f32(p), c.sorted)


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


def _resolve_seed(seed: int) -> int:
    """get_rng_seed: LLAMA_DEFAULT_SEED asks for a fresh random seed."""
    return secrets.randbits(32) if seed == LLAMA_DEFAULT_SEED else seed


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
        return c.take(_top_order(c.logits, k), True)


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
            order = np.arange(k) if c.sorted else _top_order(c.logits, k)
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
        logp = _logf(self.p)
        if not c.sorted:
            keep = c.logits >= F32(max(c.logits.max(), F32(-3.4028235e38)) + logp)
            n_keep = int(keep.sum())
            if n_keep > 0 and n_keep >= self.min_keep:
                return c.take(np.flatnonzero(keep), False)
            c = c.take(_top_order(c.logits, c.size), True)
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
            logp = _logf(c.probs)                              # typical; 0 log 0 = 0
            terms = np.where(c.probs > 0, -c.probs * logp, F32(0))
        entropy = _sum_f32(terms)
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
        max_entropy = -_logf(F32(1) / F32(c.size))
        c = c.softmax(do_sort=True)
        pos = c.probs > 0
        entropy = -_sum_f32(np.where(pos, c.probs * _logf(np.where(pos, c.probs, 1)), F32(0)))
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
        self.rng = StdMT19937(_resolve_seed(self.seed))

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
        self.rng.seed(_resolve_seed(self.seed))


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
        mean = F32(_sum_f32(v) / F32(v.size)) if v.size else F32(0)
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
STEPS: dict[str, Callable[[SamplerParams], Step | None]] = {
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


class Dist:
    """llama_sampler_dist: softmax (float exp, double running sum) and one uniform double
    from std::mt19937 picks the first candidate whose running sum reaches sum * u."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.seed_cur = _resolve_seed(seed)
        self.rng = StdMT19937(self.seed_cur)

    def reset(self) -> None:
        self.seed_cur = _resolve_seed(self.seed)
        self.rng.seed(self.seed_cur)

    def select(self, c: Candidates) -> int:
        """Index into `c` of the drawn candidate."""
        if c.size == 1:
            self.rng.uniform_double()  # llama.cpp draws even here, keeping the stream aligned
            return 0
        max_l = c.logits[0] if c.sorted else c.logits.max()
        run = np.cumsum(_expf(c.logits - max_l), dtype=np.float64)
        target = run[-1] * self.rng.uniform_double()
        return min(int(np.searchsorted(run, target, side="left")), c.size - 1)


class GrammarLike(Protocol):
    """What the sampler needs of a grammar (graphs/grammar/constraint.py's GrammarState)."""

    def allows(self, token: int) -> bool: ...

    def mask(self) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    def reset(self) -> None: ...


class NoTokenAllowed(ValueError):
    """The grammar allows no token the chain left (e.g. it is complete and the end of
    generation is excluded)."""


class Sampler:
    """The chain built from `params` (steps in params.samplers order, then dist), and a
    grammar if given.

    `sample(logits)` runs the chain, draws a token and, like llama_sampler_sample, accepts it
    into the history (pass accept=False to accept it yourself). Prompt tokens should be
    `accept_many`ed too, as llama-cli does, so the penalties see them; they are not fed to the
    grammar (common_sampler_accept with accept_grammar = false).

    With a grammar, sampling is llama.cpp's common_sampler_sample: the chain draws from all
    tokens; a token the grammar allows is kept (one cheap check), otherwise the grammar's mask
    is applied to the logits first and the chain draws again (a second draw from the RNG, as
    in llama.cpp, so a seed gives llama.cpp's tokens)."""

    def __init__(self, params: SamplerParams | None = None, vocab: object = None,
                 grammar: GrammarLike | None = None) -> None:
        """`vocab`: the model's tokenizer, needed when params.grammar is set (the grammar is
        compiled for it, once per text and tokenizer); `grammar`: a started grammar state
        instead."""
        self.params = params or SamplerParams()
        self.steps: list[Step] = [s for s in (STEPS[n](self.params) for n in self.params.samplers)
                                  if s is not None]
        self.dist = Dist(self.params.seed)
        if grammar is None and self.params.grammar:
            if vocab is None:
                raise ValueError("a grammar needs the model's vocabulary (pass vocab=)")
            from ggraph.graphs.grammar.constraint import start_grammar
            grammar = start_grammar(self.params.grammar, vocab)
        self.grammar = grammar
        self.n_resampled = 0   # draws the grammar refused (each one cost a full mask)

    @property
    def seed(self) -> int:
        """The seed in use (llama_sampler_get_seed: the drawn one for a random seed)."""
        return self.dist.seed_cur

    def candidates(self, logits: np.ndarray) -> Candidates:
        """Run the chain (not dist): what is left to sample from, in llama.cpp's order."""
        c = Candidates.from_logits(logits)
        for step in self.steps:
            c = step.apply(c)
        return c

    def sample(self, logits: np.ndarray, accept: bool = True) -> int:
        c = self.candidates(logits)
        token = int(c.ids[self.dist.select(c)])
        g = self.grammar
        if g is not None and not g.allows(token):
            self.n_resampled += 1
            allowed = g.mask()
            if not allowed.any():
                raise NoTokenAllowed("the grammar allows no token here")
            logits = np.asarray(logits, dtype=F32)
            if allowed.size != logits.size:   # rows past the vocabulary (padding) never
                allowed = np.concatenate([allowed, np.zeros(logits.size, bool)])[:logits.size]
            masked = np.where(allowed, logits, F32(-np.inf))
            c = self.candidates(masked)
            if not np.isfinite(c.logits).any():
                raise NoTokenAllowed("the sampler chain left no token the grammar allows")
            token = int(c.ids[self.dist.select(c)])
        if accept:
            self.accept(token)
        return token

    def accept(self, token: int) -> None:
        for step in self.steps:
            step.accept(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def accept_many(self, tokens: Iterable[int]) -> None:
        """The prompt: the penalties' history only, never the grammar."""
        for t in tokens:
            for step in self.steps:
                step.accept(t)

    def reset(self) -> None:
        """Forget the history and reseed (a random seed draws a new one); the grammar starts
        over."""
        for step in self.steps:
            step.reset()
        self.dist.reset()
        if self.grammar is not None:
            self.grammar.reset()

    def describe(self) -> str:
        """The chain as llama.cpp prints it ("top-k -> top-p -> ... -> dist")."""
        names = [s.name for s in self.steps] + ["dist"]
        return " -> ".join((["grammar"] if self.grammar is not None else []) + names)
