"""Node orders for the graph allocator's default strategy: orders that keep every dependency,
including the hidden ones of writes through views, and that lower the bytes live at once.

Both take `sizes`, the bytes of every planned tensor (ggraph.plan.alloc.check_graph), and return
a permutation of node indices."""
from __future__ import annotations

import bisect
from collections.abc import Sequence

from ggraph.ir.tensor import Tensor


def _dependencies(nodes: Sequence[Tensor]) -> tuple[list[list[int]], list[set[Tensor]]]:
    """Predecessors of each node and the memory roots it touches.

    Writes through views (cpy, set_rows) have no edge to later readers of the same memory, so
    every access to a root that is written through a view keeps its original relative order."""
    pos = {t: i for i, t in enumerate(nodes)}
    preds: list[list[int]] = [[] for _ in nodes]
    roots: list[set[Tensor]] = [set() for _ in nodes]
    written = {t.view_src for t in nodes
               if t.view_src is not None and t.op is not None and not t.op.is_view}
    last_access: dict[Tensor, int] = {}     # root written through a view -> last node at it
    for i, t in enumerate(nodes):
        touched, pred = roots[i], preds[i]
        if t.view_src is not None:
            touched.add(t.view_src)
        for s in t.src:
            if s is not None:
                j = pos.get(s)
                if j is not None and j not in pred:
                    pred.append(j)
                touched.add(s.owner)
        for root in touched:
            if root in written:
                j = last_access.get(root)
                if j is not None and j not in pred:
                    pred.append(j)
                last_access[root] = i
    return preds, roots


def greedy_order(nodes: Sequence[Tensor], sizes: dict[Tensor, int], window: int = 24
                 ) -> list[int]:
    """Dependency-preserving order that runs the ready node adding the fewest bytes (its
    result minus the sources it frees), ties by original position. `sizes`: bytes of every
    planned tensor."""
    preds, roots = _dependencies(nodes)
    users: dict[Tensor, int] = {}         # root -> nodes touching it not yet run
    for touched in roots:
        for root in touched:
            users[root] = users.get(root, 0) + 1
    freeable = {t: sizes[t] for t in nodes if t in sizes and not t.is_output}
    succ: list[list[int]] = [[] for _ in nodes]
    indeg = [len(p) for p in preds]
    for i, p in enumerate(preds):
        for j in p:
            succ[j].append(i)
    ready = [i for i in range(len(nodes)) if indeg[i] == 0]
    out: list[int] = []
    while ready:
        best, best_score = 0, None
        for k in range(min(window, len(ready))):
            i = ready[k]
            score = sizes.get(nodes[i], 0)
            for root in roots[i]:
                if users[root] == 1:
                    score -= freeable.get(root, 0)
            if best_score is None or score < best_score:
                best, best_score = k, score
        i = ready.pop(best)
        out.append(i)
        for root in roots[i]:
            users[root] -= 1
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                bisect.insort(ready, j)
    return out


def subtree_order(nodes: Sequence[Tensor], sizes: dict[Tensor, int]) -> list[int]:
    """Post-order that computes the source needing the most memory first (Sethi-Ullman):
    results of the other sources are then held for the shortest time. Needs are estimated
    as if the graph were a tree."""
    preds, _ = _dependencies(nodes)
    n = len(nodes)
    res = [sizes.get(t, 0) for t in nodes]
    need = [0] * n
    keyed: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):             # preds come earlier, so one pass in order suffices
        ps = sorted(preds[i], key=lambda j: (res[j] - need[j], -j))
        keyed[i] = ps
        held, peak = 0, 0
        for j in ps:
            peak = max(peak, held + need[j])
            held += res[j]
        need[i] = max(peak, held + res[i])
    has_user = [False] * n
    for p in preds:
        for j in p:
            has_user[j] = True
    out: list[int] = []
    done = [False] * n
    for r in [i for i in range(n) if not has_user[i]] + list(range(n)):
        if done[r]:
            continue
        stack = [(r, 0)]
        while stack:
            i, k = stack[-1]
            if k < len(keyed[i]):
                stack[-1] = (i, k + 1)
                j = keyed[i][k]
                if not done[j]:
                    done[j] = True  # marked on entry: a DAG, so never re-entered
                    stack.append((j, 0))
                continue
            stack.pop()
            done[i] = True
            out.append(i)
    return out


__all__ = ["greedy_order", "subtree_order"]
