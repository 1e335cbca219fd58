"""Several sequences generated together, as llama.cpp's llama-parallel runs its clients: the
prompts are evaluated in one batch (each its own sequence), then every step decodes one token
of each sequence still going in one batch; a sequence that ends (an end-of-generation token,
its token count) leaves the batch and its cells are freed (seq_rm).

Each sequence has its own sampler (or greedy), so N copies of one prompt with different
seeds give N samples. `ParallelResult` holds each sequence's tokens, why it stopped and its
timings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ggraph.graphs.models.batch import Batch


@dataclass
class ParallelResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    stop: str = "n_predict"          # "n_predict", "eog" or "context full"
    prompt_s: float = 0.0
    gen_s: float = 0.0


def generate_parallel(engine: Any, prompts: Sequence[Sequence[int]], n_predict: int,
                      samplers: Sequence[Any] | None = None, stop_at_eos: bool = True
                      ) -> list[ParallelResult]:
    """Generate after each prompt, all together in `engine` (its cache must hold
    len(prompts) sequences: EngineConfig.n_seq_max); greedy where samplers is None."""
    n = len(prompts)
    if n == 0:
        return []
    if n > engine.cfg.n_seq_max:
        raise ValueError(f"{n} sequences do not fit a cache of {engine.cfg.n_seq_max} "
                         f"sequences (-np)")
    if samplers is not None and len(samplers) != n:
        raise ValueError(f"{n} prompts but {len(samplers)} samplers")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    out = [ParallelResult(list(p)) for p in prompts]
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.decode(Batch.of_sequences(prompts))
    dt = time.perf_counter() - t0
    for r in out:
        r.prompt_s = dt
    if samplers is not None:
        for s, p in zip(samplers, prompts):
            s.accept_many(p)
    live = list(range(n))            # the sequences still going, in logits row order
    while live:
        toks = []
        for row, s in enumerate(live):
            tok = int(np.argmax(logits[row])) if samplers is None else int(
                samplers[s].sample(logits[row]))
            out[s].tokens.append(tok)
            toks.append(tok)
        going = []
        for s, tok in zip(live, toks):
            if stop_at_eos and tok in engine.eog:
                out[s].stop = "eog"
            elif len(out[s].tokens) >= n_predict:
                out[s].stop = "n_predict"
            else:
                going.append((s, tok))
                continue
            engine.seq_rm(s)         # its cells are free for the others
        live = [s for s, _ in going]
        if not live:
            break
        if engine.cache.n_free() < len(live):
            for s in live:
                out[s].stop = "context full"
            break
        t0 = time.perf_counter()
        logits = engine.decode(Batch([t for _, t in going], seq_ids=[(s,) for s in live],
                                     logits=[True] * len(live)))
        dt = time.perf_counter() - t0
        for s in live:
            out[s].gen_s += dt
    engine.reset()
    return out
