"""Token sampling as llama.cpp's common sampler chain does it, in numpy over one logits vector.

Owns: `SamplerParams` (common_params_sampling's field names and defaults, validated with the
llama-cli flag named), `Dist` and `Sampler` (the chain with its RNG and token history:
`accept`, `sample`, `candidates`, `reset`). The steps (one small class per llama.cpp sampler)
and `STEPS`, the registry that builds them in the order of `SamplerParams.samplers`
(llama.cpp's default: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc,
temperature), are sampling_steps.py's; `Candidates` (llama_token_data_array), the float32
arithmetic and `StdMT19937` (std::mt19937 plus libstdc++'s uniform_real_distribution) are
candidates.py's.

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

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import numpy as np

from ggraph.graphs.runtime.candidates import (F32, LLAMA_DEFAULT_SEED, Candidates, StdMT19937,
                                              expf32, resolve_seed)
from ggraph.graphs.runtime.sampling_steps import STEPS, Step, TopK

# Candidates, StdMT19937, TopK and LLAMA_DEFAULT_SEED are imported from here too
__all__ = ["CLI_FLAGS", "DEFAULT_SAMPLERS", "LLAMA_DEFAULT_SEED", "SAMPLER_CHARS", "Candidates",
           "Dist", "GrammarLike", "NoTokenAllowed", "Sampler", "SamplerParams", "StdMT19937",
           "TopK", "samplers_from_chars"]

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



class Dist:
    """llama_sampler_dist: softmax (float exp, double running sum) and one uniform double
    from std::mt19937 picks the first candidate whose running sum reaches sum * u."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.seed_cur = resolve_seed(seed)
        self.rng = StdMT19937(self.seed_cur)

    def reset(self) -> None:
        self.seed_cur = resolve_seed(self.seed)
        self.rng.seed(self.seed_cur)

    def select(self, c: Candidates) -> int:
        """Index into `c` of the drawn candidate."""
        if c.size == 1:
            self.rng.uniform_double()  # llama.cpp draws even here, keeping the stream aligned
            return 0
        max_l = c.logits[0] if c.sorted else c.logits.max()
        run = np.cumsum(expf32(c.logits - max_l), dtype=np.float64)
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
