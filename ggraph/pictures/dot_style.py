"""How a picture reads, shared by the full view (ggraph.pictures.dot) and the summary view
(ggraph.pictures.dot_summary): colours of op families and leaf kinds, the text and attributes of a
drawn tensor (with a plan: offset, size, lifetime, in-place reuse, the peak), the title with
its legend, and the writer of indented DOT lines.

A DrawContext holds what both views know about one graph and its plan: layers, node and leaf
indices, execution steps and the tensors live at the peak.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ggraph.pictures.dot_errors import DotError
from ggraph.pictures.dot_layers import Where, assign_layers, graph_layers, layer_span
from ggraph.ir.graph import Graph
from ggraph.ir.opkind import Family
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import MIB

if TYPE_CHECKING:
    from ggraph.plan.alloc import Plan

# op family -> fill colour; the legend lists the families a picture uses in this order (which
# ops belong to a family is their records' business: OpKind.family)
FAMILIES: dict[str, str] = {
    str(Family.MATMUL): "#9ecae1", str(Family.ATTENTION): "#fdae6b", str(Family.ROPE): "#cbc3e3",
    str(Family.NORM): "#a1d99b", str(Family.ARITHMETIC): "#fff3a3",
    str(Family.ACTIVATION): "#f4b6c2", str(Family.COPY): "#e3cfae",
    str(Family.REDUCE): "#99d8c9", str(Family.VIEW): "#ffffff",
}
# leaf kinds -> (fill, shape)
LEAF_STYLE = {"weight": ("#fbd3e9", "box"), "input": ("#c7e9c0", "box"),
              "cache": ("#dadaeb", "cylinder"), "leaf": ("#f0f0f0", "box")}
PEAK_COLOR = "#d7191c"
INPLACE_COLOR = "#e66101"
OUTPUT_COLOR = "#08519c"


# -- text ---------------------------------------------------------------------------------------

def human(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def ne_text(t: Tensor) -> str:
    """ne without the trailing 1-dims past the second: [64, 8, 4]."""
    return "[" + ", ".join(str(x) for x in t.ne[:max(t.n_dims, 2)]) + "]"


def esc(s: str, limit: int = 44) -> str:
    """`s` shortened to `limit` characters and escaped for an HTML label."""
    if len(s) > limit:   # long derived names: keep the base and the end, which say the most
        s = s[:limit - 15] + "…" + s[-14:]
    return html.escape(s, quote=True)


def display_name(t: Tensor) -> str:
    """The tensor's name, or #id when it has none."""
    return t.name or f"#{t.id}"


def leaf_kind(t: Tensor) -> str:
    if t.is_input:
        return "input"
    if t.buffer == "model" or (t.data is not None and t.buffer is None):
        return "weight"
    if t.buffer is not None:
        return "cache"
    return "leaf"


def family(t: Tensor) -> str:
    return "leaf" if t.op is None else str(t.op.family)


def _op_text(t: Tensor) -> str:
    from ggraph.ops.registry import REGISTRY

    sym = REGISTRY[t.op].symbol if t.op in REGISTRY else str(t.op)
    return str(t.op) if sym == str(t.op) else f"{sym}  {t.op}"


# -- what a picture knows -----------------------------------------------------------------------

@dataclass
class DrawContext:
    """One graph (and its plan) as both views draw it."""
    graph: Graph
    plan: Plan | None
    where: dict[Tensor, Where]     # (layer, split step) of every node and leaf
    index: dict[Tensor, int]       # node index in graph.nodes
    leaf_index: dict[Tensor, int]  # leaf index in graph.leafs (Tensor.id repeats across
    #                                contexts, so DOT ids come from these indices)
    step: dict[Tensor, int]        # step in plan.order
    live: set[Tensor]              # live at the outlined peak
    peak_node: Tensor | None       # the outlined peak: the graph's, or the drawn layers' own
    #                                when the graph's lies outside them
    graph_peak: Tensor | None = None   # the plan's peak node (where the buffer's size is set)
    live_bytes: int = 0            # bytes live at the outlined peak
    graph_live_bytes: int = 0      # bytes live at the plan's peak

    @property
    def local_peak(self) -> bool:
        """Whether the outlined peak is the drawn layers' own, not the graph's."""
        return self.peak_node is not self.graph_peak


