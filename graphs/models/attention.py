"""Attention blocks as llama.cpp builds them, with split attention (-amb) over head groups.

`build_attention` turns Q (already roped) and a layer's K/V cache into the attention output
[head_dim*n_head, n_tokens] by one of two paths:
- mul_mat(K, Q) -> soft_max_ext (in place on K*Q) -> mul_mat(V, softmax), V stored transposed;
- flash_attn_ext on K/V views (V not transposed).
With `amb_mib > 0` and a K*Q tensor above the cap, the first path runs over groups of heads
(facts page section 6), each group a whole number of query heads per K/V head (GQA), keeping
each head's ALiBi slope, and writes each group's result into its slice of one output buffer
(no concat chain, so no O(n_head^2) copies). That join, `HeadJoin`, serves MLA's head groups
too (graphs/models/mla.py).

With a KV cache stream per sequence (llama.cpp without --kv-unified) a ubatch's tokens come
in equal shares of `streams.count` consecutive streams, and attention runs per stream as
llama.cpp's does: q [hd, n_tokens/ns, n_head, ns], K/V views [.., n_kv, n_head_kv, ns] one
stream apart, the mask [n_kv, n_tokens/ns, 1, ns]; so each sequence reads its own cells only. `store_kv` writes a layer's new K/V into its cache (set_rows) and gives
the views attention reads through the stores.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, MIB

from ggraph.graphs.models.kv_cache import UNIFIED, KVCache, StreamRange

F32 = 4


@dataclass(frozen=True)
class AttentionShape:
    head_dim: int
    n_head: int
    n_head_kv: int
    n_tokens: int
    n_kv: int
    streams: StreamRange = UNIFIED   # the streams the tokens attend in, n_tokens / count each
    cache_streams: int = 1           # the streams the cache tensors hold

    @property
    def n_stream(self) -> int:
        return self.streams.count

    @property
    def kq_bytes(self) -> int:
        return self.n_kv * self.n_tokens * self.n_head * 4


def kq_size_mib(n_kv: int, n_tokens: int, n_head: int) -> int:
    """Size of the K*Q tensor in MiB, floored (ik_llama.cpp's measure)."""
    return n_kv * n_tokens * n_head * 4 // MIB


def split_heads(n_head: int, n_head_kv: int, n_kv: int, n_tokens: int,
                amb_mib: int) -> list[tuple[int, int]]:
    """Head groups [(first, count), ...] whose K*Q tensors each fit in `amb_mib` MiB.

    n_step = ceil(kq_size / amb) as the facts page defines it, so a group holds at most
    ceil(n_head / n_step) heads. Groups never straddle a K/V head (GQA): when a group is at
    least one K/V group it is a whole number of K/V groups, otherwise each K/V group's query
    heads are cut into pieces of that size. One group when the cap is off or not exceeded.
    """
    if n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_head_kv={n_head_kv}")
    kq = kq_size_mib(n_kv, n_tokens, n_head)
    if amb_mib <= 0 or kq <= amb_mib:
        return [(0, n_head)]
    gqa = n_head // n_head_kv
    # the facts page's rule (ik_llama.cpp's): step count from the floored MiB size, so a
    # group may pass the cap by less than one head (DeepSeek-R1: 7 heads, 2125 MiB at 2048)
    per_step = -(-n_head // -(-kq // amb_mib))
    if per_step >= gqa:
        per_step -= per_step % gqa
        return [(h, min(per_step, n_head - h)) for h in range(0, n_head, per_step)]
    return [(g + h, min(per_step, gqa - h)) for g in range(0, n_head, gqa)
            for h in range(0, gqa, per_step)]


def store_kv(cache: KVCache, i: int, k: Tensor, v: Tensor, k_idxs: Tensor,
             v_idxs: Tensor | None) -> tuple[Tensor, Tensor]:
    """Write k [n_embd_k, n_tokens] and v [n_embd_v, n_tokens] into layer i of `cache` (rows
    k_idxs; v_idxs are every value's row of a transposed V cache) and return the K and V
    cache tensors to attend to: the stores themselves (views of the cache), so every order the
    allocator may choose writes the new K/V before attention reads them."""
    if v_idxs is None:
        raise ValueError("store_kv: a cache with V rows needs v_idxs")
    k_store = O.set_rows(cache.k[i], k, k_idxs)
    if not cache.v_trans:
        return k_store, O.set_rows(cache.v[i], v, v_idxs)
    v_view = O.reshape(cache.v[i], 1, cache.v[i].nelements)
    v_store = O.set_rows(v_view, O.reshape(v, 1, v.nelements), v_idxs)
    return k_store, O.view_2d(v_store, cache.v[i].ne[0], cache.v[i].ne[1], cache.v[i].nb[1], 0)


def build_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kq_mask: Tensor, *,
                    shape: AttentionShape, kq_scale: float, max_bias: float = 0.0,
                    flash: bool = False, amb_mib: int = 0, il: int = 0,
                    v_trans: bool | None = None, graph: Graph | None = None) -> Tensor:
    """Attention output [head_dim*n_head, n_tokens] for one layer.

    q: [head_dim, n_head, n_tokens] F32. k_cache: [head_dim*n_head_kv, >= n_kv] of the cache
    type. v_cache: the same, or transposed [>= n_kv, head_dim*n_head_kv] (v_trans, the
    default without flash attention). kq_mask: [n_kv, >= n_tokens] F16/F32.
    graph: when given, each split-attention step is expanded into it as it is built (as
    llama.cpp does), so steps run first to last and each group's result is copied out and freed
    before the next group starts; without it the post-order would compute the groups last to
    first and hold every group's result until the end.
    """
    s = shape
    v_trans = (not flash) if v_trans is None else v_trans
    ns, n_tps = s.n_stream, s.n_tokens // s.n_stream
    if ns * n_tps != s.n_tokens:
        raise ValueError(f"layer {il}: {s.n_tokens} tokens do not split into {ns} streams")
    k = cache_streams_view(k_cache, s.head_dim, s.n_head_kv, s.n_kv, _row(k_cache, s.head_dim),
                           k_cache.nb[1], s.streams, s.cache_streams, f"k-{il}")
    k = O.permute(k, 0, 2, 1, 3)                                # [hd, n_kv, n_head_kv, ns]
    if v_trans:  # v_cache is [kv_size, head_dim*n_head_kv]: one row per V channel
        v = cache_streams_view(v_cache, s.n_kv, s.head_dim, s.n_head_kv, v_cache.nb[1],
                               v_cache.nb[1] * s.head_dim, s.streams, s.cache_streams,
                               f"v-{il}")                      # [n_kv, hd, n_head_kv, ns]
    else:
        v = cache_streams_view(v_cache, s.head_dim, s.n_head_kv, s.n_kv,
                               _row(v_cache, s.head_dim), v_cache.nb[1], s.streams,
                               s.cache_streams, f"v-{il}")
        v = O.permute(v, 0, 2, 1, 3)                            # [hd, n_kv, n_head_kv, ns]
    kq_mask = stream_mask(kq_mask, ns)
    qp = O.permute(stream_tokens(q, ns), 0, 2, 1, 3)           # [hd, n_tps, n_head, ns]
    if flash:
        out = O.flash_attn_ext(qp, k, v, kq_mask, scale=kq_scale, max_bias=max_bias,
                               name=f"fattn-{il}")             # [hd, n_head, n_tps, ns]
        return O.reshape(out, s.head_dim * s.n_head, s.n_tokens, name=f"kqv_out-{il}")

    groups = split_heads(s.n_head, s.n_head_kv, s.n_kv, s.n_tokens, amb_mib)
    if len(groups) == 1:
        kqv = _attend(qp, k, v, kq_mask, kq_scale, max_bias, 0, s.n_head, il, "")
        cur = O.permute(kqv, 0, 2, 1, 3)                        # [hd, n_head, n_tps, ns]
        return O.cont(cur, s.head_dim * s.n_head, s.n_tokens, name=f"kqv_out-{il}")

    # Split attention: each group's [hd, n_tps, heads, ns] result is copied into its heads of
    # one [hd, n_head, n_tokens] buffer, a fill of q's shape (an O(n_embd) pass; cpy goes in
    # element order, and tokens come stream after stream on both sides)
    gqa = s.n_head // s.n_head_kv
    join = HeadJoin.fill(q, il)
    for step, (h0, nh) in enumerate(groups):
        qg = view_streams(qp, s.head_dim, n_tps, nh, ns, qp.nb[1], qp.nb[2], qp.nb[3],
                          h0 * qp.nb[2], f"q-{il}-s{step}")
        n_kvh = max(1, nh // gqa)  # a group within one K/V head uses just that head
        kg = view_streams(k, s.head_dim, s.n_kv, n_kvh, ns, k.nb[1], k.nb[2], k.nb[3],
                          (h0 // gqa) * k.nb[2], f"k-{il}-s{step}")
        vg = view_streams(v, v.ne[0], v.ne[1], n_kvh, ns, v.nb[1], v.nb[2], v.nb[3],
                          (h0 // gqa) * v.nb[2], f"v-{il}-s{step}")
        kqv = _attend(qg, kg, vg, kq_mask, kq_scale, max_bias, h0, s.n_head, il, f"-s{step}")
        dst = join.dest(h0, nh, step)
        join.copy(O.permute(kqv, 0, 2, 1, 3), dst, graph)
    return join.result()


def view_streams(t: Tensor, ne0: int, ne1: int, ne2: int, ns: int, nb1: int, nb2: int,
                 nb3: int, offset: int, name: str = "") -> Tensor:
    """A view with ns streams in dimension 3 (the 3-D view a unified cache has when ns=1)."""
    if ns == 1:
        return O.view_3d(t, ne0, ne1, ne2, nb1, nb2, offset, name=name)
    return O.view_4d(t, ne0, ne1, ne2, ns, nb1, nb2, nb3, offset, name=name)


def cache_streams_view(cache: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int,
                       streams: StreamRange, cache_streams: int, name: str = "") -> Tensor:
    """A view of a ubatch's streams of a K or V cache tensor (the cache's `cache_streams`
    streams lie one after another in it; dimension 3 walks them)."""
    if streams == UNIFIED:
        return O.view_3d(cache, ne0, ne1, ne2, nb1, nb2, 0, name=name)
    stride = cache.nbytes // cache_streams
    return view_streams(cache, ne0, ne1, ne2, streams.count, nb1, nb2, stride,
                        streams.first * stride, name)


def stream_tokens(t: Tensor, ns: int) -> Tensor:
    """t [a, b, n_tokens] (rows may be strided) seen as [a, b, n_tokens / ns, ns]: a ubatch's
    tokens come stream after stream."""
    if ns == 1:
        return t
    n_tps = t.ne[2] // ns
    return O.view_4d(t, t.ne[0], t.ne[1], n_tps, ns, t.nb[1], t.nb[2], t.nb[2] * n_tps, 0)


def stream_mask(kq_mask: Tensor, ns: int) -> Tensor:
    """The KQ mask [n_kv, n_tokens] as [n_kv, n_tokens / ns, 1, ns] (llama.cpp's layout)."""
    if ns == 1:
        return kq_mask
    return O.reshape(kq_mask, kq_mask.ne[0], kq_mask.ne[1] // ns, 1, ns)



class HeadJoin:
    """Head groups' results joined into one [head_dim, n_head, n_tokens] F32 buffer, each
    group copied into its heads (no concat chain, so no O(n_head^2) copies).

    The buffer is a node (a fill), not a leaf, so the allocator takes it when the first copy
    needs it and frees it after its reader. Each copy's destination view hangs off the
    previous copy, so the copies are ordered and the buffer stays alive until the last one.
    Nodes: kqv_split-{il} (the buffer), kqv_split-{il}-s{step} (each destination) and
    kqv_out-{il} ([head_dim * n_head, n_tokens], the result).
    """

    def __init__(self, buffer: Tensor, il: int) -> None:
        if buffer.type != GGMLType.F32 or not buffer.is_contiguous:
            raise ValueError(f"layer {il}: the head join buffer must be contiguous F32, got "
                             f"{buffer.describe()}")
        self.head_dim, self.n_head, self.n_tokens = buffer.ne[:3]
        self.il = il
        self.acc = buffer

    @classmethod
    def fill(cls, shaped: Tensor, il: int) -> HeadJoin:
        """A join over a zero fill of `shaped` ([head_dim, n_head, n_tokens] F32): a tensor
        that outlives the groups anyway, so the fill extends no lifetime."""
        return cls(O.fill(shaped, 0.0, name=f"kqv_split-{il}"), il)

    def put(self, src: Tensor, h0: int, step: int, graph: Graph | None = None) -> None:
        """Copy src [head_dim, nh, n_tokens] into heads h0..h0+nh; with a graph, the copy is
        expanded into it now (groups run first to last, each freed before the next)."""
        self.copy(src, self.dest(h0, src.ne[1], step), graph)

    def dest(self, h0: int, nh: int, step: int) -> Tensor:
        """The view of heads h0..h0+nh that step `step` copies into (put's first half)."""
        hd, esz = self.head_dim, F32
        offs = h0 * hd * esz - self.acc.view_offs   # relative to the previous copy
        return O.view_3d(self.acc, hd, nh, self.n_tokens, hd * esz, hd * self.n_head * esz,
                         offs, name=f"kqv_split-{self.il}-s{step}")

    def copy(self, src: Tensor, dst: Tensor, graph: Graph | None = None) -> None:
        """Copy src into dst, a view from `dest` (put's second half)."""
        self.acc = O.cpy(src, dst)
        if graph is not None:
            graph.build_forward_expand(self.acc)

    def result(self) -> Tensor:
        """[head_dim * n_head, n_tokens]: a view of the buffer through the last copy."""
        width = self.head_dim * self.n_head
        return O.view_2d(self.acc, width, self.n_tokens, width * F32, -self.acc.view_offs,
                         name=f"kqv_out-{self.il}")


def _row(t: Tensor, n: int) -> int:
    return t.type.type_size * n // t.type.block_size


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, max_bias: float,
            h0: int, n_head: int, il: int, sfx: str) -> Tensor:
    kq = O.mul_mat(k, q, name=f"kq-{il}{sfx}")                   # [n_kv, n_tokens, heads]
    kq = O.soft_max_ext(kq, mask, scale, max_bias, head_offset=h0 if max_bias else 0,
                        n_head=n_head if max_bias else 0, name=f"kq_soft_max-{il}{sfx}")
    return O.mul_mat(v, kq, name=f"kqv-{il}{sfx}")              # [hd, n_tokens, heads]
