"""Speculative decoding with a draft model, as llama.cpp's draft-simple speculator
(common/speculative.cpp) and examples/speculative-simple run it.

Each round the draft model proposes up to n_max tokens greedily: after each of its decode
steps it keeps the top 10 candidates, softmaxes them and takes the first; it stops early when
that token's probability is below p_min, and a draft shorter than n_min is dropped. The target
then evaluates the last accepted token and the whole draft in one batch, and its sampler
samples at every position in turn: the draft is accepted while each sample equals the drafted
token, and the first sample that differs (or the one after a fully accepted draft) is the
round's last token. Every emitted token is the target sampler's own draw given the tokens
before it, so greedy output is the target's greedy output and sampled output keeps the
target's distribution. Both KV caches are cut back past the first rejected token (seq_rm).

The draft model's cache follows the target's tokens lazily: before drafting, it evaluates the
accepted tokens it has not seen (at most a round's worth), after cutting what no longer
matches.

`compatible` is llama.cpp's check (common_speculative_are_compatible) that the two models share
a vocabulary; `SpecStats` are the figures llama-speculative-simple prints.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from ggraph.graphs.models.batch import Batch

DRAFT_TOP_K = 10           # llama.cpp's draft sampler: top_k 10, then the softmax
VOCAB_SIZE_MAX_DIFF = 128  # SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START = 5      # SPEC_VOCAB_CHECK_START_TOKEN_ID


@dataclass
class SpecParams:
    """llama.cpp's --spec-draft-n-max, --spec-draft-n-min and --draft-p-min."""
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.n_max < 0 or self.n_min < 0:
            raise ValueError(f"--spec-draft-n-max/--spec-draft-n-min must be >= 0, got "
                             f"{self.n_max}/{self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"--draft-p-min must be in [0, 1], got {self.p_min}")


@dataclass
class SpecStats:
    n_predict: int = 0
    n_drafted: int = 0
    n_accept: int = 0
    n_rounds: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def accept_pct(self) -> float:
        return 100.0 * self.n_accept / self.n_drafted if self.n_drafted else 0.0

    def lines(self, n_max: int) -> list[str]:
        """llama-speculative-simple's summary."""
        return [f"n_draft   = {n_max}", f"n_predict = {self.n_predict}",
                f"n_drafted = {self.n_drafted}", f"n_accept  = {self.n_accept}",
                f"accept    = {self.accept_pct:.3f}%"]


def compatible(target: Any, draft: Any) -> str | None:
    """None when the draft can speculate for the target (llama.cpp's rules: the same
    vocabulary type, BOS/EOS ids and add flags, vocabulary sizes within 128 and the same token
    text from id 5 on); else why not, in one line."""
    t, d = target.tokenizer, draft.tokenizer
    if t.model != d.model:
        return f"the vocabularies differ in type ({t.model} and {d.model})"
    for what, a, b in (("BOS", (t.add_bos, t.bos), (d.add_bos, d.bos)),
                       ("EOS", (t.add_eos, t.eos), (d.add_eos, d.eos))):
        if a != b:
            return f"the {what} tokens differ (target {a}, draft {b}: add flag, id)"
    if abs(t.n_vocab - d.n_vocab) > VOCAB_SIZE_MAX_DIFF:
        return (f"the vocabulary sizes differ by more than {VOCAB_SIZE_MAX_DIFF} "
                f"({t.n_vocab} and {d.n_vocab})")
    for i in range(VOCAB_CHECK_START, min(t.n_vocab, d.n_vocab)):
        if t.tokens[i] != d.tokens[i]:
            return f"token {i} differs ({t.tokens[i]!r} and {d.tokens[i]!r})"
    return None


def draft_probability(logits: np.ndarray) -> tuple[int, float]:
    """The draft's pick and its probability among the top 10 (llama.cpp's top_k then
    softmax; ties go to the lower id)."""
    k = min(DRAFT_TOP_K, logits.size)
    top = np.argpartition(-logits, k - 1)[:k]
    top = top[np.lexsort((top, -logits[top]))]
    z = logits[top].astype(np.float64)
    p = np.exp(z - z[0])
    return int(top[0]), float(p[0] / p.sum())


class Speculator:
    """Generates with `target` (an Engine) and `draft` (another Engine), sequence 0 of each."""

    def __init__(self, target: Any, draft: Any, params: SpecParams | None = None) -> None:
        why = compatible(target, draft)
        if why is not None:
            raise ValueError(f"the draft model cannot speculate for the target: {why}")
        self.target, self.draft = target, draft
        self.params = params or SpecParams()
        self.stats = SpecStats()
        self._draft_seen: list[int] = []   # the tokens the draft's cache holds, in order

    def _sync_draft(self, tokens: list[int]) -> np.ndarray:
        """Bring the draft's cache to `tokens` (cutting where it differs, evaluating the
        rest) and return its logits after the last one."""
        seen = self._draft_seen
        n = 0
        while n < min(len(seen), len(tokens) - 1) and seen[n] == tokens[n]:
            n += 1
        self.draft.seq_rm(0, n, -1)
        logits = self.draft.decode(Batch(tokens[n:], list(range(n, len(tokens)))))
        self._draft_seen = list(tokens)
        return logits[-1]

    def _propose(self, tokens: list[int], n_max: int) -> list[int]:
        """The draft for what follows `tokens` (at most n_max tokens)."""
        p = self.params
        out: list[int] = []
        if n_max <= 0:
            return out
        logits = self._sync_draft(tokens)
        while True:
            tok, prob = draft_probability(logits)
            if prob < p.p_min:
                break
            out.append(tok)
            if len(out) >= min(p.n_max, n_max):
                break
            pos = len(tokens) + len(out) - 1
            logits = self.draft.decode(Batch([tok], [pos]))[-1]
            self._draft_seen.append(tok)
        return out if len(out) >= p.n_min else []

    def generate(self, prompt: list[int], n_predict: int, sampler: Any = None,
                 stop_at_eos: bool = True) -> Iterator[int]:
        """Yield the target's tokens after `prompt` (both caches start from it), greedy
        without a sampler. Stops after n_predict tokens, at an end-of-generation token, or
        when the context is full."""
        tgt = self.target
        if len(prompt) < 1:
            raise ValueError("speculative decoding needs a prompt of at least one token")
        tgt.reset()
        self.draft.reset()
        self._draft_seen = []
        if len(prompt) > 1:
            tgt.decode(Batch(prompt[:-1]))
        if sampler is not None:
            sampler.accept_many(prompt)
        tokens = list(prompt)        # what the target's cache will hold, the last not yet in
        n_ctx = tgt.cfg.n_ctx
        produced = 0
        while produced < n_predict:
            n_past = len(tokens) - 1
            room = min(n_ctx - n_past - 2, n_predict - produced - 1)
            t0 = time.perf_counter()
            draft = self._propose(tokens, room) if self.params.n_max else []
            t1 = time.perf_counter()
            if n_past + 1 + len(draft) > n_ctx:
                return
            logits = tgt.decode(Batch([tokens[-1]] + draft,
                                      list(range(n_past, n_past + 1 + len(draft))),
                                      logits=[True] * (1 + len(draft))))
            self.stats.target_s += time.perf_counter() - t1
            self.stats.draft_s += t1 - t0
            ids = []
            for i in range(len(draft) + 1):
                tok = int(np.argmax(logits[i])) if sampler is None else int(
                    sampler.sample(logits[i]))
                ids.append(tok)
                if i == len(draft) or tok != draft[i]:
                    break
            tgt.seq_rm(0, n_past + len(ids), -1)   # past the last accepted draft token
            self.stats.n_rounds += 1
            self.stats.n_drafted += len(draft)
            self.stats.n_accept += len(ids) - 1
            self.stats.accepted_per_round.append(len(ids) - 1)
            for tok in ids:
                tokens.append(tok)
                produced += 1
                self.stats.n_predict += 1
                yield tok
                if (stop_at_eos and tok in tgt.eog) or produced >= n_predict:
                    return
