"""The cells of a KV cache: which position each cell holds and for which sequences, as
llama.cpp's llama_kv_cells keeps them (src/llama-kv-cells.h), and what is decided from them:
where a ubatch's tokens go (find_slot), what each token may attend to (the KQ mask), and the
sequence operations (seq_rm, seq_cp, seq_keep, seq_add, seq_div).

A cell is empty (pos -1) or holds one position for a set of sequences (a common prefix is
stored once and shared). Positions move in place: seq_add / seq_div change a cell's position
and record the change in `shift`, and the K rows of shifted cells are re-roped (the K-shift,
graphs/models/kv_cache.py's shift_graph) before the next evaluation reads them.

With a sliding window (n_swa > 0, llama.cpp's standard SWA type) a cell whose only sequence
has moved more than the window past it can be reused (find_slot), and the mask hides cells
outside a token's window. Cells are found one at a time from `head`, not in one run, as
llama.cpp's find_slot(cont=false) finds them; one sequence appended to an empty cache gets
cells 0, 1, 2, ... (and a sliding-window cache of enough cells becomes a ring).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ
POS_END = np.iinfo(np.int32).max  # an open end of a position range [p0, p1)


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's ranges: a negative p0 is 0, a negative p1 is open."""
    return max(int(p0), 0), POS_END if p1 < 0 else int(p1)


