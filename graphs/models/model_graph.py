"""The graph types every architecture shares, and the single-sequence causal batch.

`ModelGraph` is what an architecture's `build` returns and what the engine, `ggraph dot` and
`ggraph plan` consume: the graph of one ubatch, its input leafs, the logits and the sizes it
was built for. `GraphInputs` are the input leafs of a causal language model with a KV cache
(tokens, positions, the KQ mask, the cache cells to write, the output rows), created in one
place in llama.cpp's names. `IswaInputs` add a second set (mask and cells) for the
sliding-window layers of an iswa cache (graphs/models/kv_iswa.py's IswaKVCache).

`ubatch_values` gives their values for a ubatch the cache has placed (any mix of sequences:
the masks come from the cache's cells); `causal_batch` and `iswa_batch` give them, without
a cache's bookkeeping, for tokens of one sequence appended at n_past into cells = positions
(what scripts that build one graph by hand use).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType

from ggraph.graphs.models.batch import UBatch
from ggraph.graphs.models.kv_cache import KVCache, Slots, v_value_rows
from ggraph.graphs.models.kv_iswa import IswaKVCache

InputsT = TypeVar("InputsT")


@dataclass
class GraphInputs:
    """Input leafs of a causal LM over a KV cache. v_idxs is None where there is no V cache
    (MLA keeps V as a view of K)."""
    tokens: Tensor
    pos: Tensor
    kq_mask: Tensor
    k_idxs: Tensor
    v_idxs: Tensor | None
    out_ids: Tensor

    @classmethod
    def create(cls, ctx: Context, n_tokens: int, n_kv: int, n_outputs: int, flash: bool,
               n_v_idxs: int | None = None) -> GraphInputs:
        """The leafs as llama.cpp names them: inp_tokens, inp_pos, kq_mask (F16 for flash
        attention, else F32), k_idxs, v_idxs (n_v_idxs rows; none when None), inp_out_ids."""
        tokens = ctx.new_tensor(GGMLType.I32, (n_tokens,), "inp_tokens").set_input()
        pos = ctx.new_tensor(GGMLType.I32, (n_tokens,), "inp_pos").set_input()
        kq_mask = ctx.new_tensor(GGMLType.F16 if flash else GGMLType.F32, (n_kv, n_tokens),
                                 "kq_mask").set_input()
        k_idxs = ctx.new_tensor(GGMLType.I64, (n_tokens,), "k_idxs").set_input()
        v_idxs = None if n_v_idxs is None else \
            ctx.new_tensor(GGMLType.I64, (n_v_idxs,), "v_idxs").set_input()
        out_ids = ctx.new_tensor(GGMLType.I32, (n_outputs,), "inp_out_ids").set_input()
        return cls(tokens, pos, kq_mask, k_idxs, v_idxs, out_ids)


@dataclass
class KindInputs:
    """One more cache's leafs (the sliding-window layers' of an iswa cache): its KQ mask over
    its own n_kv cells and the cells the ubatch writes, named with a suffix (kq_mask_swa)."""
    kq_mask: Tensor
    k_idxs: Tensor
    v_idxs: Tensor | None

    @classmethod
    def create(cls, ctx: Context, n_tokens: int, n_kv: int, flash: bool,
               n_v_idxs: int | None, suffix: str) -> KindInputs:
        kq_mask = ctx.new_tensor(GGMLType.F16 if flash else GGMLType.F32, (n_kv, n_tokens),
                                 f"kq_mask{suffix}").set_input()
        k_idxs = ctx.new_tensor(GGMLType.I64, (n_tokens,), f"k_idxs{suffix}").set_input()
        v_idxs = None if n_v_idxs is None else \
            ctx.new_tensor(GGMLType.I64, (n_v_idxs,), f"v_idxs{suffix}").set_input()
        return cls(kq_mask, k_idxs, v_idxs)


@dataclass
class IswaInputs(GraphInputs):
    """GraphInputs (the global layers' mask and cells) plus the sliding-window layers' own
    (kq_mask_swa, k_idxs_swa, v_idxs_swa) over the ring's n_kv_swa cells."""
    swa: KindInputs
    n_kv_swa: int


@dataclass
class ModelGraph(Generic[InputsT]):
    """One ubatch's graph: n_tokens tokens attending to n_kv cache cells, n_outputs rows of
    logits. `path` names the attention path where an architecture has several (MLA)."""
    graph: Graph
    inputs: InputsT
    logits: Tensor
    n_tokens: int
    n_kv: int
    n_outputs: int
    path: str | None = None


def causal_inputs(mg: ModelGraph[Any], n: int, n_past: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions n_past.. and the causal mask over the graph's n_kv cells for n new tokens of
    one sequence (every architecture with a single-sequence KV cache uses these)."""
    if n != mg.n_tokens:
        raise ValueError(f"the graph was built for {mg.n_tokens} tokens, got {n}")
    if n_past + n > mg.n_kv:
        raise ValueError(f"{n_past + n} tokens do not fit the graph's n_kv={mg.n_kv}")
    pos = np.arange(n_past, n_past + n, dtype=np.int32)
    mask = np.full((n, mg.n_kv), -np.inf, np.float32)
    for i in range(n):
        mask[i, : n_past + i + 1] = 0.0
    return pos, mask


def causal_batch(mg: ModelGraph[GraphInputs], cache: KVCache, tokens: np.ndarray, n_past: int,
                 out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
    """Input values for tokens at positions n_past.. written into cells n_past.. (with a
    transposed V cache, cache.v_trans, every value of a token is its own V row)."""
    pos, mask = causal_inputs(mg, len(tokens), n_past)
    cells = pos.astype(np.int64)
    inp = mg.inputs
    values = {inp.tokens: np.asarray(tokens, np.int32), inp.pos: pos}
    values.update(cell_values(cache, inp.kq_mask, mask, inp.k_idxs, inp.v_idxs, cells))
    values[inp.out_ids] = np.asarray(out_rows, np.int32)
    return values


def cell_values(cache: KVCache, kq_mask: Tensor, mask: np.ndarray, k_idxs: Tensor,
                v_idxs: Tensor | None, cells: np.ndarray) -> dict[Tensor, np.ndarray]:
    """One cache's mask and the rows its K and V stores write for tokens going to `cells`
    (with a transposed V cache, cache.v_trans, every value of a token is its own V row)."""
    values = {kq_mask: mask, k_idxs: cells}
    if v_idxs is not None:
        if cache.v_trans:  # (from the index count: a cache may hold no layer, as the global
            #                  one of a model whose every layer slides)
            n_embd_v = v_idxs.ne[0] // max(len(cells), 1)
            values[v_idxs] = v_value_rows(cache.size, cells, n_embd_v)
        else:
            values[v_idxs] = np.asarray(cells, np.int64)
    return values


def iswa_batch(mg: ModelGraph[IswaInputs], cache: IswaKVCache, tokens: np.ndarray,
               n_past: int, out_rows: np.ndarray) -> dict[Tensor, np.ndarray]:
    """causal_batch for an iswa cache: the global layers' cells and causal mask, and the
    sliding-window layers' ring cells and window mask (IswaKVCache.swa_cells_and_mask)."""
    values = causal_batch(mg, cache.base, tokens, n_past, out_rows)
    inp = mg.inputs
    if cache.base.n_layer == 0:   # every layer slides: no graph reads the global mask or cells
        for t in (inp.kq_mask, inp.k_idxs, inp.v_idxs):
            values.pop(t, None)   # type: ignore[arg-type]
    n = len(tokens)
    cells = np.arange(n_past, n_past + n, dtype=np.int64) % cache.swa.size
    q = np.arange(n_past, n_past + n, dtype=np.int64)[:, None]
    p0 = np.arange(inp.n_kv_swa, dtype=np.int64)[None, :]
    p0 = p0 + ((q.max() - p0) // cache.swa.size) * cache.swa.size   # the ring's positions
    seen = (p0 >= 0) & (p0 <= q) & (q - p0 < cache.n_swa)
    mask = np.where(seen, 0.0, -np.inf).astype(np.float32)
    values.update(cell_values(cache.swa, inp.swa.kq_mask, mask, inp.swa.k_idxs,
                              inp.swa.v_idxs, cells))
    return values


def ubatch_values(mg: ModelGraph[Any], cache: KVCache | IswaKVCache, ub: UBatch,
                  slots: Slots) -> dict[Tensor, np.ndarray]:
    """Input values of a ubatch the cache has placed (`slots`: cache.place(ub)): tokens,
    positions, the rows to output, and per cache its cells and the mask its cells give."""
    if len(ub) != mg.n_tokens:
        raise ValueError(f"the graph was built for {mg.n_tokens} tokens, got {len(ub)}")
    inp = mg.inputs
    rows = ub.out_rows if ub.out.any() else np.array([len(ub) - 1], np.int32)
    values: dict[Tensor, np.ndarray] = {inp.tokens: ub.tokens, inp.pos: ub.pos,
                                        inp.out_ids: rows.astype(np.int32)}
    base = cache.base if isinstance(cache, IswaKVCache) else cache
    if base.n_layer:   # (an iswa cache whose every layer slides: no graph reads these)
        values.update(cell_values(base, inp.kq_mask, base.mask(ub, mg.n_kv), inp.k_idxs,
                                  inp.v_idxs, slots.cells))
    if isinstance(cache, IswaKVCache):
        assert isinstance(inp, IswaInputs) and slots.swa is not None
        values.update(cell_values(cache.swa, inp.swa.kq_mask, cache.swa.mask(ub, inp.n_kv_swa),
                                  inp.swa.k_idxs, inp.swa.v_idxs, slots.swa))
    return values
