"""The summary view of `ggraph dot`: one box per layer, global nodes on their own, inputs as
leafs, edges counting the tensors that cross. A layer box reads at a glance: its execution
steps, its ops (or "ops as layer N" when an earlier layer has the same), its weights and KV
cache bytes (a bar against the heaviest layer's when layers differ, as dense and MoE layers
do), with a plan its own compute high-water mark as a bar against the buffer, and with
per-node times (a profile) its time as a bar against the slowest layer. ggraph/pictures/dot.py
owns the
full picture; both draw with ggraph.pictures.dot_style."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from ggraph.pictures.dot_errors import GraphTooLargeError
from ggraph.pictures.dot_style import (PEAK_COLOR, DrawContext, Writer, attr_str, display_name, esc,
                              family, human, leaf_kind, node_attrs, node_id, write_header)
from ggraph.ir.tensor import Tensor

BAR_WIDTH = 170          # points: a full bar (the whole buffer, the slowest layer)
MEMORY_BAR = "#d7301f"
TIME_BAR = "#3182bd"
WEIGHT_BAR = "#c51b8a"


@dataclass
class LayerFacts:
    """What one layer box says, worked out before any box is drawn (bars need the maxima)."""
    nodes: list[Tensor]
    weights: int = 0               # bytes of the layer's weights
    cache: int = 0                 # bytes of its KV cache
    first: int = -1                # first and last execution step
    last: int = -1
    peak: int = 0                  # bytes live at its own high-water mark (with a plan)
    peak_at: Tensor | None = None
    seconds: float | None = None   # summed node times (with a profile)


def summary_dot(c: DrawContext, layers: tuple[int, int] | None, title: str,
                max_nodes: int, node_seconds: Mapping[Tensor, float] | None = None) -> str:
    """One box per layer (steps, ops, weights, KV cache; with a plan the layer's compute peak,
    with `node_seconds` its time), global nodes on their own, inputs as leafs; edges count
    the tensors crossing."""
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
    facts = _layer_facts(c, members, weights, node_seconds)
    w = Writer()
    w.lines.append("digraph ggraph_summary {")
    n_layers = sum(1 for g in members if g.startswith("L"))
    bars = [f'<FONT COLOR="{MEMORY_BAR}">red bar: the layer\'s compute peak against the '
            f"buffer</FONT>"] if c.plan is not None else []
    if len({f.weights for f in facts.values()}) > 1:
        bars.append(f'<FONT COLOR="{WEIGHT_BAR}">pink bar: its weights against the heaviest '
                    f"layer's</FONT>")
    if node_seconds is not None:
        bars.append(f'<FONT COLOR="{TIME_BAR}">blue bar: its time against the slowest '
                    f"layer's</FONT>")
    write_header(w, c, layers, (title + " · " if title else "") + f"summary: {n_layers} "
                 f"layer boxes", sum(len(v) for v in members.values()), len(inputs),
                 keys=bars)
    for t in inputs:
        w.add(f"{node_id(c, t)} {attr_str(node_attrs(c, t))};")
    seen: dict[tuple, str] = {}          # op census -> the lowest layer that has it
    for g in sorted(facts, key=lambda g: int(g[1:])):
        seen.setdefault(_census(c, facts[g].nodes), g[1:])
    top_weights = (min((f.weights for f in facts.values()), default=0),
                   max((f.weights for f in facts.values()), default=0))
    top_time = max((f.seconds or 0.0 for f in facts.values()), default=0.0)
    for g, ts in members.items():
        if not g.startswith("L"):
            w.add(f"{g} {attr_str(node_attrs(c, ts[0]))};")
            continue
        w.add(f"{g} {attr_str(_layer_box(c, g, facts[g], seen, top_time, top_weights))};")
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



def _layer_facts(c: DrawContext, members: dict[str, list[Tensor]],
                 weights: dict[str, list[Tensor]],
                 node_seconds: Mapping[Tensor, float] | None) -> dict[str, LayerFacts]:
    live = None
    if c.plan is not None:
        from ggraph.pictures.alloc_report import live_by_step, peak_within

        live = live_by_step(c.plan)
    caches: dict[int, int] = defaultdict(int)
    for t in c.graph.leafs:
        il = c.where[t][0]
        if il is not None and leaf_kind(t) == "cache":
            caches[il] += t.nbytes
    out: dict[str, LayerFacts] = {}
    for g, ts in members.items():
        if not g.startswith("L"):
            continue
        f = out[g] = LayerFacts(ts, weights=sum(x.nbytes for x in weights[g]),
                                cache=caches.get(int(g[1:]), 0))
        # views run first and cost nothing: the layer's span is that of its real work
        work = [t for t in ts if family(t) != "view"] or ts
        steps = [c.step[t] for t in work if t in c.step] if c.plan is not None else \
            [c.index[t] for t in work]
        if steps:
            f.first, f.last = min(steps), max(steps)
        if c.plan is not None and live is not None:
            at = peak_within(c.plan, ts, live)
            if at is not None:
                f.peak, f.peak_at = live[at + 1], c.plan.order[at]
        if node_seconds is not None:
            f.seconds = sum(node_seconds.get(t, 0.0) for t in ts)
    return out


def _census(c: DrawContext, ts: list[Tensor]) -> tuple:
    """What makes two layers alike in the picture: their node count, ops and split steps."""
    ops = Counter(str(t.op) for t in ts)
    return len(ts), tuple(sorted(ops.items())), len({c.where[t][1] for t in ts} - {None})


def _bar(frac: float, colour: str) -> str:
    """A horizontal bar `frac` of BAR_WIDTH long, on a grey track."""
    n = min(BAR_WIDTH, max(1, round(BAR_WIDTH * frac)))
    cell = '<TD WIDTH="{}" HEIGHT="6" FIXEDSIZE="TRUE" BGCOLOR="{}"></TD>'
    cells = cell.format(n, colour) + (cell.format(BAR_WIDTH - n, "#e2e2e2")
                                      if n < BAR_WIDTH else "")
    # a fixed-size table: in a wider box graphviz would spread the spare width between cells
    return (f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0" '
            f'WIDTH="{BAR_WIDTH}" HEIGHT="6" FIXEDSIZE="TRUE" ALIGN="LEFT"><TR>' + cells
            + "</TR></TABLE>")


def _layer_box(c: DrawContext, g: str, f: LayerFacts, seen: dict[tuple, str],
               top_time: float, top_weights: tuple[int, int]) -> dict[str, str]:
    """The attributes of one layer box; top_weights: the lightest and heaviest layer's."""
    ts = f.nodes
    il = g[1:]
    ops = Counter(str(t.op) for t in ts if family(t) != "view")
    steps = {c.where[t][1] for t in ts} - {None}
    n_views = sum(1 for t in ts if family(t) == "view")
    small = '<FONT POINT-SIZE="9">{}</FONT>'
    when = f"steps {f.first}–{f.last}" if c.plan is not None else f"nodes #{f.first}–#{f.last}"
    rows = [f'<B>layer {il}</B>   <FONT COLOR="#555555" POINT-SIZE="9">{when}</FONT>']
    like = seen[_census(c, ts)]
    if like != il:
        rows.append(small.format(f'<FONT COLOR="#777777">{len(ts)} nodes, ops as layer '
                                 f'{like}</FONT>'))
    else:
        top = " · ".join(f"{op}×{n}" for op, n in ops.most_common(5))
        rows.append(small.format(f"{len(ts)} nodes ({n_views} views): {esc(top, 90)}"))
    if steps:
        rows.append(small.format(f'<FONT COLOR="#b06000">{len(steps)} split-attention steps'
                                 f"</FONT>"))
    mem = f"weights {human(f.weights)}" + (f" · KV cache {human(f.cache)}" if f.cache else "")
    rows.append(mem)
    if top_weights[0] != top_weights[1]:      # layers of different weights (dense and MoE)
        rows.append(_bar(f.weights / top_weights[1], WEIGHT_BAR))
    attrs = {"shape": "box", "style": "rounded,filled", "fillcolor": "#f2f2f2"}
    if c.plan is not None and f.peak_at is not None:
        share = 100 * f.peak / c.plan.size if c.plan.size else 0.0
        rows.append(small.format(f"compute peak <B>{human(f.peak)}</B> ({share:.0f}% of the "
                                 f"buffer) at {esc(display_name(f.peak_at), 30)}"))
        rows.append(_bar(f.peak / c.plan.size if c.plan.size else 0.0, MEMORY_BAR))
        if any(t is c.graph_peak for t in ts):
            rows.append(f'<FONT COLOR="{PEAK_COLOR}"><B>▲ PEAK at step {c.plan.peak_step}: '
                        f"{esc(display_name(c.graph_peak))}</B></FONT>")
            attrs.update(color=PEAK_COLOR, penwidth="3")
        elif c.local_peak and any(t is c.peak_node for t in ts):
            rows.append(f'<FONT COLOR="{PEAK_COLOR}"><B>▲ the drawn layers\' peak at step '
                        f"{c.step[c.peak_node]}: {esc(display_name(c.peak_node))}</B></FONT>")
            attrs.update(color=PEAK_COLOR, penwidth="3")
    if f.seconds is not None:
        ms = f.seconds * 1e3
        rows.append(small.format(f"time <B>{ms:.3g} ms</B>"))
        rows.append(_bar(f.seconds / top_time if top_time > 0 else 0.0, TIME_BAR))
    cells = "".join(f"<TR><TD ALIGN=\"LEFT\">{r}</TD></TR>" for r in rows)
    attrs["label"] = ('<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="1" CELLPADDING="0">'
                      + cells + "</TABLE>>")
    return attrs


__all__ = ["BAR_WIDTH", "LayerFacts", "summary_dot"]
