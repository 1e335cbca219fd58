"""The CPU backend's fusion pass: chains of consecutive element-wise nodes of a planned graph
that run as one kernel call (backends/cpu/fused_templates.py) instead of one call each.

The IR is untouched: the pass reads the allocator's node order and plan and returns, for the
first node of each group, the group's nodes and one bound call; Session.bind_calls binds the
other nodes as before. The chain fused today is the norm block of every transformer layer:

    [s = a + b]  ->  n = rms_norm(s) | norm(s)  ->  [m = n * w1]  ->  [d = m + w2]

(residual add, norm, weight, bias; any two or more of them in this order, float32 rows;
the matching rules, shared with CUDA: backends/fusion_rules.py).
Another is a prompt's non-flash attention, K*Q -> softmax -> V*p, which skips the cells
its mask hides (backends/cpu/attn_fusion.py). The last is products of packed
weights of one type that read the same activations (a layer's FFN gate and up; Q, K and V
with a bias add, a rope or a cache write between them, which run after the call): one call
quantizes the activations once and streams the weights one after the other in one parallel
region (qtiles.k_mul_mat_packed), which saves each product after the first its start (a
dispatch, a quantization, a fork) and its threads' uneven ends: Qwen2.5 1.5B decode at 2
threads, 0.2-0.4 ms a token for gate and up, 0.84 more for Q, K and V (median paired
differences; benchmarks/ab_decode.py --without fused-products | products-across, Intel
Xeon Ice Lake). A product's bias add (Qwen2's Q, K and V) folds into the call, which adds the
bias row as it stores the product (_bias_add; a product with a bias alone is such a group
too): 0.16-0.27 ms of a Qwen2.5 1.5B token, 0.19-0.22 of the 0.5B's ~13.5 at 2 threads
(Zen 4, benchmarks/ab_decode.py --without product-bias). The tests compare the fused results
with the unfused bit for bit.
A group's intermediate is left unwritten only when nothing outside the group reads it, it is
no output, no observer reads it (an observed run: backends/observe.py), and the plan freed its
memory at the group (exactly when Session.read would refuse it); otherwise the fused kernel
writes it as the unfused node would. The attention group, whose unfused nodes round
differently, instead fills host arrays with the K*Q and softmax an observer reads
(attn_fusion.Watch). A group is refused when
memory it writes overlaps memory it reads other than the exact in-place alias the row-by-row
kernel handles (the allocator may hand a freed source's bytes to a later node).

GGRAPH_FUSE=0 turns the pass off (CPUBackend(fuse=False) for one backend).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from ggraph.ir.opkind import OpKind
from ggraph import config
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType
from ..fusion_rules import PRE_OPS, Group, dead, match, scan
from ..shared.elementwise import BINARY_CODE
from . import attn_fusion, fused_templates as F, kernels
from .compile import in_turn, is_small

ENABLED = config.fuse()
# consecutive products of one input as one call (_bind_products); benchmarks/ab_decode.py
# turns it off for one engine to measure what it saves
PRODUCTS = True
# the most nodes that may lie between two of those products (Q, K, V: a bias add, a rope and
# a cache write); 0 fuses consecutive products only (benchmarks/ab_decode.py --without
# products-across)
BETWEEN = 4
# a product's bias add folded into its call (_bias_add); benchmarks/ab_decode.py turns it off
# for one engine to measure what it saves
PRODUCT_BIAS = True
_DUMMY = np.zeros((1, 1, 1, 1), np.float32)


def _base_range(arr: np.ndarray) -> tuple[int, int]:
    """[first, past-last) byte addresses arr spans."""
    lo = hi = arr.ctypes.data
    for n, st in zip(arr.shape, arr.strides):
        if n == 0:
            return lo, lo
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + arr.itemsize


def overlap_safe(reads: list[np.ndarray], writes: list[np.ndarray]) -> bool:
    """No written array overlaps another written one, and each overlaps a read array only
    as its exact alias (same address, shape and strides: row r is read before it is
    written)."""
    for k, w in enumerate(writes):
        if any(_meets(w, v) for v in writes[k + 1:]):
            return False
        for r in reads:
            if _meets(w, r) and not (r.ctypes.data == w.ctypes.data and r.shape == w.shape
                                     and r.strides == w.strides):
                return False
    return True


def _meets(x: np.ndarray, y: np.ndarray) -> bool:
    """x and y share a byte of memory (their spans overlap)."""
    lo, hi = _base_range(x)
    ylo, yhi = _base_range(y)
    return lo < yhi and ylo < hi


def fuse(order: Sequence[Tensor], session: Any, kernel_for: Callable[[Callable, Tensor], Any],
         nogil_for: Callable[[Callable], Any], observed: frozenset[Tensor] = frozenset()
         ) -> dict[Tensor, Group]:
    """Groups of `order` (a planned graph's nodes) keyed by their first node.
    `kernel_for(template, last_node)` compiles a fused template for the group's size (serial
    when it is too small to fork threads for); `nogil_for(template)` one of attn_fusion's, to
    run in threads of our own. `observed`: the nodes an observer reads after their group."""
    return scan(order, [
        lambda seq, i, rb: _bind(c, session, rb, kernel_for, observed)
        if (c := match(seq, i)) else None,
        lambda seq, i, rb: _bind_attention(c, session, rb, nogil_for, observed)
        if (c := attn_fusion.match(seq, i)) else None,
        lambda seq, i, rb: _bind_products(seq, i, session, rb, observed)])


def _bias_add(seq: list[Tensor], j: int, s: Any, read_by: dict[Tensor, set[Tensor]],
              observed: frozenset[Tensor]) -> tuple[Tensor, np.ndarray] | None:
    """(the add, its bias row) where seq[j + 1] adds a row of weights to product seq[j] and
    nothing else reads the product (Qwen2's Q, K and V biases): the product's call writes
    product + bias where the add's result lives, and the add needs no call of its own. The
    bias is a leaf, not a view (no node writes it, as a cache write writes a view of its
    cache: the call runs ahead of the nodes between), float32, one value per row of the
    product."""
    if not PRODUCT_BIAS or j + 1 >= len(seq):
        return None
    prod, add = seq[j], seq[j + 1]
    if add.op != OpKind.ADD or prod not in add.src or add.src[0] is add.src[1]:
        return None
    bias = add.src[1] if add.src[0] is prod else add.src[0]
    if (bias.op is not None or bias.is_view or bias.type != GGMLType.F32
            or add.type != GGMLType.F32
            or tuple(bias.ne) != (prod.ne[0], 1, 1, 1) or tuple(add.ne) != tuple(prod.ne)
            or not dead(prod, {prod, add}, read_by, s.plan, observed)):
        return None
    row = s.arr(bias)
    return (add, row) if row.flags.c_contiguous else None


def _bind_products(seq: list[Tensor], i: int, s: Any, read_by: dict[Tensor, set[Tensor]],
                   observed: frozenset[Tensor]) -> Group | None:
    """seq[i] and the next products that read the same activations, from packed weights of
    the same type (kernels.packed_weight), as one call (at most kernels.PACKED_MAX of them);
    None for fewer than 2 unless one has a bias add to fold (_bias_add). Every product's
    result is written as it would be alone, or, folded, its add's.
    Up to BETWEEN other nodes may lie between two of them (a bias add, a rope, a KV cache
    write: Q, K and V in the builders here) unless one is a product, one writes the
    activations, or the run is observed (its values are handed after their group): the call
    runs the products, then those nodes in order, each by its own call. A product with such
    a node before it is computed into a buffer of the binding's and copied to its own
    memory where it would have run: the plan may have given it bytes that an earlier node
    still reads (K gets Q's, dead once Q is roped, in the builders here; a cache write's
    row indices in a fuzzed GGUF)."""
    first = seq[i]
    if not PRODUCTS or first.op != OpKind.MUL_MAT:
        return None
    b, a = first.src[1], first.src[0]
    chain: list[tuple[Tensor, Any]] = []
    fold: dict[Tensor, tuple[Tensor, np.ndarray]] = {}   # product: (its bias add, the row)
    end = i
    for j in range(i, len(seq)):
        node = seq[j]
        if j == end + 1 and seq[end] in fold and fold[seq[end]][0] is node:
            end = j   # a folded bias add: part of its product
        elif node.op == OpKind.MUL_MAT and node.src[1] is b and node.src[0].type == a.type:
            packed = kernels.packed_weight(node.src[0], b, s)
            if packed is None:
                break
            chain.append((node, packed))
            end = j
            if (biased := _bias_add(seq, j, s, read_by, observed)) is not None:
                fold[node] = biased
            if len(chain) == kernels.PACKED_MAX:
                if node in fold:
                    end = j + 1
                break
        elif node.op in (OpKind.MUL_MAT, OpKind.MUL_MAT_ID) or observed or j - end > BETWEEN:
            break   # an observed run hands values after their group: none moves there
    if len(chain) < 2 and not fold:
        return None
    nodes = seq[i:end + 1]
    B = s.arr(b)
    later: dict[Tensor, tuple[np.ndarray, np.ndarray]] = {}   # product: (its memory, buffer)
    direct: list[np.ndarray] = []
    products = {node for node, _ in chain}
    folded = {add: node for node, (add, _) in fold.items()}
    lead = True   # nothing but products (and their folded adds) so far: written in place
    for n in nodes:
        if n in products:
            out = s.arr(fold[n][0] if n in fold else n)
            if lead:
                direct.append(out)
            else:
                later[n] = (out, np.empty(out.shape, out.dtype))
            continue
        if n not in folded:
            lead = False
        if _meets(s.arr(n), B):
            return None
    if not overlap_safe([B] + [row for _, row in fold.values()], direct):
        return None
    kern = kernels.packed_kernel(all(is_small(node) for node, _ in chain), a.type, b.type)
    call = kernels.packed_call(kern, a.type, B, [
        (packed, later[node][1] if node in later else s.arr(fold[node][0] if node in fold
                                                               else node),
         node.src[0].ne[1], fold[node][1] if node in fold else None)
        for node, packed in chain], work=s.bind_memo, team=kernels.packed_team(a.type, b.type))
    if not later:
        return Group(tuple(nodes), call)
    # a product computed into a buffer lands where its result (or its folded add's) would
    # have been written, at that node's turn
    lands = {fold[p][0] if p in fold else p: later[p] for p in later}
    rest = []
    for n in nodes[1:]:
        if n in lands:
            rest.append(partial(np.copyto, *lands[n]))
        elif n not in products and n not in folded and (c := s.bind_node(n)) is not None:
            rest.append(c)
    return Group(tuple(nodes), partial(in_turn, call, rest))


def _bind_attention(chain: list[Tensor], s: Any, read_by: dict[Tensor, set[Tensor]],
                    nogil_for: Callable[[Callable], Any], observed: frozenset[Tensor]
                    ) -> Group | None:
    """The attention group (attn_fusion.py) where K*Q and the softmax are read by no other
    node; told whether its output overlaps an input (the plan may place it where q was
    freed). Where an observer reads K*Q or the softmax, the call also fills host arrays with
    them (`held`): unfusing would change how the output rounds."""
    members = set(chain)
    if not all(dead(t, members, read_by, s.plan) for t in chain[:2]):
        return None
    kq, sm, kqv = chain
    reads = [s.arr(t) for t in (*kq.src, kqv.src[0], sm.src[1]) if t is not None]
    watch = attn_fusion.Watch.of(kq if kq in observed else None,
                                 sm if sm in observed else None, s.bind_memo)
    call = attn_fusion.bind(chain, s, overlap_safe(reads, [s.arr(kqv)]), nogil_for, watch)
    return Group(tuple(chain), call, watch.held(kq, sm))


def _bind(chain: list[Tensor], s: Any, read_by: dict[Tensor, set[Tensor]],
          kernel_for: Callable[[Callable, Tensor], Any], observed: frozenset[Tensor]
          ) -> Group | None:
    members = set(chain)
    pre = chain[0] if chain[0].op in PRE_OPS else None
    norm = chain[1] if pre is not None else chain[0]
    posts = chain[chain.index(norm) + 1:]
    last = chain[-1]
    write = {t: t is not last and not dead(t, members, read_by, s.plan, observed)
             for t in chain}
    x = pre.src[0] if pre is not None else norm.src[0]
    arrays = {t: s.arr(t) for t in chain}
    a = s.arr(x)
    b = s.arr(pre.src[1]) if pre is not None else _DUMMY
    w1 = s.arr(posts[0].src[1]) if posts else _DUMMY
    w2 = s.arr(posts[1].src[1]) if len(posts) > 1 else _DUMMY
    reads = [a] + [v for v in (b, w1, w2) if v is not _DUMMY]
    writes = [arrays[t] for t in chain if write[t] or t is last]
    if not overlap_safe(reads, writes):
        return None

    def out(t: Tensor | None) -> np.ndarray:
        return arrays[t] if t is not None and write[t] else _DUMMY

    kern = kernel_for(F.k_norm_chain, last)
    eps, rms = float(norm.params.eps), norm.op == OpKind.RMS_NORM
    call = partial(kern, a, b, w1, w2, out(pre), out(norm), out(posts[0] if len(posts) > 1
                                                                 else None),
                   arrays[last], BINARY_CODE[pre.op] if pre is not None else -1, eps, rms,
                   BINARY_CODE[posts[0].op] if posts else -1,
                   BINARY_CODE[posts[1].op] if len(posts) > 1 else -1,
                   pre is not None and write[pre], write[norm] and norm is not last,
                   len(posts) > 1 and write[posts[0]])
    return Group(tuple(chain), call)
