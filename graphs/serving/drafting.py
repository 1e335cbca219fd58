"""Draft tokens for the scheduler's generating slots (`ggraph serve -md`), as llama.cpp's
draft-simple speculator proposes them (graphs/runtime/speculative.py: top 10, softmax, the
first; stop below p_min; drop a draft shorter than n_min), for every slot at once.

The draft model has a KV cache of its own with a sequence per slot, which follows the
target's tokens lazily: before drafting, each slot's draft sequence is cut where it stops
matching what the target holds and the rest is evaluated, all slots in one batch; then each
draft position is one batch over the slots still drafting. The scheduler puts every slot's
last token and its draft into its verify batch and keeps the draft while the slot's sampler
agrees with it (graphs/serving/scheduler.py).

A full draft cache drops the sequences of slots that are not drafting, then gives up drafting
for the step: a draft is an optimisation, never a reason for a request to fail.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggraph.graphs.models.batch import Batch
from ggraph.graphs.runtime.engine import NoKVSlot
from ggraph.graphs.runtime.speculative import SpecParams, compatible, draft_probability
from ggraph.graphs.serving.prefix import common_prefix


@dataclass
class Drafter:
    engine: Any
    params: SpecParams = field(default_factory=SpecParams)
    n_drafts: int = 0          # drafts proposed (llama-server's spec_decode_num_drafts)
    n_drafted: int = 0         # tokens drafted
    n_accepted: int = 0        # drafted tokens the target kept

    def __post_init__(self) -> None:
        self.seen: dict[int, np.ndarray] = {}

    @classmethod
    def for_target(cls, target: Any, draft: Any, params: SpecParams) -> "Drafter":
        why = compatible(target, draft)
        if why is not None:
            raise ValueError(f"the draft model cannot speculate for the target: {why}")
        if draft.cfg.n_seq_max < target.cfg.n_seq_max:
            raise ValueError(f"the draft's cache holds {draft.cfg.n_seq_max} sequences, the "
                             f"target has {target.cfg.n_seq_max} slots")
        return cls(draft, params)

    def propose(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """Per slot, a draft of at most n tokens to follow `tokens` (everything the target
        holds for it, then its last sampled token): {slot: (tokens, n)}."""
        wants = {s: w for s, w in wants.items() if w[1] > 0}
        if not wants or self.params.n_max <= 0:
            return {}
        logits = self._sync(wants)
        if logits is None:
            return {}
        drafts: dict[int, list[int]] = {s: [] for s in wants}
        live = list(wants)
        while live:
            going = []
            for row, s in enumerate(live):
                tok, prob = draft_probability(logits[row])
                if prob < self.params.p_min:
                    continue
                drafts[s].append(tok)
                if len(drafts[s]) < min(self.params.n_max, wants[s][1]):
                    going.append(s)
            if not going:
                break
            pos = [len(wants[s][0]) + len(drafts[s]) - 1 for s in going]
            logits = self._decode(Batch([drafts[s][-1] for s in going], pos,
                                        [(s,) for s in going], [True] * len(going)),
                                  keep=set(wants))
            if logits is None:   # the draft cache is full: what was drafted stands
                break
            for s in going:
                self.seen[s] = np.append(self.seen[s], np.int32(drafts[s][-1]))
            live = going
        out = {s: d for s, d in drafts.items() if d and len(d) >= self.params.n_min}
        self.n_drafts += len(out)
        self.n_drafted += sum(map(len, out.values()))
        return out

    def _sync(self, wants: dict[int, tuple[list[int], int]]) -> np.ndarray | None:
        """Bring each wanted slot's draft sequence to its tokens; the logits after each."""
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[tuple[int, ...]] = []
        out: list[bool] = []
        for s, (tokens, _) in wants.items():
            have = self.seen.get(s, np.zeros(0, np.int32))
            t = np.asarray(tokens, np.int32)
            n = min(common_prefix(have, t), t.size - 1)
            self.engine.seq_rm(s, n, -1)
            self.seen[s] = t[:n]
            toks.extend(int(x) for x in t[n:])
            pos.extend(range(n, t.size))
            seqs.extend([(s,)] * (t.size - n))
            out.extend([False] * (t.size - n - 1) + [True])
        logits = self._decode(Batch(toks, pos, seqs, out), keep=set(wants))
        if logits is not None:
            for s, (tokens, _) in wants.items():
                self.seen[s] = np.asarray(tokens, np.int32)
        return logits

    def _decode(self, batch: Batch, keep: set[int]) -> np.ndarray | None:
        """The batch's logits; on a full cache, once, the sequences of slots not in `keep`
        are dropped and it is tried again; None if it still does not fit."""
        for attempt in range(2):
            try:
                return self.engine.decode(batch)
            except NoKVSlot:
                if attempt:
                    return None
                for s in list(self.seen):
                    if s not in keep:
                        self.engine.seq_rm(s, -1, -1)
                        del self.seen[s]
        return None

    def accepted(self, n: int) -> None:
        self.n_accepted += n
