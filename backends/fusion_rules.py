"""Which consecutive nodes of a planned graph a backend may run as one call, whatever the
backend: the norm chain of every transformer layer and the liveness rule for the values a
group leaves unwritten. The CPU's fusion pass (backends/cpu/fusion.py) and CUDA's
(backends/cuda/fusion.py) bind the groups these rules find to their own kernels.

    [s = a + b]  ->  n = rms_norm(s) | norm(s)  ->  [m = n * w1]  ->  [d = m + w2]

An observed run (backends/observe.py) names the nodes its observer reads after their group:
those are never left unwritten (`dead` says no), or the group hands their values over in
`held`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from .accepts import VIEW_OPS

NORM_OPS = (OpKind.RMS_NORM, OpKind.NORM)
PRE_OPS = (OpKind.ADD, OpKind.MUL)
POST_OPS = (OpKind.MUL, OpKind.ADD)


@dataclass(frozen=True)
class Group:
    """Nodes run by one call, in order; `call` computes all of them. `held`: for a member an
    observer reads but the call does not write to its memory (the fused attention's K*Q and
    softmax), a host array the call fills with the member's bytes (its type and layout), valid
    until the next group of the binding that shares it runs (an observed run copies the values
    out right after the call)."""
    nodes: tuple[Tensor, ...]
    call: Callable[[], None]
    held: Mapping[Tensor, Any] = field(default_factory=dict)


Try = Callable[[list[Tensor], int, dict[Tensor, set[Tensor]]], Group | None]


def scan(order: Sequence[Tensor], tries: Sequence[Try]) -> dict[Tensor, Group]:
    """A backend's groups of `order` (a planned graph's nodes, pure views left out) keyed by
    their first node: at each node, each of `tries(seq, i, read_by)` in turn may bind a group
    starting there; a group's nodes are then skipped. A view that writes (set_rows into a KV
    cache) stays in the sequence, where no rule matches it: a group never spans one, since
    its call would run the members after it first, over memory the plan may have given them
    once the write had read it (a fused pair of products wrote over a cache write's row
    indices in a fuzzed GGUF: tests/backends/cpu/test_fusion.py)."""
    seq = [n for n in order if not n.is_view or n.op not in VIEW_OPS]
    read_by = readers(seq)
    groups: dict[Tensor, Group] = {}
    i = 0
    while i < len(seq):
        g = next((g for t in tries if (g := t(seq, i, read_by)) is not None), None)
        if g is None:
            i += 1
            continue
        groups[g.nodes[0]] = g
        i += len(g.nodes)
    return groups


def readers(nodes: Sequence[Tensor]) -> dict[Tensor, set[Tensor]]:
    """owner tensor -> the computing nodes that read it (directly or through any view)."""
    out: dict[Tensor, set[Tensor]] = {}
    for node in nodes:
        if node.is_view:
            continue
        for s in node.src:
            if s is not None:
                out.setdefault(s.owner, set()).add(node)
    return out


def f32_rows(t: Tensor) -> bool:
    return t.type == T.F32 and t.rows_contiguous()


def broadcasts(w: Tensor, onto: Tensor) -> bool:
    """w repeats onto `onto` by modulo (ggml's can_repeat), float32."""
    return w.type == T.F32 and all(o % x == 0 for o, x in zip(onto.ne, w.ne) if x)


def other(node: Tensor, x: Tensor) -> Tensor | None:
    """node's operand besides x when node is `x op w` (x first: ggml's broadcast side)."""
    a, b = node.src[0], node.src[1]
    return b if a is x else None


def match(seq: list[Tensor], i: int) -> list[Tensor]:
    """The longest norm chain starting at seq[i] (computing nodes only, in order)."""
    group: list[Tensor] = []
    j = i
    node = seq[j]
    if node.op in PRE_OPS and j + 1 < len(seq) and seq[j + 1].op in NORM_OPS \
            and seq[j + 1].src[0] is node and f32_rows(node) \
            and f32_rows(node.src[0]) and node.src[0].ne == node.ne \
            and broadcasts(node.src[1], node):
        group.append(node)
        j += 1
        node = seq[j]
    if node.op not in NORM_OPS or not (f32_rows(node) and f32_rows(node.src[0])) \
            or node.src[0].ne != node.ne:
        return []
    group.append(node)
    for _ in range(2):
        if j + 1 >= len(seq):
            break
        nxt = seq[j + 1]
        w = other(nxt, group[-1]) if nxt.op in POST_OPS else None
        if w is None or not f32_rows(nxt) or nxt.ne != node.ne or not broadcasts(w, nxt):
            break
        group.append(nxt)
        j += 1
    return group if len(group) >= 2 else []


def dead(t: Tensor, group: set[Tensor], read_by: dict[Tensor, set[Tensor]], plan: Any,
         observed: frozenset[Tensor] = frozenset()) -> bool:
    """Nothing after the group may read t: no output, no reader outside, no observer
    (`observed`: what an observed run reads), freed by the plan."""
    if t.is_view or t.is_output or t.is_preallocated or t in observed or \
            not read_by.get(t, set()) <= group:
        return False
    placement = getattr(plan, "placement", None)
    if placement is None or t not in plan:
        return False
    return bool(placement(t).freed)
