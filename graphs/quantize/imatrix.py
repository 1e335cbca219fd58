"""Collecting an importance matrix: llama-imatrix's statistics, gathered through the eval
callback (backends/observe.py).

Owns `ImatrixCollector` (the callback: which products it watches and how it sums) and
`collect_imatrix` (llama-imatrix's run: the text cut into chunks, each evaluated from an empty
cache, a running perplexity over the second halves). What is summed is llama.cpp's
(tools/imatrix/imatrix.cpp collect_imatrix):

- every mul_mat whose weight is a `blk.*` tensor (and output.weight with `process_output`),
  whose activations are F32 with at least 16 rows (shorter ubatches are skipped, as llama.cpp
  skips them), and every mul_mat_id (a mixture of experts' products);
- dense: per input column j of the weight, sum += x_j² over every activation row, in row order
  in float32, one count per row (a 3-D weight: a row of sums per matrix);
- mul_mat_id: per expert, the rows routed to it (their expert ids come with the product),
  a count per expert.

The callback asks for the products and is handed their inputs (Observer.hand): the activations,
and the expert ids of a mul_mat_id, each once however many products read it (q, k and v share
one). Files: graphs/quantize/imatrix_file.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ggraph.backends.observe import Observer
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType
from ggraph.graphs.eval.perplexity import Chunking, PplStats, token_nll
from ggraph.graphs.models.batch import Batch

from .imatrix_file import ImatrixEntry, ImatrixStats

MIN_ROWS = 16      # llama.cpp: "why are small batches ignored (<16 tokens)?"


def weight_name(w: Tensor) -> str:
    """The weight's name as llama.cpp's filter_tensor_name reads it (the file's tensor name;
    a view of a weight is its owner's)."""
    name = (w.owner.name if w.view_src is not None else w.name) or ""
    if "#" in name:   # ggml's "prefix#name#suffix" form
        name = name.split("#")[1]
    return name


@dataclass
class _Product:
    """A product being watched: its weight and the inputs still to come."""
    node: Tensor
    weight: str
    waiting: dict[Tensor, np.ndarray | None]


@dataclass
class ImatrixCollector:
    """The eval callback of llama-imatrix: `observer` for Session.run / Engine.decode."""
    process_output: bool = False
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    _products: dict[Tensor, _Product] = field(default_factory=dict)
    _readers: dict[Tensor, list[_Product]] = field(default_factory=dict)

    @property
    def observer(self) -> Observer:
        return Observer(self.ask, self.receive, hand=self.hand)

    def ask(self, node: Tensor) -> bool:
        if node in self._products:        # the same graph run again: asked once
            return True
        if node.op not in (OpKind.MUL_MAT, OpKind.MUL_MAT_ID):
            return False
        w, x = node.src[0], node.src[1]
        name = weight_name(w)
        if node.op == OpKind.MUL_MAT:
            if x.ne[1] < MIN_ROWS or x.type != GGMLType.F32:
                return False
            if not (name.startswith("blk.") or (self.process_output and
                                                 name == "output.weight")):
                return False
            inputs = (x,)
        else:
            inputs = (x, node.src[2])
        p = self._products[node] = _Product(node, name, {t: None for t in inputs})
        for t in inputs:
            self._readers.setdefault(t, []).append(p)
        return True

    @staticmethod
    def hand(node: Tensor) -> tuple[Tensor, ...]:
        """What a watched product needs handed: its activations (and expert ids)."""
        return tuple(node.src[1:3]) if node.op == OpKind.MUL_MAT_ID else (node.src[1],)

    def receive(self, t: Tensor, value: np.ndarray) -> bool:
        for p in self._readers.get(t, ()):
            p.waiting[t] = value
            if all(v is not None for v in p.waiting.values()):
                self._add(p)
                for k in p.waiting:
                    p.waiting[k] = None
        return True

    def end_run(self) -> None:
        """Forget the products of the graphs run so far (bounds what is kept between runs of
        different graphs)."""
        self._products.clear()
        self._readers.clear()

    # -- the sums ---------------------------------------------------------------------------
    def _entry(self, p: _Product, size: int, n_counts: int) -> ImatrixEntry:
        e = self.entries.get(p.weight)
        if e is None:
            e = self.entries[p.weight] = ImatrixEntry(np.zeros(size, np.float32),
                                                      np.zeros(n_counts, np.int64))
        if e.sums.size != size:
            raise ValueError(f"imatrix: inconsistent size for {p.weight} ({e.sums.size} vs "
                             f"{size})")
        return e

    def _add(self, p: _Product) -> None:
        w, x = p.node.src[0], p.node.src[1]
        if p.node.op == OpKind.MUL_MAT_ID:
            self._add_experts(p, w, x)
            return
        xv = p.waiting[x]                                  # (ne3, ne2, ne1, ne0) float32
        xv = xv.reshape(x.ne[3], x.ne[2], x.ne[1], x.ne[0])
        n_mat = w.ne[2] * w.ne[3]
        ne0 = x.ne[0]
        e = self._entry(p, ne0 * n_mat, 1)
        if e.counts.size > 1 and (e.counts == e.counts[0]).all():
            e.counts = e.counts[:1].copy()
        for i3 in range(x.ne[3]):
            for i2 in range(x.ne[2]):
                m = (i3 % w.ne[3]) * w.ne[2] + (i2 % w.ne[2])
                acc = e.sums[m * ne0:(m + 1) * ne0]
                acc[:] = _sum_rows(acc, xv[i3, i2])
        if not np.isfinite(e.sums).all():
            raise ValueError(f"imatrix: non-finite values in {p.weight}")
        e.counts += x.ne[1] * x.ne[2] * x.ne[3] // n_mat

    def _add_experts(self, p: _Product, w: Tensor, x: Tensor) -> None:
        ids_t = p.node.src[2]
        xv = p.waiting[x].reshape(x.ne[2], x.ne[1], x.ne[0])    # (tokens, n_b, ne0)
        ids = p.waiting[ids_t].reshape(ids_t.ne[1], ids_t.ne[0]).astype(np.int64)
        n_as, ne0 = w.ne[2], x.ne[0]
        e = self._entry(p, ne0 * n_as, n_as)
        if e.counts.size == 1 and n_as > 1:
            e.counts = np.full(n_as, e.counts[0], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n_as):
            raise ValueError(f"imatrix: an expert id outside 0..{n_as - 1} in {p.weight}")
        # llama.cpp's loop: expert slot outer, token inner, each routed row summed in turn
        for idx in range(ids.shape[1]):
            for row in range(ids.shape[0]):
                ex = int(ids[row, idx])
                acc = e.sums[ex * ne0:(ex + 1) * ne0]
                v = xv[row, idx % x.ne[1]]
                acc += v * v
                e.counts[ex] += 1
        if not np.isfinite(e.sums).all():
            raise ValueError(f"imatrix: non-finite values in {p.weight}")

    def stats(self, datasets: list[str], chunk_size: int) -> ImatrixStats:
        chunks = max((int(e.counts.max()) // chunk_size for e in self.entries.values()
                      if e.counts.size), default=0)
        return ImatrixStats(dict(self.entries), list(datasets), chunks, chunk_size)


def _sum_rows(acc: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """acc + x_0² + x_1² + ... in that order, in float32 (llama.cpp's `acc[j] += x[j]*x[j]`
    row after row): np.add.accumulate is sequential, so each column's rounding is C's."""
    sq = np.multiply(rows, rows, dtype=np.float32)
    return np.add.accumulate(np.vstack([acc[None, :], sq]), axis=0, dtype=np.float32)[-1]


@dataclass
class ChunkReport:
    """After each chunk: its index (0-based), the count, the pass's seconds, the running PPL."""
    index: int
    n_chunk: int
    seconds: float
    ppl: float


def collect_imatrix(engine: Any, tokens: np.ndarray, chunking: Chunking,
                    collector: ImatrixCollector, compute_ppl: bool = True,
                    on_chunk: Callable[[ChunkReport], None] | None = None) -> PplStats:
    """llama-imatrix's compute_imatrix: each chunk from an empty cache with every row's logits
    (so the last layer runs on every token, as there), observed by `collector`; the running
    perplexity of the chunks' second halves."""
    stats = PplStats()
    n_ctx = chunking.n_ctx
    for i in range(chunking.n_chunk):
        t0 = time.perf_counter()
        engine.reset()
        chunk = chunking.chunk(tokens, i)
        pos = np.arange(n_ctx, dtype=np.int32)
        batch = Batch(list(chunk), pos, [(0,)] * n_ctx, np.ones(n_ctx, bool))
        try:
            logits = engine.decode(batch, observe=collector.observer)
        finally:
            collector.end_run()
        if compute_ppl:
            scored = logits[chunking.first:chunking.first + chunking.n_scored]
            stats.add(token_nll(scored, chunking.targets(tokens, i)))
        if on_chunk is not None:
            on_chunk(ChunkReport(i, chunking.n_chunk, time.perf_counter() - t0,
                                 stats.ppl if compute_ppl else float("nan")))
    return stats