def draw_context(graph: Graph, plan: Plan | None, layers: tuple[int, int] | None = None,
                 globals_drawn: bool = False) -> DrawContext:
    """What both views know. With a layer filter that leaves the plan's peak out, the peak
    outlined is the drawn layers' own high-water mark (the picture names both);
    `globals_drawn`: nodes of no layer are drawn too (the summary draws them). DotError when
    `plan` belongs to another graph."""
    step: dict[Tensor, int] = {}
    live: set[Tensor] = set()
    peak = graph_peak = None
    live_bytes = graph_bytes = 0
    where = assign_layers(graph)
    if plan is not None:
        if plan.graph is not graph:
            raise DotError("the plan was made for another graph: plan this graph (or pass the "
                           "graph the plan belongs to, plan.graph)")
        from ggraph.pictures.alloc_report import peak_info, peak_within

        step = {t: i for i, t in enumerate(plan.order)}
        info = peak_info(plan)
        graph_peak, graph_bytes = info["node"], info["live_bytes"]

        def drawn(t: Tensor) -> bool:
            il = where.get(t, (None, None))[0]
            if il is None:
                return layers is None or globals_drawn
            return layers is None or layers[0] <= il <= layers[1]

        if graph_peak is not None and not drawn(graph_peak):
            at = peak_within(plan, (t for t in plan.order if drawn(t)))
            if at is not None:
                info = peak_info(plan, at)
        live = {p.tensor for p in info["live"]}
        peak, live_bytes = info["node"], info["live_bytes"]
    return DrawContext(graph, plan, where, {t: i for i, t in enumerate(graph.nodes)},
                       {t: i for i, t in enumerate(graph.leafs)}, step, live, peak,
                       graph_peak, live_bytes, graph_bytes)


def node_id(c: DrawContext, t: Tensor) -> str:
    """DOT id of a drawn tensor: n{node index} or l{leaf index}."""
    i = c.index.get(t)
    return f"n{i}" if i is not None else f"l{c.leaf_index[t]}"


# -- a drawn tensor -----------------------------------------------------------------------------

def node_attrs(c: DrawContext, t: Tensor) -> dict[str, str]:
    """Attributes of one drawn tensor: an HTML label of rows, fill, shape, border."""
    rows = [f"<B>{esc(display_name(t))}</B>"]
    attrs: dict[str, str] = {}
    if t.op is None:
        kind = leaf_kind(t)
        fill, shape = LEAF_STYLE[kind]
        where = {"weight": "weight", "input": "input", "cache": f"{t.buffer}",
                 "leaf": "leaf"}[kind]
        rows.append(f"<FONT POINT-SIZE=\"9\">{where}  {t.type} {ne_text(t)}</FONT>")
        attrs.update(shape=shape, style="filled", fillcolor=fill)
        if kind == "input":
            attrs.update(color="#238b45", penwidth="1.6")
    else:
        fam = family(t)
        fill = FAMILIES.get(fam, "#eeeeee")
        idx = c.step.get(t, c.index.get(t))
        rows.append(f"{esc(_op_text(t))}  <FONT COLOR=\"#555555\">#{idx}</FONT>")
        rows.append(f"<FONT POINT-SIZE=\"9\">{t.type} {ne_text(t)}</FONT>")
        if t.is_view:
            attrs.update(style="dashed,rounded,filled", fillcolor=fill, color="#888888",
                         fontcolor="#444444")
        else:
            attrs.update(style="rounded,filled", fillcolor=fill)
    if c.plan is not None:
        rows += _plan_rows(c, t)
    if t.is_output:
        rows.append(f"<FONT COLOR=\"{OUTPUT_COLOR}\"><B>OUTPUT</B></FONT>")
        attrs.update(peripheries="2", color=OUTPUT_COLOR)
    if t in c.live:
        attrs.update(color=PEAK_COLOR, penwidth="3")
    if c.peak_node is t:
        what = "▲ PEAK of the drawn layers: their high-water mark" if c.local_peak else \
            "▲ PEAK: runs at the high-water mark"
        rows.append(f"<FONT COLOR=\"{PEAK_COLOR}\"><B>{what}</B></FONT>")
    attrs["label"] = "<" + "<BR/>".join(rows) + ">"
    return attrs


