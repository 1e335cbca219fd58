"""Batches of tokens from several sequences, as llama.cpp's llama_batch: each token has a
position, a set of sequence ids (the first is the one it attends as) and whether its logits
are wanted.

`prepare` checks a batch against the cache the way llama_batch_allocr::init does
(src/llama-batch.cpp) and fills the positions it leaves out; `split_simple` cuts the result
into ubatches of at most n_ubatch tokens in order (llama.cpp's split for a unified cache),
`split_equal` into ubatches of equal shares of consecutive sequences (its split for a cache
with a stream per sequence). Each ubatch remembers its tokens' places in the batch, so the
logits go back in batch order. Every error is one line naming the token index, the sequence
or the position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


class SeqPositions(Protocol):
    """What `prepare` asks of the cache: each sequence's position range (-1: none)."""

    def seq_pos_min(self, s: int) -> int: ...

    def seq_pos_max(self, s: int) -> int: ...


@dataclass
class Batch:
    """Tokens with, per token, a position (None: each sequence continues where the cache
    ends), sequence ids (None: sequence 0) and whether its logits are wanted (None: the
    last token's only)."""
    tokens: Sequence[int] | np.ndarray
    pos: Sequence[int] | np.ndarray | None = None
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[bool] | np.ndarray | None = None

    @classmethod
    def of_sequences(cls, prompts: Sequence[Sequence[int]], all_logits: bool = False
                     ) -> "Batch":
        """Prompt i as sequence i, continuing each where the cache ends; the last token of
        each prompt (or every token) gives logits."""
        toks = [int(t) for p in prompts for t in p]
        seqs = [(i,) for i, p in enumerate(prompts) for _ in p]
        wanted = [all_logits or j == len(p) - 1 for p in prompts for j in range(len(p))]
        return cls(toks, None, seqs, wanted)


@dataclass
class UBatch:
    """Validated tokens with their positions: what the cache places and the graph reads."""
    tokens: np.ndarray                 # int32 [n]
    pos: np.ndarray                    # int32 [n]
    seq_ids: tuple[tuple[int, ...], ...]
    out: np.ndarray                    # bool [n]: logits wanted
    index: np.ndarray | None = None    # int64 [n]: each token's place in the batch (None: 0..)

    def __len__(self) -> int:
        return int(self.tokens.size)

    @property
    def seq(self) -> np.ndarray:
        """Each token's first sequence id: the sequence whose cells it attends to."""
        return np.fromiter((ids[0] for ids in self.seq_ids), np.int64, len(self.seq_ids))

    @property
    def out_rows(self) -> np.ndarray:
        return np.flatnonzero(self.out).astype(np.int32)

    @property
    def places(self) -> np.ndarray:
        """Each token's place in the batch it came from."""
        return np.arange(len(self), dtype=np.int64) if self.index is None else self.index

    def part(self, a: int, b: int) -> "UBatch":
        return self.take(np.arange(a, min(b, len(self))))

    def take(self, idx: np.ndarray) -> "UBatch":
        """The tokens at `idx`, in that order."""
        return UBatch(self.tokens[idx], self.pos[idx], tuple(self.seq_ids[i] for i in idx),
                      self.out[idx], self.places[idx])


def prepare(batch: Batch, n_vocab: int, n_seq_max: int, mem: SeqPositions) -> UBatch:
    """The batch checked as llama.cpp checks it, with positions filled in: token ids in
    [0, n_vocab), sequence ids in [0, n_seq_max), and for each sequence positions that
    continue its cached ones (first = last cached + 1), without gaps and never decreasing;
    tokens of several sequences need those sequences to hold the same positions.
    (llama.cpp's check that a sequence's tokens share a set of sequences cannot fail: every
    such set holds the sequence itself.)"""
    toks = check_tokens(batch.tokens, n_vocab)
    n = toks.size
    seq_ids = _seq_ids(batch.seq_ids, n, n_seq_max)
    pos = _positions(batch.pos, seq_ids, n, mem)
    out = _outputs(batch.logits, n)
    _check_sequences(pos, seq_ids, n_seq_max, mem)
    return UBatch(toks.astype(np.int32), pos, seq_ids, out)


# batches of at most this many tokens are checked without numpy (check_tokens)
SMALL = 16


def check_tokens(tokens: Sequence[int] | np.ndarray, n_vocab: int) -> np.ndarray:
    """The token ids as an array: a non-empty 1-D list of integers in [0, n_vocab), checked
    before any narrowing (a bad one is named by its index)."""
    toks = np.asarray(tokens)
    if toks.ndim != 1 or toks.size == 0 or toks.dtype.kind not in "iu":
        raise ValueError(f"a batch takes a non-empty list of integer token ids, got "
                         f"{toks.dtype} values of shape {toks.shape}")
    # a decode step's few ids are compared as Python ints: three numpy calls and a search
    # cost more than the loop, and every token goes through here twice (eval, prepare)
    if toks.size <= SMALL:
        for i, t in enumerate(toks.tolist()):
            if not 0 <= t < n_vocab:
                raise ValueError(f"invalid token[{i}] = {t}: ids are in [0, {n_vocab})")
        return toks
    bad = np.flatnonzero((toks < 0) | (toks >= n_vocab))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"invalid token[{i}] = {int(toks[i])}: ids are in [0, {n_vocab})")
    return toks


