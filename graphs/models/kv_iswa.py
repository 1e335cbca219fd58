"""llama.cpp's iswa cache for interleaved sliding-window attention (Gemma 3): a full
`KVCache` for the global layers and a smaller one for the sliding-window layers, whose cells
are reused once outside the window (a ring, for one sequence). It takes the same protocol as
`KVCache` (graphs/models/kv_cache.py), passing every placement and sequence operation to both
parts, so the engine never asks which cache it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.models.batch import UBatch
from ggraph.graphs.models.kv_cache import CellMoves, KVCache, Slots, StreamCopy, StreamRange

SWA_PAD = 256  # llama.cpp always pads the sliding-window cache to 256 cells


def swa_cache_size(size: int, n_swa: int, n_ubatch: int, swa_full: bool = False,
                   n_seq_max: int = 1, unified: bool = True) -> int:
    """Cells of the sliding-window cache (per stream) as llama.cpp sizes it
    (llama_kv_cache_iswa): pad256(min(size, n_swa * n_seq_max + n_ubatch)) for one unified
    stream, every sequence keeping its own window; pad256(min(size, n_swa + n_ubatch)) for a
    stream per sequence; the full `size` with swa_full."""
    if swa_full:
        return size
    n = min(size, n_swa * (n_seq_max if unified else 1) + n_ubatch)
    return -(-n // SWA_PAD) * SWA_PAD


@dataclass
class IswaKVCache:
    """llama.cpp's iswa cache: `base` (n_ctx cells) holds the global layers, `swa` the
    sliding-window layers in pad256(n_swa + n_ubatch) cells, reused once outside the window
    (for one sequence appending, cell = position % size: a ring). Both place every token and
    take every sequence operation, as llama_kv_cache_iswa does.

    A ubatch never overwrites a cell one of its own queries reads while swa.size >= n_swa +
    n_ubatch (checked by `check_ubatch`).
    """
    base: KVCache
    swa: KVCache
    n_swa: int
    is_swa: tuple[bool, ...]

    @classmethod
    def create(cls, ctx: Context, is_swa: Sequence[bool], n_embd_k: int, n_embd_v: int,
               size: int, n_swa: int, n_ubatch: int, type_k: GGMLType | str = "f16",
               type_v: GGMLType | str = "f16", flash_attn: bool = False,
               swa_full: bool = False, n_seq_max: int = 1, unified: bool = True
               ) -> IswaKVCache:
        """The two caches (`size` cells per stream, one stream or one per sequence):
        is_swa[il] says which holds layer il."""
        if n_swa <= 0:
            raise ValueError(f"an iswa cache needs a sliding window, got n_swa={n_swa}")
        flags = tuple(bool(x) for x in is_swa)
        glob = [il for il, s in enumerate(flags) if not s]
        local = [il for il, s in enumerate(flags) if s]
        base = KVCache.create(ctx, len(glob), n_embd_k, n_embd_v, size, type_k, type_v,
                              flash_attn, layer_ids=glob, n_seq_max=n_seq_max, unified=unified)
        n_swa_cells = swa_cache_size(size, n_swa, n_ubatch, swa_full, n_seq_max, unified)
        swa = KVCache.create(ctx, len(local), n_embd_k, n_embd_v, n_swa_cells, type_k, type_v,
                             flash_attn, layer_ids=local, n_seq_max=n_seq_max, n_swa=n_swa,
                             unified=unified)
        c = cls(base, swa, n_swa, flags)
        c.check_ubatch(min(size, n_ubatch))
        return c

    def check_ubatch(self, n_tokens: int) -> None:
        """A ubatch of n_tokens must not overwrite a ring cell that one of its queries reads."""
        if self.swa.size < self.base.size and self.swa.size < self.n_swa + n_tokens:
            raise ValueError(f"a ubatch of {n_tokens} tokens does not fit the sliding-window "
                             f"cache of {self.swa.size} cells with a window of {self.n_swa}: it "
                             f"needs at least n_swa + n_ubatch = {self.n_swa + n_tokens}")

    # -- the protocol the engine uses -----------------------------------------------------------
    @property
    def size(self) -> int:
        return self.base.size

    @property
    def n_seq_max(self) -> int:
        return self.base.n_seq_max

    @property
    def n_stream(self) -> int:
        return self.base.n_stream

    @property
    def n_layer(self) -> int:
        return len(self.is_swa)

    @property
    def type_k(self) -> GGMLType:
        return self.base.type_k

    @property
    def type_v(self) -> GGMLType:
        return self.base.type_v

    @property
    def v_trans(self) -> bool:
        return self.base.v_trans

    def part(self, il: int) -> tuple[KVCache, int]:
        """The cache holding layer il and the layer's index in it."""
        sub = self.swa if self.is_swa[il] else self.base
        return sub, sum(1 for j in range(il) if self.is_swa[j] == self.is_swa[il])

    @property
    def k(self) -> list[Tensor]:
        """Every layer's K tensor, by layer."""
        return [self.part(il)[0].k[self.part(il)[1]] for il in range(self.n_layer)]

    @property
    def v(self) -> list[Tensor]:
        return [self.part(il)[0].v[self.part(il)[1]] for il in range(self.n_layer)]

    @property
    def bytes_k(self) -> int:
        return self.base.bytes_k + self.swa.bytes_k

    @property
    def bytes_v(self) -> int:
        return self.base.bytes_v + self.swa.bytes_v

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.swa.nbytes

    def summary_lines(self) -> list[str]:
        """llama.cpp's lines: each cache announced by llama_kv_cache_iswa, then its own line."""
        return [f"llama_kv_cache_iswa: creating non-SWA KV cache, size = {self.base.size} cells",
                self.base.summary(),
                f"llama_kv_cache_iswa: creating     SWA KV cache, size = {self.swa.size} cells",
                self.swa.summary()]

    def summary(self) -> str:
        return "\n".join(self.summary_lines())

    # -- cells and sequences: both parts ------------------------------------------------------
    @property
    def n_used(self) -> int:
        """Tokens of sequence 0 (its last position + 1)."""
        return self.base.n_used

    def n_kv(self) -> int:
        """Cells of the global cache a graph attends to; large enough that its first
        min(n_kv, swa.size) ring cells cover the ring's used ones too (swa_n_kv)."""
        return min(self.base.size, max(self.base.n_kv(), self.swa.n_kv()))

    def swa_n_kv(self, n_kv: int) -> int:
        """The ring cells a graph attending to the first n_kv global cells reads."""
        return min(self.swa.size, n_kv)

    def streams_of(self, ub: UBatch) -> StreamRange:
        return self.base.streams_of(ub)

    def split(self, ub: UBatch, n_ubatch: int) -> list[UBatch]:
        return self.base.split(ub, n_ubatch)

    def place(self, ub: UBatch) -> Slots | None:
        snap = self.swa.snapshot()
        swa = self.swa.place(ub)
        if swa is None:
            return None
        base = self.base.place(ub)
        if base is None:
            self.swa.restore(snap)
            return None
        return Slots(base.cells, swa.cells)

    def n_free(self) -> int:
        return self.base.n_free()

    def snapshot(self) -> object:
        return self.base.snapshot(), self.swa.snapshot()

    def restore(self, snap: object) -> None:
        b, w = snap  # type: ignore[misc]
        self.base.restore(b)
        self.swa.restore(w)

    def clear(self) -> None:
        self.base.clear()
        self.swa.clear()

    def seq_pos_min(self, s: int) -> int:
        return self.base.seq_pos_min(s)

    def seq_pos_max(self, s: int) -> int:
        return self.base.seq_pos_max(s)

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        self.base.seq_rm(s, p0, p1)
        self.swa.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.base.seq_cp(src, dst, p0, p1)
        self.swa.seq_cp(src, dst, p0, p1)

    def seq_keep(self, s: int) -> None:
        self.base.seq_keep(s)
        self.swa.seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        self.base.seq_add(s, p0, p1, delta)
        self.swa.seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self.base.seq_div(s, p0, p1, d)
        self.swa.seq_div(s, p0, p1, d)

    def check_cut(self, s: int, n: int) -> None:
        self.swa.check_cut(s, n)

    def k_shifts(self) -> list[CellMoves]:
        return self.base.k_shifts() + self.swa.k_shifts()

    def reset_shift(self) -> None:
        self.base.reset_shift()
        self.swa.reset_shift()

    def stream_copies(self) -> list[StreamCopy]:
        return self.base.stream_copies() + self.swa.stream_copies()

    def reset_copies(self) -> None:
        self.base.reset_copies()
        self.swa.reset_copies()