def _plan_rows(c: DrawContext, t: Tensor) -> list[str]:
    plan = c.plan
    assert plan is not None
    p = plan.placements.get(t)
    if p is not None:
        last = str(p.last) if p.freed else "end"
        first = "in" if p.first < 0 else str(p.first)
        row = (f"@ {human(p.offset)}  <B>{human(p.size)}</B>  "
               f"<FONT COLOR=\"#555555\">steps {first}–{last}</FONT>")
        out = [f"<FONT POINT-SIZE=\"9\">{row}</FONT>"]
        if p.reused is not None:
            out.append(f"<FONT POINT-SIZE=\"9\" COLOR=\"{INPLACE_COLOR}\">in place of "
                       f"{esc(display_name(p.reused.owner), 30)}</FONT>")
        if t in c.live:
            out.append(f"<FONT POINT-SIZE=\"9\" COLOR=\"{PEAK_COLOR}\"><B>live at the peak"
                       f"</B></FONT>")
        return out
    if t.is_view and t.view_src is not None and t.view_src in plan:
        root = t.view_src
        return [(f"<FONT POINT-SIZE=\"9\" COLOR=\"#555555\">aliases "
                 f"{esc(display_name(root), 28)} +{human(t.view_offs)}</FONT>")]
    if t.is_preallocated:
        return [(f"<FONT POINT-SIZE=\"9\" COLOR=\"#555555\">{t.owner.buffer or 'host'} buffer, "
                f"{human(t.owner.nbytes)}</FONT>")]
    return []


def attr_str(attrs: dict[str, str]) -> str:
    """DOT attributes; an HTML label (<...>) goes unquoted."""
    return "[" + ", ".join(f"{k}={v}" if k == "label" and v.startswith("<") else f'{k}="{v}"'
                           for k, v in attrs.items()) + "]"


# -- writing ------------------------------------------------------------------------------------

class Writer:
    """DOT lines, indented by the depth of the subgraph being written."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 1

    def add(self, s: str) -> None:
        self.lines.append("  " * self.depth + s)


def write_header(w: Writer, c: DrawContext, layers: tuple[int, int] | None, title: str,
                 n_nodes: int, n_leafs: int, extra: str = "",
                 keys: list[str] | None = None) -> None:
    """Graph, node and edge defaults, and the title: what is drawn, the plan, the keys and
    the legend. `extra`: more graph attributes, each followed by ", "; `keys`: more keys (HTML
    text) after the line styles'."""
    graph = c.graph
    have = graph_layers(graph)
    what = "whole graph" if layers is None else (
        f"layer {layers[0]}" if layers[0] == layers[1] else f"layers {layers[0]}-{layers[1]}")
    of = f" of {layer_span(have)}" if have and layers is not None else ""
    lines = [f"<B>{esc(title, 120)}</B>"] if title else []
    lines.append(f"{what}{of}: {n_nodes} nodes, {n_leafs} leafs drawn "
                 f"(graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs)")
    if c.plan is not None:
        lines.append(_plan_line(c))
    lines.append(_keys(c, keys or []))
    br = '<BR ALIGN="LEFT"/>'
    w.add(f"graph [fontname=\"Helvetica\", fontsize=12, rankdir=TB, {extra}"
          "nodesep=0.25, ranksep=0.32, labelloc=t, labeljust=l, "
          f"label=<{br.join(lines)}{br}>];")
    w.add("node [fontname=\"Helvetica\", fontsize=10, shape=box, margin=\"0.10,0.04\"];")
    w.add("edge [color=\"#555555\", arrowsize=0.6];")
    w.add(f"legend [shape=plaintext, label=<{_legend(graph)}>];")


