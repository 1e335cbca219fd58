"""The KV caches: per-layer K and V tensors of a runtime-chosen type, pre-allocated leafs that
set_rows writes (quantizing on write) and attention reads (dequantizing on read).

Without flash attention V is stored transposed ([kv_size, n_embd_v]: one row per channel) so
that V*softmax is a plain mul_mat; block types cannot hold one value per row, hence a
quantized V cache requires flash attention.

Two caches share one small protocol, so the engine never asks which it holds: `n_used` (the
sequence's length; setting it lower cuts the sequence back), `k` / `v` (every layer's tensors,
indexed by layer), `nbytes`, `summary_lines()` (llama.cpp's memory lines) and `discard(p0, p1)`
(the sequence shift of a full context, below):
- `KVCache`: one cache of `size` cells for every layer (cell = position);
- `IswaKVCache`: llama.cpp's iswa cache for interleaved sliding-window attention: a full
  `KVCache` for the global layers and a smaller one for the sliding-window layers, used as a
  ring (cell = position % size), with the position each ring cell holds.

The sequence shift (llama.cpp's seq_rm(p0, p1) then seq_add(p1, n_used, p0 - p1), which
llama-cli does when the context is full) drops positions p0..p1-1 and moves every later one
down by p1 - p0. A cache here keeps cell = position (modulo the ring's size), so the shift
moves cells: `discard` updates the bookkeeping and returns the CellMoves, and `shift_graph`
builds the graph that carries them out, gathering each moved cell's K and V (get_rows),
re-roping K by the position delta through the model's own rope (llama.cpp's K-shift) and
scattering both to their new cells (set_rows). Moves are cells and deltas, nothing more, so a
cache of several sequences can hand its own to the same graph.
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
    n_used: int = 0  # cells holding tokens (one sequence, positions 0..n_used-1)
    layer_ids: list[int] = field(default_factory=list)  # the model layer of each k/v entry

    @classmethod
    def create(cls, ctx: Context, n_layer: int, n_embd_k: int, n_embd_v: int, size: int,
               type_k: GGMLType | str = "f16", type_v: GGMLType | str = "f16",
               flash_attn: bool = False, layer_ids: Sequence[int] | None = None) -> "KVCache":
        """A cache of `size` cells for n_layer layers; `layer_ids` names the model layers
        they are (default 0..n_layer-1), which the tensor names carry (cache_k_l{il}) so
        placement puts each with its layer."""
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
        c = cls(size, n_layer, tk, tv, v_trans=not flash_attn, layer_ids=ids)
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
                f"{self.n_layer:3d} layers,  1/1 seqs), K ({self.type_k}): "
                f"{self.bytes_k / MIB:7.2f} MiB, V ({self.type_v}): {self.bytes_v / MIB:7.2f} MiB")

    def summary_lines(self) -> list[str]:
        """The memory lines llama.cpp prints for this cache (one for a single cache)."""
        return [self.summary()]

    def layer(self, i: int) -> int:
        """The model layer of k[i] / v[i]."""
        return self.layer_ids[i] if self.layer_ids else i

    def discard(self, p0: int, p1: int) -> list["CellMoves"]:
        """Drop positions p0..p1-1 and shift the later ones down by p1 - p0 (cell =
        position): n_used shrinks now, and the returned moves must be run (shift_graph)
        before the next evaluation."""
        check_discard(p0, p1, self.n_used)
        src = np.arange(p1, self.n_used, dtype=np.int64)
        self.n_used -= p1 - p0
        return [CellMoves(self, src, src - (p1 - p0), p0 - p1)] if src.size else []


@dataclass
class CellMoves:
    """One cache's share of a sequence shift: the K and V of cell src[i] go to cell dst[i]
    (all read before any is written), K re-roped by `delta` positions."""
    cache: KVCache
    src: np.ndarray
    dst: np.ndarray
    delta: int


class RopeShift(Protocol):
    """The model's K-shift for layer `layer`: cached K rows [n_embd_k, m] (f32) rotated by
    the positions `pos` (I32 [m]), as its graph ropes K."""

    def __call__(self, layer: int, rows: Tensor, pos: Tensor) -> Tensor: ...


def check_discard(p0: int, p1: int, n_used: int) -> None:
    if not 0 <= p0 <= p1 <= n_used:
        raise ValueError(f"cannot discard positions {p0}..{p1 - 1} of a sequence of "
                         f"{n_used} tokens")


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
        pos = index("shift_pos", "i32", np.full(m, mv.delta))
        for i, k in enumerate(c.k):
            rows = rope(c.layer(i), O.get_rows(k, src, name=f"k_shift_in-{c.layer(i)}"), pos)
            outs.append(O.set_rows(k, rows, dst, name=f"k_shifted-{c.layer(i)}"))
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


def swa_cache_size(size: int, n_swa: int, n_ubatch: int, swa_full: bool = False) -> int:
    """Cells of the sliding-window cache as llama.cpp sizes it (llama_kv_cache_iswa):
    pad256(min(n_ctx, n_swa + n_ubatch)), or the full context with swa_full."""
    if swa_full:
        return size
    n = min(size, n_swa + n_ubatch)
    return -(-n // SWA_PAD) * SWA_PAD


@dataclass
class IswaKVCache:
    """llama.cpp's iswa cache for one sequence: `base` (n_ctx cells, cell = position) holds the
    global layers, `swa` the sliding-window layers in a ring (cell = position % swa.size).

    A ring cell is overwritten only by a position at least swa.size later, and a query at
    position q reads positions above q - n_swa, so the ring never loses a position a query of
    the same or a later ubatch reads while swa.size >= n_swa + n_ubatch (checked by
    `check_ubatch`). `cell_pos` is the position each ring cell holds (-1: empty), as
    llama.cpp's cells record theirs; the sliding-window mask is built from it.
    """
    base: KVCache
    swa: KVCache
    n_swa: int
    is_swa: tuple[bool, ...]
    cell_pos: np.ndarray
    _n_used: int = 0

    @classmethod
    def create(cls, ctx: Context, is_swa: Sequence[bool], n_embd_k: int, n_embd_v: int,
               size: int, n_swa: int, n_ubatch: int, type_k: GGMLType | str = "f16",
               type_v: GGMLType | str = "f16", flash_attn: bool = False,
               swa_full: bool = False) -> IswaKVCache:
        """The two caches: is_swa[il] says which holds layer il."""
        if n_swa <= 0:
            raise ValueError(f"an iswa cache needs a sliding window, got n_swa={n_swa}")
        flags = tuple(bool(x) for x in is_swa)
        glob = [il for il, s in enumerate(flags) if not s]
        local = [il for il, s in enumerate(flags) if s]
        base = KVCache.create(ctx, len(glob), n_embd_k, n_embd_v, size, type_k, type_v,
                              flash_attn, layer_ids=glob)
        n_swa_cells = swa_cache_size(size, n_swa, n_ubatch, swa_full)
        swa = KVCache.create(ctx, len(local), n_embd_k, n_embd_v, n_swa_cells, type_k, type_v,
                             flash_attn, layer_ids=local)
        c = cls(base, swa, n_swa, flags, np.full(n_swa_cells, -1, np.int64))
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

    @property
    def n_used(self) -> int:
        """Tokens in the sequence (positions 0..n_used-1)."""
        return self._n_used

    @n_used.setter
    def n_used(self, n: int) -> None:
        """Append positions n_used..n-1, or cut the sequence back to n tokens (which needs
        the ring to still hold the window before position n)."""
        n = int(n)
        if n >= self._n_used:
            self.cell_pos = self.ring_after(self._n_used, n - self._n_used)
        else:
            need = np.arange(max(0, n - self.n_swa + 1), n)
            lost = need[self.cell_pos[need % self.swa.size] != need]
            if lost.size:
                raise ValueError(f"cannot cut the sequence back to {n} tokens: the "
                                 f"sliding-window cache ({self.swa.size} cells) no longer holds "
                                 f"positions {lost[0]}..{lost[-1]} of its window")
            self.cell_pos = np.where(self.cell_pos >= n, -1, self.cell_pos)
        self._n_used = n
        self.base.n_used = self.swa.n_used = n

    def discard(self, p0: int, p1: int) -> list[CellMoves]:
        """The sequence shift on both caches: the global one moves cells as positions move;
        in the ring a position p >= p1 moves from cell p % size to (p - d) % size, where the
        newest position wins a cell (as writing it would) and positions below p0 stay."""
        check_discard(p0, p1, self._n_used)
        d = p1 - p0
        moves = self.base.discard(p0, p1)
        pos, size = self.cell_pos, self.swa.size
        new_pos = np.where((pos >= 0) & (pos < p0), pos, -1)
        cells = np.nonzero(pos >= p1)[0]
        new_p = pos[cells] - d
        order = np.argsort(new_p, kind="stable")  # ascending: the newest is written last
        new_pos[new_p[order] % size] = new_p[order]
        won = new_pos[new_p % size] == new_p
        self.cell_pos = new_pos
        self._n_used -= d
        self.swa.n_used = self._n_used
        if won.any():
            moves.append(CellMoves(self.swa, cells[won], new_p[won] % size, -d))
        return moves

    # -- cells and masks of a ubatch ---------------------------------------------------------------
    def ring_after(self, n_past: int, n: int) -> np.ndarray:
        """cell_pos once positions n_past..n_past+n-1 are written (cell = position % size)."""
        # only the last `size` positions survive; each cell is then written once
        pos = np.arange(max(n_past, n_past + n - self.swa.size), n_past + n, dtype=np.int64)
        out = self.cell_pos.copy()
        out[pos % self.swa.size] = pos
        return out

    def swa_n_kv(self, n_kv: int) -> int:
        """The ring cells a graph attending to the first n_kv global cells reads: the ring's
        used cells lie below min(n_kv, size) when n_kv covers the sequence."""
        return min(self.swa.size, n_kv)

    def swa_cells_and_mask(self, n_past: int, n: int, n_kv_swa: int
                           ) -> tuple[np.ndarray, np.ndarray]:
        """The ring cells the ubatch writes and its mask over the first n_kv_swa cells: a
        query at position q sees a cell holding position p when 0 <= p <= q and q - p < n_swa
        (llama_hparams::is_masked_swa, standard type); empty cells are masked."""
        pos = np.arange(n_past, n_past + n, dtype=np.int64)
        p0 = self.ring_after(n_past, n)[:n_kv_swa][None, :]
        q = pos[:, None]
        seen = (p0 >= 0) & (p0 <= q) & (q - p0 < self.n_swa)
        return pos % self.swa.size, np.where(seen, 0.0, -np.inf).astype(np.float32)
