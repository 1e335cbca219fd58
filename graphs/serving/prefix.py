"""Which cached sequence a new prompt can start from.

Each slot's sequence in the KV cache holds the tokens it evaluated, from position 0. A new
prompt reuses the longest run of its first tokens that any of them holds: its own slot's
(llama-server's prompt cache) or another slot's, busy or idle (the cache's seq_cp then shares
those cells with the new sequence, as the paths of a prefix tree over the cached sequences
share their common start). `PrefixIndex` keeps the token arrays and answers with numpy
comparisons: a few slots of a few thousand tokens each are compared in microseconds, and a
tree would have to be kept in step with every cut and append for no better answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common start of two token arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass
class PrefixIndex:
    """Per slot, the tokens its sequence holds in the cache (positions 0..len-1)."""
    n_slots: int
    tokens: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [np.zeros(0, np.int32) for _ in range(self.n_slots)]

    def set(self, slot: int, toks: Sequence[int] | np.ndarray) -> None:
        self.tokens[slot] = np.asarray(toks, np.int32)

    def append(self, slot: int, toks: Sequence[int]) -> None:
        self.tokens[slot] = np.concatenate((self.tokens[slot], np.asarray(toks, np.int32)))

    def cut(self, slot: int, n: int) -> None:
        self.tokens[slot] = self.tokens[slot][:n]

    def held(self, slot: int) -> int:
        return int(self.tokens[slot].size)

    def match(self, prompt: Sequence[int] | np.ndarray, among: Sequence[int] | None = None
              ) -> list[int]:
        """Per slot (or only those `among`, others 0), the prompt's tokens its sequence
        holds."""
        p = np.asarray(prompt, np.int32)
        want = range(self.n_slots) if among is None else set(among)
        return [common_prefix(p, self.tokens[s]) if s in want else 0
                for s in range(self.n_slots)]