def _plan_line(c: DrawContext) -> str:
    plan = c.plan
    assert plan is not None
    base = f" (ggml-alloc's rules: {human(plan.ggml_size)})" \
        if plan.baseline is not None and plan.ggml_size != plan.size else ""
    s = f"{plan.name} compute buffer {human(plan.size)}{base}"
    if c.graph_peak is not None and c.local_peak:
        # the buffer's size is set outside the picture: say where, then outline what is here
        il = c.where.get(c.graph_peak, (None,))[0]
        at, go = (f"in layer {il}", f"draw it: --layer {il}") if il is not None else \
            ("outside the layers", "the summary shows it: --summary")
        s += (f"; graph peak ({human(c.graph_live_bytes)} live) at step {plan.peak_step}, "
              f"{esc(display_name(c.graph_peak))} {at}: not drawn here ({go})")
        if c.peak_node is not None:
            s += (f'<BR ALIGN="LEFT"/>outlined instead: the drawn layers\' own peak at step '
                  f"{c.step[c.peak_node]}, {esc(display_name(c.peak_node))}: "
                  f"{human(c.live_bytes)} live in {len(c.live)} tensors (red outlines)")
    elif c.peak_node is not None:
        il = c.where.get(c.peak_node, (None,))[0]
        at = f" in layer {il}" if il is not None else ""
        s += (f"; peak at step {plan.peak_step}, {esc(display_name(c.peak_node))}{at}: "
              f"{human(c.live_bytes)} live in {len(c.live)} tensors (red outlines)")
    return s


def _legend(graph: Graph) -> str:
    """Colour swatches of the op families and leaf kinds this graph has."""
    fams = {family(t) for t in graph.nodes}
    kinds = {leaf_kind(t) for t in graph.leafs}
    cells = [f"<TD BGCOLOR=\"{col}\" BORDER=\"1\">{f}</TD>" for f, col in FAMILIES.items()
             if f in fams]
    cells += [f"<TD BGCOLOR=\"{LEAF_STYLE[k][0]}\" BORDER=\"1\">{k}</TD>"
              for k in LEAF_STYLE if k in kinds]
    return ("<TABLE BORDER=\"0\" CELLBORDER=\"0\" CELLSPACING=\"2\" CELLPADDING=\"3\"><TR>"
            + "".join(cells) + "</TR></TABLE>")


def _keys(c: DrawContext, more: list[str]) -> str:
    """What line styles mean (in the title: under the swatches graphviz would stretch them)."""
    keys = ["dashed: view (no memory of its own)",
            f"<FONT COLOR=\"{OUTPUT_COLOR}\">double border: output</FONT>"]
    if c.plan is not None:
        keys += [f"<FONT COLOR=\"{INPLACE_COLOR}\">orange edge: in place</FONT>",
                 f"<FONT COLOR=\"{PEAK_COLOR}\">red outline: live at the peak</FONT>",
                 "@ offset  size  steps first–last"]
    keys += more
    return f"<FONT POINT-SIZE=\"10\">{'   ·   '.join(keys)}</FONT>"


__all__ = ["FAMILIES", "INPLACE_COLOR", "LEAF_STYLE", "OUTPUT_COLOR", "PEAK_COLOR",
           "DrawContext", "Writer", "attr_str", "display_name", "draw_context", "esc", "family",
           "human", "leaf_kind", "ne_text", "node_attrs", "node_id", "write_header"]
