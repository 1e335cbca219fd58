"""The KV caches: per-layer K and V tensors of a runtime-chosen type, pre-allocated leafs that
set_rows writes (quantizing on write) and attention reads (dequantizing on read), and the
cells that say what each row holds (graphs/models/kv_cells.py: position and sequences).

Without flash attention V is stored transposed ([kv_size, n_embd_v]: one row per channel) so
that V*softmax is a plain mul_mat; block types cannot hold one value per row, hence a
quantized V cache requires flash attention.

`KVCache` holds `size` cells per stream for every layer: one stream that n_seq_max sequences
share (llama.cpp's --kv-unified), or a stream per sequence, each its own region of every
layer's tensors. Its protocol, which graphs/models/kv_iswa.py's IswaKVCache also keeps, so
the engine never asks which cache it holds: `split(batch)` cuts a batch into ubatches as
llama.cpp does for the layout, `place(ubatch)` finds and takes cells for a ubatch (Slots),
`streams_of(ubatch)` the streams its graph attends in, `n_kv()` the cells a graph attends to,
the sequence operations (seq_rm, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min/max),
`k_shifts()` the pending K-shift, `stream_copies()` the pending copies of whole streams (seq_cp
across streams), `snapshot()/restore()`, `k` / `v` (every layer's tensors), `nbytes` and
`summary_lines()` (llama.cpp's memory lines).

Sequence shifts move positions, not rows (llama.cpp's seq_add): the cells record each
position's change, and `shift_graph` re-ropes those cells' K in place through the model's own
rope (llama.cpp's K-shift) before the next evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import kv_types
from ggraph.ir.types import GGMLType, row_size, MIB

from ggraph.graphs.models.batch import UBatch, split_equal, split_simple
from ggraph.graphs.models.kv_cells import KVCells, pos_range

KV_PAD = 256  # llama.cpp pads the attended cells to 256
CACHE_TYPES = kv_types()  # -ctk/-ctv: the types whose record says kv=True


@dataclass(frozen=True)
class StreamRange:
    """The streams a ubatch attends in: `count` consecutive streams from `first`, each with
    an equal share of the ubatch's tokens, in stream order (llama.cpp's slot_info s0..s1).
    A unified cache has one stream, so every ubatch is UNIFIED."""
    first: int = 0
    count: int = 1


UNIFIED = StreamRange()


def n_streams(n_seq_max: int, unified: bool) -> int:
    """Streams of a cache: one unified, or one per sequence (llama.cpp's n_stream)."""
    return 1 if unified else n_seq_max


def stream_size(n_ctx: int, n_seq_max: int, unified: bool) -> int:
    """Cells per stream: the context for one unified stream; for a stream per sequence
    llama.cpp's n_ctx_seq, pad256(pad256(n_ctx) / n_seq_max) (llama_context's constructor)."""
    if n_streams(n_seq_max, unified) == 1:
        return n_ctx
    return -(-(-(-n_ctx // KV_PAD) * KV_PAD // n_seq_max) // KV_PAD) * KV_PAD


def worst_ubatch(n_ctx: int, n_ubatch: int, n_stream: int) -> tuple[int, StreamRange]:
    """The worst-case ubatch llama.cpp reserves: min(n_ctx, n_ubatch) tokens, in equal
    shares of every stream when there is a stream per sequence (ubatch_reserve)."""
    n = min(n_ctx, n_ubatch)
    if n_stream == 1:
        return n, UNIFIED
    n_tps = max(1, n // n_stream)
    return n_tps * n_stream, StreamRange(0, n_stream)


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
    n_stream: int = 1  # 1: unified; n_seq_max: a region of `size` cells per sequence
    streams: list[KVCells] = field(init=False)
    # seq_cp across streams: (source, destination) streams whose rows are copied whole at
    # the next decode, before the K-shift (llama.cpp's sc_info)
    copies: list[tuple[int, int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.n_stream not in (1, self.n_seq_max):
            raise ValueError(f"a cache has one stream or one per sequence, got "
                             f"{self.n_stream} for {self.n_seq_max} sequences")
        self.streams = [KVCells(self.size, self.n_seq_max, self.n_swa)
                        for _ in range(self.n_stream)]

    @classmethod
    def create(cls, ctx: Context, n_layer: int, n_embd_k: int, n_embd_v: int, size: int,
               type_k: GGMLType | str = "f16", type_v: GGMLType | str = "f16",
               flash_attn: bool = False, layer_ids: Sequence[int] | None = None,
               n_seq_max: int = 1, n_swa: int = 0, unified: bool = True) -> "KVCache":
        """A cache of `size` cells for n_layer layers and n_seq_max sequences (unified: one
        stream of `size` cells that every sequence shares; otherwise a stream of `size` cells
        per sequence, llama.cpp without --kv-unified); `layer_ids` names the model layers they
        are (default 0..n_layer-1), which the tensor names carry (cache_k_l{il}) so placement
        puts each with its layer; n_swa > 0 makes it a sliding-window cache.

        Streams lie one after another in each layer's tensors (K [n_embd_k, size * n_stream],
        a transposed V [size, n_embd_v * n_stream]: llama.cpp's [.., size, n_stream] bytes),
        so a cell's row is stream * size + cell."""
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
        ns = n_streams(n_seq_max, unified)
        c = cls(size, n_layer, tk, tv, v_trans=not flash_attn, layer_ids=ids,
                n_seq_max=n_seq_max, n_swa=n_swa, n_stream=ns)
        for il in ids:
            k = ctx.new_tensor(tk, (n_embd_k, size * ns), name=f"cache_k_l{il}")
            v = ctx.new_tensor(tv, (size, n_embd_v * ns) if c.v_trans else
                               (n_embd_v, size * ns), name=f"cache_v_l{il}")
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
        seqs), K (f16): 45.00 MiB, V (f16): 45.00 MiB` (cells of one stream)."""
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
        """llama.cpp's "n_seq_max/n_stream": "4/1" unified, "4/4" a stream each."""
        return f"{self.n_seq_max:2d}/{self.n_stream}"   # llama.cpp's "%2u/%u"

    # -- cells and sequences (graphs/models/kv_cells.py) ----------------------------------------
    @property
    def cells(self) -> KVCells:
        """The cells of sequence 0's stream (a unified cache's only one)."""
        return self.streams[0]

    def stream(self, s: int) -> KVCells:
        """The cells sequence s lives in (its own stream unless unified)."""
        return self.streams[self.streams[0].check_seq(s) if self.n_stream > 1 else 0]

    @property
    def n_used(self) -> int:
        """Tokens of sequence 0 (its last position + 1): the single-sequence view."""
        return self.cells.seq_pos_max(0) + 1

    def n_kv(self) -> int:
        """The cells a graph attends to in each stream: the used ones padded to KV_PAD (at
        least KV_PAD), at most the stream, the largest over streams (llama_kv_cache::get_n_kv)."""
        used = max(c.used_max_p1 for c in self.streams)
        return min(self.size, max(KV_PAD, -(-used // KV_PAD) * KV_PAD))

    def streams_of(self, ub: UBatch) -> StreamRange:
        """The streams a ubatch that `split` made attends in."""
        if self.n_stream == 1:
            return UNIFIED
        seqs = np.unique(ub.seq)
        return StreamRange(int(seqs[0]), int(seqs.size))

    def split(self, ub: UBatch, n_ubatch: int) -> list[UBatch]:
        """The ubatches of a prepared batch: n_ubatch tokens at a time in order for one
        stream (split_simple), equal shares of consecutive sequences for a stream each
        (split_equal), as llama.cpp splits for its cache."""
        return split_simple(ub, n_ubatch) if self.n_stream == 1 else split_equal(ub, n_ubatch)

    def place(self, ub: UBatch) -> Slots | None:
        """Find and take cells for the ubatch's tokens (None: no room, nothing changed); the
        slots are rows of the layers' tensors (stream * size + cell)."""
        if self.n_stream == 1:
            cells = self.cells.find_slot(len(ub))
            if cells is None:
                return None
            self.cells.apply(cells, ub.pos, ub.seq_ids)
            return Slots(cells)
        found = []
        for s, (a, b) in stream_parts(ub):
            cells = self.streams[s].find_slot(b - a)
            if cells is None:
                return None
            found.append((s, a, b, cells))
        for s, a, b, cells in found:   # every stream has room: take them
            self.streams[s].apply(cells, ub.pos[a:b], ub.seq_ids[a:b])
        return Slots(np.concatenate([s * self.size + c for s, _, _, c in found]))

    def n_free(self) -> int:
        """Cells not holding any position (in every stream)."""
        return sum(self.size - c.used for c in self.streams)

    def mask(self, ub: UBatch, n_kv: int) -> np.ndarray:
        """[n_tokens, n_kv]: each token's row over its stream's first n_kv cells (the
        graph's [n_kv, n_tokens / n_stream, 1, n_stream] mask, llama.cpp's layout)."""
        if self.n_stream == 1:
            return self.cells.mask(ub.pos, ub.seq, n_kv)
        return np.concatenate([self.streams[s].mask(ub.pos[a:b], ub.seq[a:b], n_kv)
                               for s, (a, b) in stream_parts(ub)])

    def snapshot(self) -> object:
        return [c.snapshot() for c in self.streams], list(self.copies)

    def restore(self, snap: object) -> None:
        cells, copies = snap  # type: ignore[misc]
        for c, s in zip(self.streams, cells):
            c.restore(s)
        self.copies = list(copies)

    def clear(self) -> None:
        for c in self.streams:
            c.clear()
        self.copies = []

    def seq_pos_min(self, s: int) -> int:
        return self.stream(s).seq_pos_min(s)

    def seq_pos_max(self, s: int) -> int:
        return self.stream(s).seq_pos_max(s)

    def seq_rm(self, s: int, p0: int = -1, p1: int = -1) -> None:
        for c in (self.streams if s < 0 else [self.stream(s)]):
            c.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """dst shares src's cells in one stream; across streams (one per sequence) dst's
        stream becomes a copy of src's, rows and all, at the next decode (whole sequences
        only, as llama.cpp)."""
        a, b = self.stream(src), self.stream(dst)
        if a is b:
            a.seq_cp(src, dst, p0, p1)
            return
        lo, hi = pos_range(p0, p1)
        if lo > 0 or hi < self.size - 1:
            raise ValueError(f"seq_cp({src}, {dst}, {p0}, {p1}): with a stream per sequence "
                             f"(not --kv-unified) a copy takes the whole sequence (p0 = p1 = "
                             f"-1), as llama.cpp")
        b.take_seq(a, src, dst)
        self.copies.append((src, dst))

    def seq_keep(self, s: int) -> None:
        self.stream(s).seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, delta: int) -> None:
        self.stream(s).seq_add(s, p0, p1, delta)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self.stream(s).seq_div(s, p0, p1, d)

    def check_cut(self, s: int, n: int) -> None:
        """Whether sequence s can be cut back to its first n positions and go on from there
        (a sliding-window cache must still hold the window before n)."""
        if self.n_swa <= 0 or n == 0:
            return
        need = np.arange(max(0, n - self.n_swa + 1), n)
        lost = np.setdiff1d(need, self.stream(s).seq_positions(s))
        if lost.size:
            raise ValueError(f"cannot cut sequence {s} back to {n} tokens: the "
                             f"sliding-window cache ({self.size} cells) no longer holds "
                             f"positions {lost[0]}..{lost[-1]} of its window")

    def k_shifts(self) -> list["CellMoves"]:
        """The pending K-shift (cells whose positions moved, re-roped in place), as rows of
        the layers' tensors; cleared by `reset_shift` once run."""
        if not any(c.shift.any() for c in self.streams):   # every decode step asks
            return []
        rows, deltas = [], []
        for s, c in enumerate(self.streams):
            cells, delta = c.shifted()
            rows.append(s * self.size + cells)
            deltas.append(delta)
        moved = np.concatenate(rows)
        return [CellMoves(self, moved, moved, np.concatenate(deltas))] if moved.size else []

    def reset_shift(self) -> None:
        for c in self.streams:
            c.reset_shift()

    def stream_copies(self) -> list["StreamCopy"]:
        """Pending whole-stream copies, oldest first; cleared by `reset_copies` once run."""
        return [StreamCopy(self, a, b) for a, b in self.copies]

    def stream_rows(self, t: Tensor, s: int) -> Tensor:
        """The view of stream s's rows in t, one of this cache's K or V tensors."""
        if self.v_trans and any(t is v for v in self.v):   # [size, n_embd_v * n_stream]
            n_v = t.ne[1] // self.n_stream
            return O.view_2d(t, self.size, n_v, t.nb[1], s * n_v * t.nb[1])
        return O.view_2d(t, t.ne[0], self.size, t.nb[1], s * self.size * t.nb[1])

    def reset_copies(self) -> None:
        self.copies = []


def stream_parts(ub: UBatch) -> list[tuple[int, tuple[int, int]]]:
    """(stream, (first, end)) of each sequence's run of tokens in a ubatch split for a stream
    per sequence (split_equal: consecutive runs, one sequence each)."""
    seq = ub.seq
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    ends = np.r_[starts[1:], seq.size]
    return [(int(seq[a]), (int(a), int(b))) for a, b in zip(starts, ends)]


@dataclass
class Slots:
    """The cells a ubatch's tokens went to: of the cache, and of a sliding-window part."""
    cells: np.ndarray
    swa: np.ndarray | None = None


@dataclass
class StreamCopy:
    """One cache's pending copy of stream src's rows, every layer's K and V, over stream
    dst's (seq_cp across streams)."""
    cache: KVCache
    src: int
    dst: int


def copy_graph(copies: Sequence[StreamCopy]) -> Graph | None:
    """The graph carrying out `copies` in order (byte copies of each layer's rows; None
    when there are none), run before the K-shift as llama.cpp's update runs them."""
    outs = [O.cpy(c.cache.stream_rows(t, c.src), c.cache.stream_rows(t, c.dst),
                  name=f"stream_copy-{c.src}-{c.dst}")
            for c in copies for t in c.cache.k + c.cache.v]
    if not outs:
        return None
    graph = Graph(max(2048, 2 * len(outs)))
    for t in outs:
        graph.build_forward_expand(t)
    return graph


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
        if c.v_trans and c.v:   # every value of a cell is its own row
            n_v = c.v[0].ne[1] // c.n_stream
            vsrc = index("shift_vsrc", "i32", v_value_rows(c.size, mv.src, n_v))
            vdst = index("shift_vdst", "i64", v_value_rows(c.size, mv.dst, n_v))
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


def v_value_rows(size: int, rows: np.ndarray, n_embd_v: int) -> np.ndarray:
    """The rows of a transposed V cache ([size, n_embd_v] per stream, one value per row)
    holding the values of cache rows `rows` (stream * size + cell), cell by cell: value j of
    cell x of stream s is row (s * n_embd_v + j) * size + x."""
    rows = np.asarray(rows, np.int64)
    s, x = rows // size, rows % size
    j = np.arange(n_embd_v, dtype=np.int64)[None, :]
    return ((s[:, None] * n_embd_v + j) * size + x[:, None]).reshape(-1)


def check_graph_fits(cache: Any, n_kv: int, flash_attn: bool) -> None:
    """A graph over `cache` (a KVCache, or one with its protocol: graphs/models/kv_iswa.py)
    attends to at most its size in cells (of a stream), and its attention path must
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
