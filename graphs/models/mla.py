"""Multi-head latent attention (MLA, DeepSeek2) over a K-only cache, with iteration over heads.

The cache holds one row per token and layer: the normalized latent (kv_lora values) followed
by the shared roped key (n_rot values); V is a view of the latent part. Three paths compute
one layer's attention output [head_v * n_head, n_tokens]:

- "absorbed": queries absorbed into the latent space per head (wk_b), keys the single cache
  head (MQA): mul_mat -> soft_max_ext -> mul_mat with the transposed latent, then wv_b maps
  each head back. With `amb` it runs over head groups by the facts page's rule (split_heads
  of graphs/models/attention.py, K*Q = n_kv * T * H * 4 bytes); each group's result goes through
  wv_b and is copied into its slice of one output buffer (no concat chain: graphs/models/attention.py's
  HeadJoin, which the decompress path's groups use too).
- "absorbed-fa": the same queries through flash_attn_ext (nothing of size n_kv x T x H is
  materialized, so there is nothing to split); works with any cache type.
- "decompress-fa": for long prompts, K and V are decompressed per head group from the latent
  with wkv_b (K = [k_nope | shared k_rope], V = the value part) and each group runs
  flash_attn_ext. ik_llama.cpp picks the smallest divisor of n_head whose share of
  `kv_f32 = H * (nope + v) * n_kv * 4` fits `amb` (its assembled K and casts come on top);
  ggraph takes the largest group whose whole working set (F32 K_nope+V and the assembled K)
  fits, of any size (the last group smaller): DeepSeek-V3 at 163000 x 512 and amb 2048 needs
  15 iterations of <= 9 heads, each within 2048 MiB, where ik_llama.cpp runs 16 of 8.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType, MIB

from ggraph.graphs.models.attention import (HeadJoin, cache_streams_view, kq_size_mib,
                                            split_heads, stream_mask, stream_tokens,
                                            view_streams)
from ggraph.graphs.models.kv_cache import UNIFIED, StreamRange

F32 = 4
PATHS = ("absorbed", "absorbed-fa", "decompress-fa")
DECOMPRESS_MIN_TOKENS = 128  # ik_llama.cpp decompresses for ubatches of >= 128 tokens
DECOMPRESS_CACHE_TYPES = (GGMLType.F32, GGMLType.F16)  # the latent is mul_mat's 2nd operand


@dataclass(frozen=True)
class MLAShape:
    n_head: int
    kv_lora: int
    n_rot: int
    n_nope: int
    head_v: int
    n_tokens: int
    n_kv: int
    streams: StreamRange = UNIFIED   # the streams the tokens attend in (a stream per sequence)
    cache_streams: int = 1           # the streams the cache tensors hold

    @property
    def row(self) -> int:
        return self.kv_lora + self.n_rot

    @property
    def head_k(self) -> int:
        return self.n_nope + self.n_rot

    @property
    def kq_bytes(self) -> int:
        """K*Q of all heads (absorbed path): n_kv * T * H floats."""
        return self.n_kv * self.n_tokens * self.n_head * F32

    @property
    def kq_mib(self) -> int:
        return kq_size_mib(self.n_kv, self.n_tokens, self.n_head)

    @property
    def kv_f32_bytes(self) -> int:
        """K_nope and V of all heads decompressed in F32 (decompress path)."""
        return self.n_head * (self.n_nope + self.head_v) * self.n_kv * F32

    @property
    def kv_f32_mib(self) -> int:
        return self.kv_f32_bytes // MIB


@dataclass
class MLAWeights:
    """One layer's attention weights past the projections: wk_b [nope, kv_lora, H] and wv_b
    [kv_lora, v, H] for the absorbed paths, wkv_b [kv_lora, H*(nope+v)] to decompress."""
    wk_b: Tensor | None = None
    wv_b: Tensor | None = None
    wkv_b: Tensor | None = None


# -- head groups ------------------------------------------------------------------------------

def absorbed_n_step(s: MLAShape, amb_mib: int) -> int:
    """The facts page's step count: ceil(kq_size / amb) when amb > 0 and K*Q exceeds it."""
    if amb_mib <= 0 or s.kq_mib <= amb_mib:
        return 1
    return -(-s.kq_mib // amb_mib)


def absorbed_groups(s: MLAShape, amb_mib: int) -> list[tuple[int, int]]:
    """Head groups of the absorbed path: ceil(H / n_step) heads each (MQA: one K/V head).
    For 128 heads at 163000 x 512 and amb 2048 that is n_step 20 and 19 groups of <= 7."""
    return split_heads(s.n_head, 1, s.n_kv, s.n_tokens, amb_mib)


def ik_decompress_niter(s: MLAShape, amb_mib: int) -> int:
    """ik_llama.cpp's iteration count: the smallest divisor niter (2 <= niter < H) of n_head
    with kv_f32_mib / niter <= amb, else one head per iteration."""
    if amb_mib <= 0 or s.kv_f32_mib <= amb_mib:
        return 1
    for niter in range(2, s.n_head):
        if s.n_head % niter == 0 and s.kv_f32_mib // niter <= amb_mib:
            return niter
    return s.n_head


def decompress_groups(s: MLAShape, amb_mib: int, k_bytes: int = 2) -> list[tuple[int, int]]:
    """Head groups of the decompress path: the most heads whose working set fits `amb` MiB
    (at least one): K_nope+V decompressed in F32 and K assembled in the cache type (k_bytes
    per value). Groups need not divide n_head (the last is smaller). ik_llama.cpp counts the
    F32 part only and needs a divisor of n_head (ik_decompress_niter)."""
    per_head = (s.n_nope + s.head_v) * s.n_kv * F32 + s.head_k * s.n_kv * k_bytes
    if amb_mib <= 0 or per_head * s.n_head <= amb_mib * MIB:
        return [(0, s.n_head)]
    per = max(1, min(s.n_head, amb_mib * MIB // per_head))
    return [(h, min(per, s.n_head - h)) for h in range(0, s.n_head, per)]


def choose_path(flash: bool, n_tokens: int, cache_type: GGMLType, s: MLAShape,
                min_tokens: int = DECOMPRESS_MIN_TOKENS) -> str:
    """Without flash attention: absorbed. With it: decompress for ubatches of at least
    `min_tokens` tokens when the cache type allows it (F16/F32, kv_lora >= nope, n_rot <= v),
    else absorbed-fa."""
    if not flash:
        return "absorbed"
    if n_tokens >= min_tokens and decompress_supported(cache_type, s) is None:
        return "decompress-fa"
    return "absorbed-fa"


def decompress_supported(cache_type: GGMLType, s: MLAShape) -> str | None:
    """Why the decompress path cannot run (None when it can)."""
    if cache_type not in DECOMPRESS_CACHE_TYPES:
        return f"it multiplies the latent cache as an activation, which must be f32 or f16 " \
               f"(the cache is {cache_type})"
    if s.kv_lora < s.n_nope or s.n_rot > s.head_v:
        return (f"it builds K from the cache row's last {s.head_k} values and needs "
                f"kv_lora >= nope ({s.kv_lora} < {s.n_nope}?) and n_rot <= v "
                f"({s.n_rot} > {s.head_v}?)")
    return None


def _k_bytes(cache_type: GGMLType) -> int:
    """Bytes per value of the assembled K (the cache type; f16 where it cannot run)."""
    return cache_type.type_size if cache_type in DECOMPRESS_CACHE_TYPES else 2


def path_groups(path: str, s: MLAShape, amb_mib: int,
                cache_type: GGMLType = GGMLType.F16) -> list[tuple[int, int]]:
    if path == "absorbed":
        return absorbed_groups(s, amb_mib)
    if path == "decompress-fa":
        return decompress_groups(s, amb_mib, _k_bytes(cache_type))
    if path == "absorbed-fa":
        return [(0, s.n_head)]
    raise ValueError(f"unknown MLA path {path!r}; expected one of {', '.join(PATHS)}")


def largest_tensor(path: str, s: MLAShape, amb_mib: int,
                   cache_type: GGMLType = GGMLType.F16) -> tuple[str, int]:
    """The largest intermediate one attention step holds, by name and bytes."""
    nh = max(n for _, n in path_groups(path, s, amb_mib, cache_type))
    if path == "absorbed":
        return f"kq ({s.n_kv} x {s.n_tokens} x {nh} heads, f32)", s.n_kv * s.n_tokens * nh * F32
    if path == "absorbed-fa":
        return (f"Qcur ({s.row} x {s.n_tokens} x {s.n_head} heads, f32)",
                s.row * s.n_tokens * s.n_head * F32)
    kv = nh * (s.n_nope + s.head_v) * s.n_kv * F32
    k = nh * s.head_k * s.n_kv * _k_bytes(cache_type)
    return (f"kv_f32 + k ({nh} heads x {s.n_kv}: {kv / MIB:.0f} + {k / MIB:.0f} MiB)", kv + k)


# -- graphs -------------------------------------------------------------------------------------

def build_mla_attention(q_nope: Tensor, q_pe: Tensor, k_store: Tensor, kq_mask: Tensor, *,
                        shape: MLAShape, w: MLAWeights, kq_scale: float, path: str,
                        amb_mib: int = 0, il: int = 0, graph: Graph | None = None) -> Tensor:
    """One layer's attention output [head_v * H, T].

    q_nope: [nope, H, T] (a view of the query projection). q_pe: [n_rot, H, T], roped.
    k_store: the layer's cache [row, >= n_kv] as returned by the write (set_rows) so every
    read is ordered after it. kq_mask: [n_kv, >= T], F16 for the flash paths, F32 otherwise.
    graph: each head group is expanded into it as it is built, so groups run in order and
    each group's tensors are freed before the next starts.
    """
    s = shape
    if path == "decompress-fa":
        if s.streams != UNIFIED:
            raise ValueError(f"layer {il}: the decompress-fa path takes one unified cache "
                             f"stream; with a stream per sequence use absorbed-fa")
        return _decompress_fa(q_nope, q_pe, k_store, kq_mask, s, w, kq_scale, amb_mib, il, graph)
    if w.wk_b is None or w.wv_b is None:
        raise ValueError(f"layer {il}: the {path} path needs attn_k_b and attn_v_b")
    # with a stream per sequence T = n_tps tokens of each of ns streams in dimension 3
    ns = s.streams.count
    n_tps = s.n_tokens // ns
    kq_mask = stream_mask(kq_mask, ns)
    # absorbed queries: wk_b maps each head's q_nope into the latent space
    qn = O.permute(stream_tokens(q_nope, ns), 0, 2, 1, 3)                   # [nope, T, H]
    q_abs = O.mul_mat(w.wk_b, qn, name=f"q_nope_absorbed-{il}")             # [kv_lora, T, H]
    q = O.concat(q_abs, O.permute(stream_tokens(q_pe, ns), 0, 2, 1, 3), 0,
                 name=f"Qcur-{il}")                                         # [row, T, H]
    rb = k_store.nb[1]
    k = cache_streams_view(k_store, s.row, s.n_kv, 1, rb, rb * s.n_kv, s.streams,
                           s.cache_streams, f"kv_cache-{il}")               # [row, n_kv, 1]
    latent = cache_streams_view(k_store, s.kv_lora, s.n_kv, 1, rb, rb * s.n_kv, s.streams,
                                s.cache_streams, f"kv_latent-{il}")
    if path == "absorbed-fa":
        fa = O.flash_attn_ext(q, k, latent, kq_mask, scale=kq_scale, name=f"kqv_latent-{il}")
        out = O.mul_mat(w.wv_b, O.permute(fa, 0, 2, 1, 3), name=f"kqv-{il}")  # [v, T, H]
        return O.cont(O.permute(out, 0, 2, 1, 3), s.head_v * s.n_head, s.n_tokens,
                      name=f"kqv_out-{il}")
    if path != "absorbed":
        raise ValueError(f"unknown MLA path {path!r}; expected one of {', '.join(PATHS)}")
    if k_store.type.is_quantized:
        raise ValueError(f"layer {il}: a quantized MLA cache ({k_store.type}) needs flash "
                         f"attention (--fa): the absorbed mul_mat path reads the latent "
                         f"transposed, which blocks of 32 values cannot give")
    v_t = O.cont(O.transpose(latent), name=f"kv_latent_t-{il}")            # [n_kv, kv_lora]
    groups = absorbed_groups(s, amb_mib)
    if len(groups) == 1:
        kq = O.mul_mat(k, q, name=f"kq-{il}")                               # [n_kv, T, H]
        kq = O.soft_max_ext(kq, kq_mask, kq_scale, name=f"kq_soft_max-{il}")
        kqv = O.mul_mat(v_t, kq, name=f"kqv_latent-{il}")                   # [kv_lora, T, H]
        out = O.mul_mat(w.wv_b, kqv, name=f"kqv-{il}")                      # [v, T, H]
        return O.cont(O.permute(out, 0, 2, 1, 3), s.head_v * s.n_head, s.n_tokens,
                      name=f"kqv_out-{il}")
    # one [v, H, T] buffer, each group's result copied into its slice; the buffer is a node
    # (fill of a same-sized view of Qcur, which lives through all groups anyway)
    join = _join(q, s, il)
    wv = w.wv_b
    for step, (h0, nh) in enumerate(groups):
        sfx = f"-{il}-s{step}"
        qg = view_streams(q, s.row, n_tps, nh, ns, q.nb[1], q.nb[2], q.nb[3], h0 * q.nb[2],
                          f"q{sfx}")
        kq = O.mul_mat(k, qg, name=f"kq{sfx}")                              # [n_kv, T, nh]
        kq = O.soft_max_ext(kq, kq_mask, kq_scale, name=f"kq_soft_max{sfx}")
        kqv = O.mul_mat(v_t, kq, name=f"kqv_latent{sfx}")                   # [kv_lora, T, nh]
        wg = O.view_3d(wv, wv.ne[0], wv.ne[1], nh, wv.nb[1], wv.nb[2], h0 * wv.nb[2],
                       name=f"wv_b{sfx}")
        out = O.mul_mat(wg, kqv, name=f"kqv{sfx}")                          # [v, T, nh]
        join.put(O.permute(out, 0, 2, 1, 3), h0, step, graph)
    return join.result()


def _decompress_fa(q_nope: Tensor, q_pe: Tensor, k_store: Tensor, kq_mask: Tensor,
                   s: MLAShape, w: MLAWeights, kq_scale: float, amb_mib: int, il: int,
                   graph: Graph | None) -> Tensor:
    why = decompress_supported(k_store.type, s)
    if why is not None:
        raise ValueError(f"layer {il}: the decompress-fa path cannot run: {why}")
    if w.wkv_b is None:
        raise ValueError(f"layer {il}: the decompress-fa path needs attn_kv_b")
    q = O.concat(q_nope, q_pe, 0, name=f"q_full-{il}")                      # [head_k, H, T]
    qp = O.permute(q, 0, 2, 1, 3)                                           # [head_k, T, H]
    rb, esz = k_store.nb[1], k_store.type.type_size
    latent = O.view_2d(k_store, s.kv_lora, s.n_kv, rb, 0, name=f"kv_latent-{il}")
    # the last head_k values of each row: the latent's tail (overwritten with k_nope below)
    # and the shared roped key, which every head of a group repeats
    tail = O.view_3d(k_store, s.head_k, s.n_kv, 1, rb, rb * s.n_kv, (s.kv_lora - s.n_nope) * esz,
                     name=f"k_tail-{il}")
    groups = decompress_groups(s, amb_mib, esz)
    join = _join(q, s, il) if len(groups) > 1 else None
    wkv, per = w.wkv_b, s.n_nope + s.head_v
    for step, (h0, nh) in enumerate(groups):
        sfx = f"-{il}-s{step}" if len(groups) > 1 else f"-{il}"
        wg = O.view_2d(wkv, wkv.ne[0], nh * per, wkv.nb[1], h0 * per * wkv.nb[1],
                       name=f"wkv_b{sfx}")
        kv = O.mul_mat(wg, latent, name=f"kv_f32{sfx}")                     # [nh*(nope+v), n_kv]
        hb = per * F32                                                      # one head's slice
        shaped = O.view_3d(kv, s.head_k, s.n_kv, nh, kv.nb[1], hb, 0)       # shape donor only
        kbuf = O.repeat(tail, shaped, name=f"k{sfx}")                       # [head_k, n_kv, nh]
        k_nope = O.view_3d(kv, s.n_nope, s.n_kv, nh, kv.nb[1], hb, 0, name=f"k_nope{sfx}")
        dst = O.view_3d(kbuf, s.n_nope, s.n_kv, nh, kbuf.nb[1], kbuf.nb[2], 0)
        k_written = O.cpy(k_nope, dst, name=f"k_nope_into_k{sfx}")
        k = O.view_3d(k_written, s.head_k, s.n_kv, nh, kbuf.nb[1], kbuf.nb[2], 0,
                      name=f"k_full{sfx}")
        v = O.view_3d(kv, s.head_v, s.n_kv, nh, kv.nb[1], hb, s.n_nope * F32, name=f"v{sfx}")
        qg = O.view_3d(qp, s.head_k, s.n_tokens, nh, qp.nb[1], qp.nb[2], h0 * qp.nb[2],
                       name=f"q{sfx}")
        fa = O.flash_attn_ext(qg, k, v, kq_mask, scale=kq_scale, name=f"fattn{sfx}")  # [v, nh, T]
        if join is None:
            return O.reshape(fa, s.head_v * s.n_head, s.n_tokens, name=f"kqv_out-{il}")
        join.put(fa, h0, step, graph)
    assert join is not None
    return join.result()


def _join(like: Tensor, s: MLAShape, il: int) -> HeadJoin:
    """The head join ([v, H, T] F32) over a fill of a same-sized view of `like`, a tensor that
    outlives the groups, so the fill extends no lifetime."""
    need = s.head_v * s.n_head * s.n_tokens * F32
    if like.nbytes < need:
        raise ValueError(f"layer {il}: {like.describe()} is too small to shape the "
                         f"[{s.head_v}, {s.n_head}, {s.n_tokens}] join buffer")
    shaped = O.view_3d(like, s.head_v, s.n_head, s.n_tokens, s.head_v * F32,
                       s.head_v * s.n_head * F32, 0)
    return HeadJoin.fill(shaped, il)