@dataclass
class KVCells:
    size: int
    n_seq_max: int = 1
    n_swa: int = 0   # > 0: a sliding window of n_swa positions (standard type)
    pos: np.ndarray = field(init=False)     # int32 [size] (llama_pos): -1 empty
    seq: np.ndarray = field(init=False)     # bool [size, n_seq_max]
    shift: np.ndarray = field(init=False)   # int32 [size]: position change since the K-shift
    head: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.n_seq_max <= MAX_SEQ:
            raise ValueError(f"n_seq_max={self.n_seq_max}: a cache holds 1..{MAX_SEQ} sequences")
        if self.size <= 0:
            raise ValueError(f"a cache needs cells, got size {self.size}")
        self.clear()

    def clear(self) -> None:
        self.pos = np.full(self.size, -1, np.int32)
        self.seq = np.zeros((self.size, self.n_seq_max), bool)
        self.shift = np.zeros(self.size, np.int32)
        self.head = 0

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        """The state to go back to (a decode's, taken every step: the shifts are usually all
        zero then, and not copied)."""
        shift = self.shift.copy() if self.shift.any() else None
        return self.pos.copy(), self.seq.copy(), shift, self.head

    def restore(self, snap: tuple[np.ndarray, np.ndarray, np.ndarray | None, int]) -> None:
        self.pos, self.seq = snap[0].copy(), snap[1].copy()
        self.shift = snap[2].copy() if snap[2] is not None else np.zeros(self.size, np.int32)
        self.head = snap[3]

    # -- what the cells hold -------------------------------------------------------------------
    @property
    def used(self) -> int:
        return int(np.count_nonzero(self.pos >= 0))

    @property
    def used_max_p1(self) -> int:
        """One past the highest non-empty cell (0 when empty)."""
        nz = np.flatnonzero(self.pos >= 0)
        return int(nz[-1]) + 1 if nz.size else 0

    def check_seq(self, s: int) -> int:
        if not 0 <= int(s) < self.n_seq_max:
            raise ValueError(f"sequence id {s} is out of range [0, {self.n_seq_max}) (the "
                             f"cache was made for {self.n_seq_max} sequences: -np)")
        return int(s)

    def seq_pos_min(self, s: int) -> int:
        """The smallest position of sequence s, -1 when it holds none."""
        p = self.pos[self.seq[:, self.check_seq(s)]]
        return int(p.min()) if p.size else -1

    def seq_pos_max(self, s: int) -> int:
        """The largest position of sequence s, -1 when it holds none."""
        p = self.pos[self.seq[:, self.check_seq(s)]]
        return int(p.max()) if p.size else -1

    def seq_pos_maxes(self) -> np.ndarray:
        """Every sequence's largest position (-1 for one holding none)."""
        return np.where(self.seq, self.pos[:, None], -1).max(axis=0)

    def seq_positions(self, s: int) -> np.ndarray:
        """Sequence s's positions, ascending."""
        return np.sort(self.pos[self.seq[:, self.check_seq(s)]])

    def swa_masked(self, p0: np.ndarray | int, p1: np.ndarray | int) -> np.ndarray | bool:
        """llama_hparams::is_masked_swa, standard type: position p1 no longer sees p0."""
        if self.n_swa <= 0:
            return np.zeros(np.broadcast(p0, p1).shape, bool) if np.ndim(p0) or np.ndim(p1) \
                else False
        return np.asarray(p1) - np.asarray(p0) >= self.n_swa

    # -- placing a ubatch -----------------------------------------------------------------------
    def find_slot(self, n_tokens: int) -> np.ndarray | None:
        """Cells for n_tokens new tokens, searched one at a time circularly from the head
        (from cell 0 when the head is past used + 2 n_tokens); a cell is free when empty, or
        when its one sequence's next position no longer sees it (sliding window). None when
        the cache has too few free cells (llama_decode's return code 1)."""
        if n_tokens > self.size:
            return None
        head = self.head if self.head <= self.used + 2 * n_tokens else 0
        free = self.pos < 0
        if self.n_swa > 0:
            n_seqs = self.seq.sum(axis=1)
            one = np.flatnonzero(n_seqs == 1)
            if one.size:
                owner = self.seq[one].argmax(axis=1)
                nxt = self.seq_pos_maxes() + 1
                free[one] |= np.asarray(self.swa_masked(self.pos[one], nxt[owner]))
        cells = np.flatnonzero(free[head:])[:n_tokens] + head
        if cells.size < n_tokens:   # around the end, from cell 0
            cells = np.concatenate((cells, np.flatnonzero(free[:head])[:n_tokens - cells.size]))
        return cells if cells.size == n_tokens else None

    def apply(self, cells: np.ndarray, pos: np.ndarray, seq_ids: Sequence[Sequence[int]]
              ) -> None:
        """Write tokens (positions `pos`, sequence sets `seq_ids`) into `cells`: a reused
        sliding-window cell first loses what it held, and so do the positions of that sequence
        below it (each sequence keeps one run of positions, as llama.cpp's apply_ubatch)."""
        purge: dict[int, int] = {}
        for c in np.asarray(cells, np.int64):
            if self.pos[c] >= 0:
                for s in np.flatnonzero(self.seq[c]):
                    purge[int(s)] = max(purge.get(int(s), -1), int(self.pos[c]))
                self.rm_cell(int(c))
        for c, p, ids in zip(np.asarray(cells, np.int64), np.asarray(pos), seq_ids):
            self.pos[c] = p
            self.seq[c, [self.check_seq(s) for s in ids]] = True
        for s, p_max in purge.items():
            if self.seq_pos_min(s) <= p_max:
                self.seq_rm(s, self.seq_pos_min(s), p_max + 1)
        self.head = int(cells[-1]) + 1 if len(cells) else self.head

    def rm_cell(self, c: int) -> None:
        self.pos[c] = -1
        self.seq[c] = False
        self.shift[c] = 0

    # -- the mask -------------------------------------------------------------------------------
    def mask(self, pos: np.ndarray, seq: np.ndarray, n_kv: int, dtype: type = np.float32
             ) -> np.ndarray:
        """The KQ mask [n_tokens, n_kv] of tokens at positions `pos` of sequences `seq`
        (each token's first id): 0 where the cell holds the token's sequence at a position
        not after the token's (and inside its window), -inf elsewhere, as llama.cpp's
        set_input_kq_mask."""
        p0 = self.pos[:n_kv][None, :]
        p1 = np.asarray(pos, np.int64)[:, None]
        seen = (p0 >= 0) & self.seq[:n_kv][:, np.asarray(seq, np.int64)].T & (p0 <= p1)
        if self.n_swa > 0:
            seen &= ~np.asarray(self.swa_masked(p0, p1))
        return np.where(seen, 0.0, -np.inf).astype(dtype)

    # -- sequence operations (llama.cpp's, ranges [p0, p1) with negative = open) ---------------
    def _in(self, p0: int, p1: int) -> np.ndarray:
        a, b = pos_range(p0, p1)
        return (self.pos >= a) & (self.pos < b)

    def _lower_head(self, freed: np.ndarray) -> None:
        idx = np.flatnonzero(freed)
        if idx.size and idx[0] < self.head:
            self.head = int(idx[0])

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        """Remove sequence s (every sequence when s < 0) from the cells of positions
        [p0, p1); a cell left without sequences is empty."""
        sel = self._in(p0, p1)
        before = self.pos >= 0
        if s < 0:
            self.seq[sel] = False
        else:
            self.seq[sel, self.check_seq(s)] = False
        emptied = before & ~self.seq.any(axis=1)
        self.pos[emptied] = -1
        self.shift[emptied] = 0
        self._lower_head(emptied)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Sequence dst also holds src's cells of positions [p0, p1) (shared, not copied)."""
        src, dst = self.check_seq(src), self.check_seq(dst)
        if src != dst:
            self.seq[self._in(p0, p1) & self.seq[:, src], dst] = True

    def seq_keep(self, s: int) -> None:
        """Only sequence s remains: other sequences leave every cell, and cells without s
        become empty."""
        s = self.check_seq(s)
        has = self.seq[:, s].copy()
        emptied = (self.pos >= 0) & ~has
        self.seq[:] = False
        self.seq[has, s] = True
        self.pos[emptied] = -1
        self.shift[emptied] = 0
        self._lower_head(emptied)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        """Positions [p0, p1) of sequence s move by delta (K re-roped by the K-shift); a cell
        moved below 0 becomes empty. The head goes back to the first freed cell, or to 0."""
        s = self.check_seq(s)
        a, b = pos_range(p0, p1)
        if delta == 0 or a == b:
            return
        sel = self._in(p0, p1) & self.seq[:, s]
        self.pos[sel] += delta
        self.shift[sel] += delta
        freed = sel & (self.pos < 0)
        self.pos[freed] = -1
        self.seq[freed] = False
        self.shift[freed] = 0
        idx = np.flatnonzero(freed)
        self.head = int(idx[0]) if idx.size else 0

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        """Positions [p0, p1) of sequence s divided by d (integer division). The recorded
        shift grows by old - new, with llama.cpp's sign (llama_kv_cells::pos_div), so the
        K-shift turns these rows the way llama.cpp does."""
        s = self.check_seq(s)
        a, b = pos_range(p0, p1)
        if d == 1 or a == b:
            return
        if d <= 0:
            raise ValueError(f"seq_div by {d}: the divisor must be positive")
        sel = self._in(p0, p1) & self.seq[:, s]
        old = self.pos[sel]
        self.pos[sel] = old // d
        self.shift[sel] += old - self.pos[sel]

    def take_seq(self, other: "KVCells", src: int, dst: int) -> None:
        """Become a copy of sequence src's cells of `other` as sequence dst, cell for cell
        (llama.cpp's seq_cp across streams, whose rows are copied whole): what this stream
        held is dropped; pending shifts come along, so each stream re-ropes its own rows."""
        src, dst = other.check_seq(src), self.check_seq(dst)
        self.clear()
        has = other.seq[:, src] & (other.pos >= 0)
        self.pos[has] = other.pos[has]
        self.seq[has, dst] = True
        self.shift[has] = other.shift[has]
        self.head = other.head

    # -- the K-shift ---------------------------------------------------------------------------
    def shifted(self) -> tuple[np.ndarray, np.ndarray]:
        """The non-empty cells whose positions moved since the last K-shift, and by how
        much."""
        cells = np.flatnonzero((self.shift != 0) & (self.pos >= 0))
        return cells, self.shift[cells].copy()

    def reset_shift(self) -> None:
        self.shift[:] = 0