def _seq_ids(given: Sequence[Sequence[int]] | None, n: int, n_seq_max: int
             ) -> tuple[tuple[int, ...], ...]:
    if given is None:
        return ((0,),) * n
    if len(given) != n:
        raise ValueError(f"the batch has {n} tokens but {len(given)} sequence id sets")
    out = []
    for i, ids in enumerate(given):
        t = tuple(int(s) for s in ids)
        if not t:
            raise ValueError(f"token {i} has no sequence id")
        for s in t:
            if not 0 <= s < n_seq_max:
                raise ValueError(f"invalid seq_id[{i}] = {s}: ids are in [0, {n_seq_max}) "
                                 f"(n_seq_max, -np)")
        out.append(t)
    return tuple(out)


def _positions(given: Sequence[int] | np.ndarray | None, seq_ids: tuple[tuple[int, ...], ...],
               n: int, mem: SeqPositions) -> np.ndarray:
    if given is not None:
        pos = np.asarray(given)
        if pos.shape != (n,) or pos.dtype.kind not in "iu":
            raise ValueError(f"the batch has {n} tokens but positions of shape {pos.shape} "
                             f"({pos.dtype})")
        if pos.size and (pos.min() < 0 or pos.max() >= np.iinfo(np.int32).max):
            i = int(np.flatnonzero((pos < 0) | (pos >= np.iinfo(np.int32).max))[0])
            raise ValueError(f"invalid pos[{i}] = {int(pos[i])}")
        return pos.astype(np.int32)
    nxt: dict[int, int] = {}
    pos = np.empty(n, np.int32)
    for i, ids in enumerate(seq_ids):   # llama.cpp: the first id's next position, then +1
        s = ids[0]
        if s not in nxt:
            nxt[s] = mem.seq_pos_max(s) + 1
        pos[i] = nxt[s]
        nxt[s] += 1
    return pos


def _outputs(given: Sequence[bool] | np.ndarray | None, n: int) -> np.ndarray:
    if given is None:
        out = np.zeros(n, bool)
        out[-1] = True
        return out
    out = np.asarray(given)
    if out.shape != (n,):
        raise ValueError(f"the batch has {n} tokens but {out.size} logits flags")
    return out.astype(bool)


def _check_sequences(pos: np.ndarray, seq_ids: tuple[tuple[int, ...], ...], n_seq_max: int,
                     mem: SeqPositions) -> None:
    by_seq: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    for i, ids in enumerate(seq_ids):
        for s in ids:
            by_seq.setdefault(s, []).append(int(pos[i]))
            if pos[i] < last.get(s, -1):
                raise ValueError(f"sequence {s}: positions decrease at token {i} "
                                 f"({last[s]} then {int(pos[i])})")
            last[s] = int(pos[i])
    for s, ps in by_seq.items():
        p_max = mem.seq_pos_max(s)
        if p_max >= 0 and min(ps) != p_max + 1:
            raise ValueError(f"sequence {s}: the batch starts at position {min(ps)} but the "
                             f"cache holds it up to {p_max}; positions must continue at "
                             f"{p_max + 1} (remove the rest first: seq_rm)")
        if max(ps) - min(ps) + 1 > len(ps):
            raise ValueError(f"sequence {s}: positions {min(ps)}..{max(ps)} have gaps")
    for ids in set(seq_ids):
        if len(ids) > 1:
            ranges = {(mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in ids}
            if len(ranges) > 1:
                raise ValueError(f"sequences {', '.join(map(str, ids))} share tokens of the "
                                 f"batch but hold different positions in the cache")


def split_simple(ub: UBatch, n_ubatch: int) -> list[UBatch]:
    """The next n_ubatch tokens at a time, in batch order (llama.cpp's split_simple); a batch
    that fits is its own one ubatch (a decode step: no copies of its arrays)."""
    if len(ub) <= n_ubatch:
        return [ub]
    return [ub.part(a, a + n_ubatch) for a in range(0, len(ub), n_ubatch)]


def split_equal(ub: UBatch, n_ubatch: int) -> list[UBatch]:
    """llama.cpp's split_equal(sequential=true), for a cache with a stream per sequence: each
    ubatch takes sequences with consecutive ids (the first still-waiting token's, then the
    next id as its tokens come up in batch order), and from each the same number of its next
    tokens, as many as keep the ubatch within n_ubatch; tokens of a sequence stay in order,
    and the ubatch lists them sequence after sequence. A token of several sequences has no
    stream to go to (llama.cpp refuses it too)."""
    for i, ids in enumerate(ub.seq_ids):
        if len(ids) > 1:
            raise ValueError(f"token {i} belongs to sequences {', '.join(map(str, ids))}: with "
                             f"a KV cache stream per sequence a token has one sequence (use one "
                             f"unified cache, --kv-unified)")
    seq = ub.seq
    waiting = {int(s): list(np.flatnonzero(seq == s)) for s in np.unique(seq)}
    used = np.zeros(len(ub), bool)
    out = []
    while not used.all():
        chosen: list[int] = []
        for i in np.flatnonzero(~used):   # sequences with consecutive ids, in batch order
            s = int(seq[i])
            if s in chosen or (chosen and s != chosen[-1] + 1):
                continue
            chosen.append(s)
            if len(chosen) > n_ubatch:
                break
        chosen = chosen[:n_ubatch]
        n_each = max(1, min(min(len(waiting[s]) for s in chosen), n_ubatch // len(chosen)))
        idx = []
        for s in chosen:
            idx += waiting[s][:n_each]
            del waiting[s][:n_each]
        used[idx] = True
        out.append(ub.take(np.asarray(idx, np.int64)))
    return out
