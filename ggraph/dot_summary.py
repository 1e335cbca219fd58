"""The summary view of `ggraph dot`: one box per layer (node and weight counts, the commonest
ops, split steps, planned bytes), global nodes on their own, inputs as leafs, edges counting
the tensors that cross. ggraph/dot.py owns the full picture; both draw with ggraph.dot_style."""
from __future__ import annotations

from collections import Counter, defaultdict

from ggraph.dot_errors import GraphTooLargeError
from ggraph.dot_style import (PEAK_COLOR, DrawContext, Writer, attr_str, display_name, esc,
                              family, human, leaf_kind, node_attrs, node_id, write_header)
from ggraph.tensor import Tensor


def summary_dot(c: DrawContext, layers: tuple[int, int] | None, title: str,
                max_nodes: int) -> str:
    """One box per layer (node and weight counts, the commonest ops, split steps, planned
    bytes), global nodes on their own, inputs as leafs; edges count the tensors crossing."""
    graph = c.graph

    def group(t: Tensor) -> str | None:
        il = c.where[t][0]
        if il is None:
            return f"g{c.index[t]}" if t.op is not None else \
                (node_id(c, t) if t.is_input else None)
        return f"L{il}" if layers is None or layers[0] <= il <= layers[1] else None

    members: dict[str, list[Tensor]] = defaultdict(list)
    for t in graph.nodes:
        if (g := group(t)) is not None:
            members[g].append(t)
    if max_nodes and len(members) > max_nodes:
        raise GraphTooLargeError(f"the summary still has {len(members)} boxes, more than "
                                 f"max_nodes={max_nodes}: filter layers (--layers A-B)")
    weights: dict[str, list[Tensor]] = defaultdict(list)
    inputs: dict[Tensor, None] = {}          # an ordered set: drawn as first met
    edges: Counter[tuple[str, str]] = Counter()
    for g, ts in members.items():
        for t in ts:
            for s in t.src:
                if s is None:
                    continue
                if s.op is None:
                    if s.is_input:
                        inputs[s] = None
                        edges[(node_id(c, s), g)] += 1
                    elif c.where[s][0] is not None and leaf_kind(s) == "weight" and \
                            s not in weights[g]:
                        weights[g].append(s)
                    continue
                sg = group(s)
                if sg is not None and sg != g:
                    edges[(sg, g)] += 1
    w = Writer()
    w.lines.append("digraph ggraph_summary {")
    n_layers = sum(1 for g in members if g.startswith("L"))
    write_header(w, c, layers, (title + " · " if title else "") + f"summary: {n_layers} "
                 f"layer boxes", sum(len(v) for v in members.values()), len(inputs))
    for t in inputs:
        w.add(f"{node_id(c, t)} {attr_str(node_attrs(c, t))};")
    for g, ts in members.items():
        if not g.startswith("L"):
            w.add(f"{g} {attr_str(node_attrs(c, ts[0]))};")
            continue
        ops = Counter(str(t.op) for t in ts if family(t) != "view")
        top = " · ".join(f"{op}×{n}" for op, n in ops.most_common(5))
        steps = {c.where[t][1] for t in ts} - {None}
        wb = sum(x.nbytes for x in weights[g])
        rows = [f"<B>layer {g[1:]}</B>",
                (f"{len(ts)} nodes ({sum(1 for t in ts if family(t) == 'view')} views) · "
                f"{len(weights[g])} weights, {human(wb)}"),
                f"<FONT POINT-SIZE=\"9\">{esc(top, 90)}</FONT>"]
        if steps:
            rows.append(f"<FONT COLOR=\"#b06000\">{len(steps)} split-attention steps</FONT>")
        attrs = {"shape": "box", "style": "rounded,filled", "fillcolor": "#f2f2f2"}
        if c.plan is not None:
            ps = [c.plan.placements[t] for t in ts if t in c.plan.placements]
            if ps:
                big = max(ps, key=lambda p: p.size)
                rows.append(f"<FONT POINT-SIZE=\"9\">{len(ps)} planned tensors, largest "
                            f"{esc(display_name(big.tensor), 30)} {human(big.size)}</FONT>")
            if any(t is c.peak_node for t in ts):
                rows.append(f"<FONT COLOR=\"{PEAK_COLOR}\"><B>▲ PEAK at step "
                            f"{c.plan.peak_step}: {esc(display_name(c.peak_node))}</B></FONT>")
                attrs.update(color=PEAK_COLOR, penwidth="3")
        attrs["label"] = "<" + "<BR/>".join(rows) + ">"
        w.add(f"{g} {attr_str(attrs)};")
    # an input read by every layer would draw one edge per layer (a hairball): draw the edge
    # to its first reader and count the others
    first: dict[str, list[str]] = defaultdict(list)
    for (a, b), n in edges.items():
        if a.startswith("l"):
            first[a].append(b)
            continue
        w.add(f"{a} -> {b}" + (f" [label=\"{n}\", fontsize=8, fontcolor=\"#777777\"]"
                               if n > 1 else "") + ";")
    for a, users in first.items():
        more = f" [label=\"+{len(users) - 1} more\", fontsize=8, fontcolor=\"#777777\", " \
            f"color=\"#aaaaaa\"]" if len(users) > 1 else " [color=\"#aaaaaa\"]"
        w.add(f"{a} -> {users[0]}{more};")
    w.lines.append("}")
    return "\n".join(w.lines) + "\n"


__all__ = ["summary_dot"]
