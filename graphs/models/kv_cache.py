"""The KV caches: per-layer K and V tensors of a runtime-chosen type, pre-allocated leafs that
set_rows writes (quantizing on write) and attention reads (dequantizing on read), and the
cells that say what each row holds (graphs/models/kv_cells.py: position and sequences).

Without flash attention V is stored transposed ([kv_size, n_embd_v]: one row per channel) so
that V*softmax is a plain mul_mat; block types cannot hold one value per row, hence a
quantized V cache requires flash attention.

Two caches share one protocol, so the engine never asks which it holds: `place(ubatch)` finds
and takes cells for a ubatch (Slots), `n_kv()` the cells a graph attends to, the sequence
operations (seq_rm, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min/max), `k_shifts()` the
pending K-shift, `snapshot()/restore()`, `k` / `v` (every layer's tensors), `nbytes` and
`summary_lines()` (llama.cpp's memory lines):
- `KVCache`: one cache of `size` cells for every layer, shared by n_seq_max sequences (one
  unified stream);
- `IswaKVCache`: llama.cpp's iswa cache for interleaved sliding-window attention: a full
  `KVCache` for the global layers and a smaller one for the sliding-window layers, whose
  cells are reused once outside the window (a ring, for one sequence).

Sequence shifts move positions, not rows (llama.cpp's seq_add): the cells record each
position's change, and `shift_graph` re-ropes those cells' K in place through the model's own
rope (llama.cpp's K-shift) before the next evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import kv_types
from ggraph.ir.types import GGMLType, row_size, MIB

from ggraph.graphs.models.batch import UBatch
from ggraph.graphs.models.kv_cells import KVCells

KV_PAD = 256  # llama.cpp pads the attended cells to 256
CACHE_TYPES = kv_types()  # -ctk/-ctv: the types whose record says kv=True


@dataclass
class KVCache:
    size: int
    n_layer: int
    type_k: GGMLType
    type_v: GGMLType
    v_trans: bool
    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    layer_ids: list[int] = field(default_factory=list)  # the model layer of each k/v entry
    n_seq_max: int = 1
    n_swa: int = 0    # > 0: the cells of a sliding window (reused once outside it)
    cells: KVCells = field(init=False)

    def __post_init__(self) -> None:
        self.cells = KVCells(self.size, self.n_seq_max, self.n_swa)

    @classmethod
    def create(cls, ctx: Context, n_layer: int, n_embd_k: int, n_embd_v: int, size: int,
               type_k: GGMLType | str = "f16", type_v: GGMLType | str = "f16",
               flash_attn: bool = False, layer_ids: Sequence[int] | None = None,
               n_seq_max: int = 1, n_swa: int = 0) -> "KVCache":
        """A cache of `size` cells for n_layer layers and n_seq_max sequences; `layer_ids`
        names the model layers they are (default 0..n_layer-1), which the tensor names carry
        (cache_k_l{il}) so placement puts each with its layer; n_swa > 0 makes it a
        sliding-window cache."""
        ids = list(range(n_layer)) if layer_ids is None else list(layer_ids)
        if len(ids) != n_layer:
            raise ValueError(f"{len(ids)} layer ids for a cache of {n_layer} layers")
        tk, tv = cache_type("K", type_k), cache_type("V", type_v)
        if tv.is_quantized and not flash_attn:
            raise ValueError(f"a quantized V cache ({tv}) needs flash attention (--fa): without "
                             f"it V is stored transposed, one value per row, which blocks of 32 "
                             f"values cannot hold")
        for role, t, n in (("K", tk, n_embd_k), ("V", tv, n_embd_v)):
            if n % t.block_size:
                raise ValueError(f"{role} rows of {n} values do not fit {t} blocks of "
                                 f"{t.block_size}")
        c = cls(size, n_layer, tk, tv, v_trans=not flash_attn, layer_ids=ids,
                n_seq_max=n_seq_max, n_swa=n_swa)
        for il in ids:
            k = ctx.new_tensor(tk, (n_embd_k, size), name=f"cache_k_l{il}")
            v = ctx.new_tensor(tv, (size, n_embd_v) if c.v_trans else (n_embd_v, size),
                               name=f"cache_v_l{il}")
            k.buffer = v.buffer = "kv_cache"
            c.k.append(k)
            c.v.append(v)
        return c

    @property
    def bytes_k(self) -> int:
        return sum(t.nbytes for t in self.k)

    @property
    def bytes_v(self) -> int:
        return sum(t.nbytes for t in self.v)

    @property
    def nbytes(self) -> int:
        return self.bytes_k + self.bytes_v

    def summary(self) -> str:
        """llama.cpp's line: `llama_kv_cache: size = 90.00 MiB (4096 cells, 30 layers, 1/1
        seqs), K (f16): 45.00 MiB, V (f16): 45.00 MiB`."""
        return (f"llama_kv_cache: size = {self.nbytes / MIB:7.2f} MiB ({self.size:6d} cells, "
                f"{self.n_layer:3d} layers, {self.seqs_word()} seqs), K ({self.type_k}): "
                f"{self.bytes_k / MIB:7.2f} MiB, V ({self.type_v}): {self.bytes_v / MIB:7.2f} MiB")

    def summary_lines(self) -> list[str]:
        """The memory lines llama.cpp prints for this cache (one for a single cache)."""
        return [self.summary()]

    def layer(self, i: int) -> int:
        """The model layer of k[i] / v[i]."""
        return self.layer_ids[i] if self.layer_ids else i

    def seqs_word(self) -> str:
        """llama.cpp's "n_seq_max/n_stream" (one unified stream here): "4/1"."""
        return f"{self.n_seq_max:2d}/1"   # llama.cpp's "%2u/%u"

    # -- cells and sequences (graphs/models/kv_cells.py) ----------------------------------------
    @property
    def n_used(self) -> int:
        """Tokens of sequence 0 (its last position + 1): the single-sequence view."""
        return self.cells.seq_pos_max(0) + 1

    def n_kv(self) -> int:
        """The cells a graph attends to: the used ones padded to KV_PAD (at least KV_PAD),
        at most the cache (llama_kv_cache::get_n_kv)."""
        return min(self.size, max(KV_PAD, -(-self.cells.used_max_p1 // KV_PAD) * KV_PAD))

    def place(self, ub: UBatch) -> Slots | None:
        """Find and take cells for the ubatch's tokens (None: no room, nothing changed)."""
        cells = self.cells.find_slot(len(ub))
        if cells is None:
            return None
        self.cells.apply(cells, ub.pos, ub.seq_ids)
        return Slots(cells)

    def n_free(self) -> int:
        """Cells not holding any position."""
        return self.size - self.cells.used

    def mask(self, ub: UBatch, n_kv: int) -> np.ndarray:
        return self.cells.mask(ub.pos, ub.seq, n_kv)

    def snapshot(self) -> object:
        return self.cells.snapshot()

    def restore(self, snap: object) -> None:
        self.cells.restore(snap)  # type: ignore[arg-type]

    def clear(self) -> None:
        self.cells.clear()

    def seq_pos_min(self, s: int) -> int:
        return self.cells.seq_pos_min(s)

    def seq_pos_max(self, s: int) -> int:
        return self.cells.seq_pos_max(s)

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        self.cells.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.cells.seq_cp(src, dst, p0, p1)

    def seq_keep(self, s: int) -> None:
        self.cells.seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        self.cells.seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self.cells.seq_div(s, p0, p1, d)

    def check_cut(self, s: int, n: int) -> None:
        """Whether sequence s can be cut back to its first n positions and go on from there
        (a sliding-window cache must still hold the window before n)."""
        if self.n_swa <= 0 or n == 0:
            return
        need = np.arange(max(0, n - self.n_swa + 1), n)
        lost = np.setdiff1d(need, self.cells.seq_positions(s))
        if lost.size:
            raise ValueError(f"cannot cut sequence {s} back to {n} tokens: the "
                             f"sliding-window cache ({self.size} cells) no longer holds "
                             f"positions {lost[0]}..{lost[-1]} of its window")

    def k_shifts(self) -> list["CellMoves"]:
        """The pending K-shift (cells whose positions moved, re-roped in place); cleared by
        `reset_shift` once run."""
        cells, delta = self.cells.shifted()
        return [CellMoves(self, cells, cells, delta)] if cells.size else []

    def reset_shift(self) -> None:
        self.cells.reset_shift()


@dataclass
class Slots:
    """The cells a ubatch's tokens went to: of the cache, and of a sliding-window part."""
    cells: np.ndarray
    swa: np.ndarray | None = None


@dataclass
class CellMoves:
    """One cache's share of a K-shift: the K of cell src[i] re-roped by delta[i] positions
    goes to cell dst[i] (in place when src is dst); V moves only where cells do (all read
    before any is written)."""
    cache: KVCache
    src: np.ndarray
    dst: np.ndarray
    delta: np.ndarray


class RopeShift(Protocol):
    """The model's K-shift for layer `layer`: cached K rows [n_embd_k, m] (f32) rotated by
    the positions `pos` (I32 [m]), as its graph ropes K."""

    def __call__(self, layer: int, rows: Tensor, pos: Tensor) -> Tensor: ...


def shift_graph(ctx: Context, moves: Sequence[CellMoves], rope: RopeShift
                ) -> tuple[Graph, dict[Tensor, np.ndarray]] | None:
    """The graph carrying out `moves` and its input values (None when nothing moves): per
    layer, the moved cells' K gathered as f32, re-roped and scattered to their new cells,
    V gathered and scattered as it is (a transposed V one value per row)."""
    outs: list[Tensor] = []
    values: dict[Tensor, np.ndarray] = {}

    def index(name: str, type: str, cells: np.ndarray) -> Tensor:
        t = ctx.new_tensor(type, (cells.size,), name).set_input()
        values[t] = cells.astype(np.int32 if type == "i32" else np.int64)
        return t

    for mv in moves:
        c, m = mv.cache, mv.src.size
        if not c.k:   # a cache part holding no layer (the global one when every layer slides)
            continue
        src, dst = index("shift_src", "i32", mv.src), index("shift_dst", "i64", mv.dst)
        pos = index("shift_pos", "i32", np.broadcast_to(mv.delta, (m,)))
        for i, k in enumerate(c.k):
            rows = rope(c.layer(i), O.get_rows(k, src, name=f"k_shift_in-{c.layer(i)}"), pos)
            outs.append(O.set_rows(k, rows, dst, name=f"k_shifted-{c.layer(i)}"))
        if np.array_equal(mv.src, mv.dst):   # in place: V stays where it is
            continue
        if c.v_trans and c.v:   # value j of cell x is row j * size + x
            n_v = c.v[0].ne[1]
            chans = np.arange(n_v, dtype=np.int64)[:, None] * c.size
            vsrc = index("shift_vsrc", "i32", (chans + mv.src[None, :]).reshape(-1))
            vdst = index("shift_vdst", "i64", (chans + mv.dst[None, :]).reshape(-1))
        for i, v in enumerate(c.v):
            if c.v_trans:
                flat = O.reshape(v, 1, v.nelements)
                outs.append(O.set_rows(flat, O.get_rows(flat, vsrc), vdst,
                                       name=f"v_shifted-{c.layer(i)}"))
            else:
                outs.append(O.set_rows(v, O.get_rows(v, src), dst,
                                       name=f"v_shifted-{c.layer(i)}"))
    if not outs:
        return None
    graph = Graph(max(2048, 8 * len(outs)))
    for t in outs:
        graph.build_forward_expand(t)
    return graph, values


def check_graph_fits(cache: "KVCache | IswaKVCache", n_kv: int, flash_attn: bool) -> None:
    """A graph over `cache` attends to at most its size in cells, and its attention path must
    match the V layout the cache was created with (transposed V without flash attention)."""
    if n_kv > cache.size:
        raise ValueError(f"n_kv={n_kv} exceeds the KV cache size {cache.size}")
    if flash_attn == cache.v_trans:
        raise ValueError("the KV cache layout does not match the attention path: create the "
                         "cache with the same flash_attn setting")


def cache_type(role: str, t: GGMLType | str) -> GGMLType:
    """The type of the `role` (K or V) cache; one not in CACHE_TYPES is an error."""
    parsed = GGMLType.parse(t)
    if parsed not in CACHE_TYPES:
        raise ValueError(f"{role} cache type {parsed} is not supported; use one of "
                         f"{', '.join(str(x) for x in CACHE_TYPES)}")
    return parsed


def check_head_blocks(head_k: int, head_v: int, type_k: GGMLType | str,
                      type_v: GGMLType | str) -> None:
    """llama.cpp's check when a context is made: attention reads the cache one head at a
    time, so a quantized type's blocks must divide the head size (a row of the whole cache
    fitting whole blocks is not enough)."""
    for role, t, n in (("K", cache_type("K", type_k), head_k),
                       ("V", cache_type("V", type_v), head_v)):
        if t.is_quantized and n % t.block_size:
            raise ValueError(f"{role} cache type {t} with block size {t.block_size} does not "
                             f"divide the head size {n} (llama.cpp refuses it too)")


def kv_cache_bytes(n_layer: int, n_embd_k: int, n_embd_v: int, size: int, type_k: GGMLType,
                   type_v: GGMLType) -> int:
    """The formula: row_size(type, n_embd) * kv_size per layer, K plus V."""
    return n_layer * size * (row_size(type_k, n_embd_k) + row_size(type_v, n_embd_v))


SWA_PAD = 256  # llama.cpp always pads the sliding-window cache to 256 cells


def swa_cache_size(size: int, n_swa: int, n_ubatch: int, swa_full: bool = False,
                   n_seq_max: int = 1) -> int:
    """Cells of the sliding-window cache as llama.cpp sizes it (llama_kv_cache_iswa, one
    unified stream): pad256(min(n_ctx, n_swa * n_seq_max + n_ubatch)), every sequence keeping
    its own window, or the full context with swa_full."""
    if swa_full:
        return size
    n = min(size, n_swa * n_seq_max + n_ubatch)
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
               swa_full: bool = False, n_seq_max: int = 1) -> IswaKVCache:
        """The two caches: is_swa[il] says which holds layer il."""
        if n_swa <= 0:
            raise ValueError(f"an iswa cache needs a sliding window, got n_swa={n_swa}")
        flags = tuple(bool(x) for x in is_swa)
        glob = [il for il, s in enumerate(flags) if not s]
        local = [il for il, s in enumerate(flags) if s]
        base = KVCache.create(ctx, len(glob), n_embd_k, n_embd_v, size, type_k, type_v,
                              flash_attn, layer_ids=glob, n_seq_max=n_seq_max)
        n_swa_cells = swa_cache_size(size, n_swa, n_ubatch, swa_full, n_seq_max)
        swa = KVCache.create(ctx, len(local), n_embd_k, n_embd_v, n_swa_cells, type_k, type_v,
                             flash_attn, layer_ids=local, n_seq_max=n_seq_max, n_swa=n_swa)
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
