"""Graph pictures: a Graph (and, optionally, its memory Plan) as Graphviz DOT, rendered to
SVG/PNG/PDF through the `graphviz` package and Graphviz's `dot` program.

This file owns what a picture shows and how it reads. Every node shows its name, op, type and
ne; colours say the op family; leafs (weights, inputs, the KV cache) and outputs have their own
shapes. With a plan, each tensor shows its offset, size and lifetime, in-place reuse is an edge
style of its own and the tensors live at the peak are outlined red. Big graphs stay readable:
layers (tensor names ending in `-{il}`, weights `blk.{il}.*`, caches `*_l{il}`) become
clusters, split-attention steps (`-{il}-s{step}`) nested clusters, a layer filter draws part
of the graph with its outside neighbours as stubs, and a summary collapses each layer to a box.
A graph too big to read is refused with a suggestion instead of drawn as a hairball.
ggml_graph_dump_dot (facts page section 4) is the starting point: its record nodes, pink leafs
and `src j` edges become coloured HTML-label nodes, shaped leafs and labels only where the
source order matters.
"""
from __future__ import annotations

import html
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ggraph.graph import Graph
from ggraph.opkind import OpKind
from ggraph.tensor import Tensor

if TYPE_CHECKING:
    from ggraph.alloc import Plan

MIB = 1 << 20
DEFAULT_MAX_NODES = 400     # past this a drawing of the whole graph does not read
FORMATS = ("dot", "svg", "png", "pdf")
INSTALL_HINT = ("install Graphviz: `apt-get install graphviz` (Debian/Ubuntu), "
                "`brew install graphviz` (macOS), or `bash scripts/setup.sh --test`")

# op family -> (fill colour, ops); the legend lists the families a picture uses in this order
FAMILIES: dict[str, tuple[str, frozenset[OpKind]]] = {
    "matmul": ("#9ecae1", frozenset({OpKind.MUL_MAT, OpKind.MUL_MAT_ID})),
    "attention": ("#fdae6b", frozenset({OpKind.SOFT_MAX, OpKind.FLASH_ATTN_EXT})),
    "rope": ("#cbc3e3", frozenset({OpKind.ROPE})),
    "norm": ("#a1d99b", frozenset({OpKind.RMS_NORM, OpKind.NORM})),
    "arithmetic": ("#fff3a3", frozenset({OpKind.ADD, OpKind.MUL, OpKind.DIV, OpKind.SCALE,
                                         OpKind.CLAMP, OpKind.FILL})),
    "activation": ("#f4b6c2", frozenset({OpKind.SILU, OpKind.GELU, OpKind.SIGMOID,
                                         OpKind.SWIGLU})),
    "copy/rows": ("#e3cfae", frozenset({OpKind.CPY, OpKind.CONT, OpKind.GET_ROWS,
                                        OpKind.SET_ROWS, OpKind.CONCAT, OpKind.REPEAT})),
    "reduce": ("#99d8c9", frozenset({OpKind.SUM_ROWS, OpKind.ARGSORT, OpKind.TOP_K})),
    "view": ("#ffffff", frozenset({OpKind.VIEW, OpKind.RESHAPE, OpKind.PERMUTE,
                                   OpKind.TRANSPOSE})),
}
_FAMILY_OF = {op: fam for fam, (_, ops) in FAMILIES.items() for op in ops}
# leaf kinds -> (fill, shape)
LEAF_STYLE = {"weight": ("#fbd3e9", "box"), "input": ("#c7e9c0", "box"),
              "cache": ("#dadaeb", "cylinder"), "leaf": ("#f0f0f0", "box")}
PEAK_COLOR = "#d7191c"
INPLACE_COLOR = "#e66101"
OUTPUT_COLOR = "#08519c"

_SPLIT = re.compile(r"-(\d+)-s(\d+)$")
_LAYER = re.compile(r"-(\d+)(?:_[A-Za-z]\w*)?$")   # "ffn_gate-3" and also "ffn-3_gate"
_WEIGHT = re.compile(r"^blk\.(\d+)\.")
_CACHE = re.compile(r"_l(\d+)$")


class DotError(ValueError):
    """A picture that cannot be drawn as asked (bad filter, too large, unknown format)."""


class UnknownLayerError(DotError):
    """A layer filter names a layer the graph does not have."""


class GraphTooLargeError(DotError):
    """Too many tensors to draw readably; the message names a filter that works."""


class DotNotInstalledError(RuntimeError):
    """Graphviz's `dot` program is missing; `dot_path` holds the DOT source written anyway."""

    def __init__(self, message: str, dot_path: Path | None = None) -> None:
        super().__init__(message)
        self.dot_path = dot_path


# -- layers -------------------------------------------------------------------------------------

Where = tuple["int | None", "int | None"]   # (layer, split step)


def where_by_name(name: str) -> Where:
    """(layer, step) from a tensor name by llama.cpp's conventions, (None, None) if none.

    Derived names keep their base in front ("Kcur-3 (roped) (reshaped)", "kqv_split-3-s1 (copy
    of ...)"), so only the part before the first " (" counts."""
    base = name.split(" (", 1)[0]
    if m := _SPLIT.search(base):
        return int(m.group(1)), int(m.group(2))
    for rx in (_LAYER, _WEIGHT, _CACHE):
        if m := rx.search(base):
            return int(m.group(1)), None
    return None, None


def assign_layers(graph: Graph) -> dict[int, Where]:
    """id(tensor) -> (layer, step) for every node and leaf. Named nodes without a layer stay
    global (result_norm). Unnamed nodes (llama's get_rows on out_ids in the last layer) join
    the layer of their first consumer that has one (walking backwards, so chains of unnamed
    nodes resolve), else the highest layer among their sources."""
    out: dict[int, Where] = {id(t): where_by_name(t.name) for t in graph.leafs}
    unnamed: list[Tensor] = []
    users: dict[int, list[Tensor]] = defaultdict(list)
    for t in graph.nodes:
        out[id(t)] = where_by_name(t.name)
        if not t.name.split(" (", 1)[0]:
            unnamed.append(t)
        for s in t.src:
            if s is not None:
                users[id(s)].append(t)
    for t in reversed(unnamed):
        il = next((out[id(u)][0] for u in users[id(t)] if out[id(u)][0] is not None), None)
        if il is None:
            il = max((out[id(s)][0] for s in t.src if s is not None and s.op is not None
                      and out[id(s)][0] is not None), default=None)
        out[id(t)] = (il, None)
    return out


def graph_layers(graph: Graph) -> list[int]:
    """The layer numbers that the graph's nodes belong to, sorted."""
    w = assign_layers(graph)
    return sorted({w[id(t)][0] for t in graph.nodes if w[id(t)][0] is not None})


def parse_layers(spec: str) -> tuple[int, int]:
    """"3" -> (3, 3), "2-5" -> (2, 5); DotError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if not m:
        raise DotError(f"layers must be N or A-B (e.g. 3 or 0-2), got {spec!r}")
    a, b = int(m.group(1)), int(m.group(2) or m.group(1))
    if b < a:
        raise DotError(f"layer range {spec!r} is reversed: write {b}-{a}")
    return a, b


def _span(layers: Sequence[int]) -> str:
    if not layers:
        return "none"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ", ".join(map(str, layers))


def check_layers(graph: Graph, layers: tuple[int, int]) -> None:
    have = graph_layers(graph)
    if not have:
        raise UnknownLayerError(
            f"layer filter {layers[0]}-{layers[1]}: this graph has no layers (no node name ends "
            f"in -N or contains -N-sK, llama.cpp's naming); draw it whole or as a summary")
    missing = [il for il in (layers[0], layers[1]) if il not in have]
    if missing:
        raise UnknownLayerError(f"layer {missing[0]} is not in this graph: its layers are "
                                f"{_span(have)} ({len(have)} layers)")


# -- labels -------------------------------------------------------------------------------------

def human(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _ne(t: Tensor) -> str:
    return "[" + ", ".join(str(x) for x in t.ne[:max(t.n_dims, 2)]) + "]"


def _esc(s: str, limit: int = 44) -> str:
    if len(s) > limit:   # long derived names: keep the base and the end, which say the most
        s = s[:limit - 15] + "…" + s[-14:]
    return html.escape(s, quote=True)


def _name(t: Tensor) -> str:
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
    return "leaf" if t.op is None else _FAMILY_OF.get(t.op, "other")


def _op_text(t: Tensor) -> str:
    from ggraph.ops.registry import REGISTRY

    sym = REGISTRY[t.op].symbol if t.op in REGISTRY else str(t.op)
    return str(t.op) if sym == str(t.op) else f"{sym}  {t.op}"


# -- the picture --------------------------------------------------------------------------------

@dataclass
class _Ctx:
    graph: Graph
    plan: Plan | None
    where: dict[int, Where]
    index: dict[int, int]          # id -> node index in graph.nodes
    leaf_index: dict[int, int]     # id -> leaf index (Tensor.id repeats across contexts)
    step: dict[int, int]           # id -> step in plan.order
    live: set[int]                 # ids live at the peak
    peak_node: Tensor | None


def _plan_ctx(graph: Graph, plan: Plan | None) -> _Ctx:
    step: dict[int, int] = {}
    live: set[int] = set()
    peak = None
    if plan is not None:
        if plan.graph is not graph:
            raise DotError("the plan was made for another graph: plan this graph (or pass the "
                           "graph the plan belongs to, plan.graph)")
        from ggraph.alloc_report import peak_info

        step = {id(t): i for i, t in enumerate(plan.order)}
        info = peak_info(plan)
        live = {id(p.tensor) for p in info["live"]}
        peak = info["node"]
    return _Ctx(graph, plan, assign_layers(graph), {id(t): i for i, t in enumerate(graph.nodes)},
                {id(t): i for i, t in enumerate(graph.leafs)}, step, live, peak)


def _node_attrs(c: _Ctx, t: Tensor) -> dict[str, str]:
    """Attributes of one drawn tensor: an HTML label of rows, fill, shape, border."""
    rows = [f"<B>{_esc(_name(t))}</B>"]
    attrs: dict[str, str] = {}
    if t.op is None:
        kind = leaf_kind(t)
        fill, shape = LEAF_STYLE[kind]
        where = {"weight": "weight", "input": "input", "cache": f"{t.buffer}",
                 "leaf": "leaf"}[kind]
        rows.append(f"<FONT POINT-SIZE=\"9\">{where}  {t.type} {_ne(t)}</FONT>")
        attrs.update(shape=shape, style="filled", fillcolor=fill)
        if kind == "input":
            attrs.update(color="#238b45", penwidth="1.6")
    else:
        fam = family(t)
        fill = FAMILIES.get(fam, ("#eeeeee",))[0]
        idx = c.step.get(id(t), c.index.get(id(t)))
        rows.append(f"{_esc(_op_text(t))}  <FONT COLOR=\"#555555\">#{idx}</FONT>")
        rows.append(f"<FONT POINT-SIZE=\"9\">{t.type} {_ne(t)}</FONT>")
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
    if id(t) in c.live:
        attrs.update(color=PEAK_COLOR, penwidth="3")
    if c.peak_node is t:
        rows.append(f"<FONT COLOR=\"{PEAK_COLOR}\"><B>▲ PEAK: runs at the high-water mark"
                    f"</B></FONT>")
    attrs["label"] = "<" + "<BR/>".join(rows) + ">"
    return attrs


def _plan_rows(c: _Ctx, t: Tensor) -> list[str]:
    plan = c.plan
    assert plan is not None
    p = plan.placements.get(id(t))
    if p is not None:
        last = str(p.last) if p.freed else "end"
        first = "in" if p.first < 0 else str(p.first)
        row = (f"@ {human(p.offset)}  <B>{human(p.size)}</B>  "
               f"<FONT COLOR=\"#555555\">steps {first}–{last}</FONT>")
        out = [f"<FONT POINT-SIZE=\"9\">{row}</FONT>"]
        if p.reused is not None:
            out.append(f"<FONT POINT-SIZE=\"9\" COLOR=\"{INPLACE_COLOR}\">in place of "
                       f"{_esc(_name(p.reused.owner), 30)}</FONT>")
        if id(t) in c.live:
            out.append(f"<FONT POINT-SIZE=\"9\" COLOR=\"{PEAK_COLOR}\"><B>live at the peak"
                       f"</B></FONT>")
        return out
    if t.is_view and t.view_src is not None and t.view_src in plan:
        root = t.view_src
        return [(f"<FONT POINT-SIZE=\"9\" COLOR=\"#555555\">aliases {_esc(_name(root), 28)} "
                f"+{human(t.view_offs)}</FONT>")]
    if t.is_preallocated:
        return [(f"<FONT POINT-SIZE=\"9\" COLOR=\"#555555\">{t.owner.buffer or 'host'} buffer, "
                f"{human(t.owner.nbytes)}</FONT>")]
    return []


def _attr_str(attrs: dict[str, str]) -> str:
    """DOT attributes; an HTML label (<...>) goes unquoted."""
    return "[" + ", ".join(f"{k}={v}" if k == "label" and v.startswith("<") else f'{k}="{v}"'
                           for k, v in attrs.items()) + "]"


def _drawn(t: Tensor, views: bool) -> Tensor:
    """With views hidden, a view is drawn as the tensor it reads (through chains of views)."""
    while not views and family(t) == "view" and t.src and t.src[0] is not None:
        t = t.src[0]
    return t


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 1

    def add(self, s: str) -> None:
        self.lines.append("  " * self.depth + s)


def to_dot(graph: Graph, plan: Plan | None = None, *, layers: tuple[int, int] | None = None,
           summary: bool = False, clusters: bool = True, views: bool = True,
           max_nodes: int = DEFAULT_MAX_NODES, title: str = "") -> str:
    """DOT source of `graph` (with `plan`: offsets, sizes, in-place edges, the peak).

    layers=(a, b) draws layers a..b only (their outside sources and consumers as stubs);
    summary=True draws one box per layer; clusters groups nodes per layer and split step;
    views=False draws edges through view nodes. A drawing of more than `max_nodes` tensors
    (0: no limit) raises GraphTooLargeError naming a filter that works."""
    if layers is not None:
        check_layers(graph, layers)
    c = _plan_ctx(graph, plan)
    if summary:
        from ggraph.dot_summary import summary_dot  # the summary view lives apart

        return summary_dot(c, layers, title, max_nodes)
    def inside(t: Tensor) -> bool:
        il = c.where[id(t)][0]
        return layers is None or (il is not None and layers[0] <= il <= layers[1])

    sel = [t for t in graph.nodes if inside(t) and (views or family(t) != "view")]
    chosen = {id(t) for t in sel}
    leafs: dict[int, Tensor] = {}
    stubs_in: dict[int, Tensor] = {}
    for t in sel:
        for s in t.src:
            if s is None:
                continue
            s = _drawn(s, views)
            if s.op is None:
                leafs.setdefault(id(s), s)
            elif id(s) not in chosen:
                stubs_in.setdefault(id(s), s)
    consumers: dict[int, list[Tensor]] = defaultdict(list)
    for t in graph.nodes:
        if inside(t) or (not views and family(t) == "view"):
            continue
        for s in t.src:
            if s is not None and id(d := _drawn(s, views)) in chosen and t not in consumers[id(d)]:
                consumers[id(d)].append(t)
    n_draw = len(sel) + len(leafs)
    if max_nodes and n_draw > max_nodes:
        raise GraphTooLargeError(_too_large(graph, n_draw, max_nodes, layers))

    w = _Writer()
    w.lines.append("digraph ggraph {")
    # split steps: dot's crossing minimisation shuffles sibling clusters (rank=same, flat
    # edges and ordering=out do not hold them); a short mincross keeps them in input order
    has_steps = any(c.where[id(t)][1] is not None for t in sel) and clusters
    _header(w, c, graph, layers, title, len(sel), len(leafs),
            "mclimit=0.1, " if has_steps else "")
    # clusters: layer -> step -> tensors; global nodes and leafs outside
    groups: dict[int | None, dict[int | None, list[Tensor]]] = defaultdict(
        lambda: defaultdict(list))
    for t in list(leafs.values()) + sel:   # shared inputs (mask, positions) have no layer
        il, st = c.where[id(t)] if clusters else (None, None)
        groups[il][st].append(t)
    for il in sorted(groups, key=lambda x: -1 if x is None else x):
        steps = groups[il]
        if il is not None:
            w.add(f"subgraph cluster_L{il} {{")
            w.depth += 1
            w.add(f"label=<<B>layer {il}</B>>; labeljust=l; style=\"rounded,filled\"; "
                  f"fillcolor=\"#f6f6f6\"; color=\"#aaaaaa\"; fontsize=14;")
        heads = _step_heads(steps)
        for st in sorted(steps, key=lambda x: -1 if x is None else x):
            if st is not None:
                w.add(f"subgraph cluster_L{il}_s{st} {{")
                w.depth += 1
                w.add(f"label=<split-attention step {st}{heads.get(st, '')}>; labeljust=l; "
                      f"style=\"rounded,filled\"; fillcolor=\"#fff8e7\"; color=\"#e0a030\"; "
                      f"fontsize=11;")
            for t in steps[st]:
                w.add(f"{_id(c, t)} {_attr_str(_node_attrs(c, t))};")
            if st is not None:
                w.depth -= 1
                w.add("}")
        if il is not None:
            w.depth -= 1
            w.add("}")
    for k, s in enumerate(stubs_in.values()):
        il = c.where[id(s)][0]
        where = f" (layer {il})" if il is not None else ""
        w.add(f"{_id(c, s)} [shape=box, style=\"dashed,rounded\", color=\"#999999\", "
              f"fontcolor=\"#666666\", fontsize=9, label=<from {_esc(_name(s))}{where}<BR/>"
              f"{s.type} {_ne(s)}>];")
    _edges(w, c, sel, views)
    for k, (tid, users) in enumerate(consumers.items()):
        names = ", ".join(_esc(_name(u), 24) for u in users[:2]) + \
            (f" +{len(users) - 2}" if len(users) > 2 else "")
        w.add(f"out{k} [shape=plaintext, fontsize=9, fontcolor=\"#666666\", label=<to {names}>];")
        src = next(t for t in sel if id(t) == tid)
        w.add(f"{_id(c, src)} -> out{k} [style=dashed, color=\"#999999\"];")
    w.lines.append("}")
    return "\n".join(w.lines) + "\n"


def _id(c: _Ctx, t: Tensor) -> str:
    i = c.index.get(id(t))
    return f"n{i}" if i is not None else f"l{c.leaf_index[id(t)]}"


def _step_heads(steps: dict[int | None, list[Tensor]]) -> dict[int, str]:
    """" · heads a-b" per split step, from the head count (ne[2]) of each step's K*Q."""
    out: dict[int, str] = {}
    h = 0
    for st in sorted(s for s in steps if s is not None):
        kq = next((t for t in steps[st] if t.op == OpKind.MUL_MAT and
                   t.name.startswith("kq-")), None)
        if kq is None:
            return {}
        n = kq.ne[2]
        out[st] = f" · heads {h}-{h + n - 1}" if n > 1 else f" · head {h}"
        h += n
    return out


def _edges(w: _Writer, c: _Ctx, sel: list[Tensor], views: bool) -> None:
    reused = {}
    if c.plan is not None:
        reused = {id(p.tensor): p.reused for p in c.plan.placements.values()
                  if p.reused is not None}
    for t in sel:
        srcs = [(j, s) for j, s in enumerate(t.src) if s is not None]
        for j, s in srcs:
            d = _drawn(s, views)
            attrs: dict[str, str] = {}
            if len(srcs) > 1 and t.op in (OpKind.MUL_MAT, OpKind.MUL_MAT_ID, OpKind.GET_ROWS,
                                          OpKind.SET_ROWS, OpKind.CPY, OpKind.CONCAT,
                                          OpKind.SOFT_MAX, OpKind.FLASH_ATTN_EXT, OpKind.ROPE,
                                          OpKind.DIV):
                attrs.update(label=f"src{j}", fontsize="8", fontcolor="#777777")
            st_s, st_t = c.where[id(d)][1], c.where[id(t)][1]
            if st_s is not None and st_t is not None and st_s != st_t:
                attrs["constraint"] = "false"   # step k+1's copy waits for step k's: keep
                #                                 the steps side by side, not a staircase
            if reused.get(id(t)) is s:
                attrs.update(color=INPLACE_COLOR, penwidth="2.5", style="bold",
                             arrowhead="empty", label="in place", fontcolor=INPLACE_COLOR,
                             fontsize="9")
            elif d.op is None:
                attrs.update(color="#aaaaaa")
            elif family(d) == "view" or d.is_view:
                attrs.update(style="dashed")
            w.add(f"{_id(c, d)} -> {_id(c, t)}" + (f" {_attr_str(attrs)}" if attrs else "")
                  + ";")


def _header(w: _Writer, c: _Ctx, graph: Graph, layers: tuple[int, int] | None, title: str,
            n_nodes: int, n_leafs: int, extra: str = "") -> None:
    have = graph_layers(graph)
    what = "whole graph" if layers is None else (
        f"layer {layers[0]}" if layers[0] == layers[1] else f"layers {layers[0]}-{layers[1]}")
    of = f" of {_span(have)}" if have and layers is not None else ""
    lines = [f"<B>{_esc(title, 120)}</B>"] if title else []
    lines.append(f"{what}{of}: {n_nodes} nodes, {n_leafs} leafs drawn "
                 f"(graph: {graph.n_nodes} nodes, {graph.n_leafs} leafs)")
    if c.plan is not None:
        lines.append(_plan_line(c))
    lines.append(_keys(c))
    br = '<BR ALIGN="LEFT"/>'
    w.add(f"graph [fontname=\"Helvetica\", fontsize=12, rankdir=TB, {extra}"
          "nodesep=0.25, ranksep=0.32, labelloc=t, labeljust=l, "
          f"label=<{br.join(lines)}{br}>];")
    w.add("node [fontname=\"Helvetica\", fontsize=10, shape=box, margin=\"0.10,0.04\"];")
    w.add("edge [color=\"#555555\", arrowsize=0.6];")
    w.add(f"legend [shape=plaintext, label=<{_legend(graph)}>];")


def _plan_line(c: _Ctx) -> str:
    plan = c.plan
    assert plan is not None
    base = f" (ggml-alloc's rules: {human(plan.ggml_size)})" \
        if plan.baseline is not None and plan.ggml_size != plan.size else ""
    s = f"{plan.name} compute buffer {human(plan.size)}{base}"
    if c.peak_node is not None:
        il = c.where.get(id(c.peak_node), (None,))[0]
        at = f" in layer {il}" if il is not None else ""
        live = sum(p.alloc_size for p in plan.placements.values() if id(p.tensor) in c.live)
        s += (f"; peak at step {plan.peak_step}, {_esc(_name(c.peak_node))}{at}: "
              f"{human(live)} live in {len(c.live)} tensors (red outlines)")
    return s


def _legend(graph: Graph) -> str:
    """Colour swatches of the op families and leaf kinds this graph has."""
    fams = {family(t) for t in graph.nodes}
    kinds = {leaf_kind(t) for t in graph.leafs}
    cells = [f"<TD BGCOLOR=\"{col}\" BORDER=\"1\">{f}</TD>" for f, (col, _) in FAMILIES.items()
             if f in fams]
    cells += [f"<TD BGCOLOR=\"{LEAF_STYLE[k][0]}\" BORDER=\"1\">{k}</TD>"
              for k in LEAF_STYLE if k in kinds]
    return ("<TABLE BORDER=\"0\" CELLBORDER=\"0\" CELLSPACING=\"2\" CELLPADDING=\"3\"><TR>"
            + "".join(cells) + "</TR></TABLE>")


def _keys(c: _Ctx) -> str:
    """What line styles mean (in the title: under the swatches graphviz would stretch them)."""
    keys = ["dashed: view (no memory of its own)",
            f"<FONT COLOR=\"{OUTPUT_COLOR}\">double border: output</FONT>"]
    if c.plan is not None:
        keys += [f"<FONT COLOR=\"{INPLACE_COLOR}\">orange edge: in place</FONT>",
                 f"<FONT COLOR=\"{PEAK_COLOR}\">red outline: live at the peak</FONT>",
                 "@ offset  size  steps first–last"]
    return f"<FONT POINT-SIZE=\"10\">{'   ·   '.join(keys)}</FONT>"


def _too_large(graph: Graph, n: int, limit: int, layers: tuple[int, int] | None) -> str:
    have = graph_layers(graph)
    if layers is not None:
        return (f"layers {layers[0]}-{layers[1]} are {n} tensors to draw, more than "
                f"max_nodes={limit}: a picture that big does not read. Draw fewer layers "
                f"(--layer {layers[0]}), the summary (--summary), or raise --max-nodes")
    hint = (f"one layer (--layer {have[0]}; this graph has layers {_span(have)}), a range "
            f"(--layers {have[0]}-{min(have[0] + 1, have[-1])}) or one box per layer "
            f"(--summary)") if have else \
        "the summary (--summary), or name nodes llama.cpp's way (-N suffixes) to filter layers"
    return (f"graph has {n} tensors to draw ({graph.n_nodes} nodes, {graph.n_leafs} leafs), "
            f"more than max_nodes={limit}: a picture that big does not read. Draw {hint}, or "
            f"raise --max-nodes (library: layers=(a, b), summary=True, max_nodes=N)")


# -- files and rendering --------------------------------------------------------------------------

def render(source: str, path: str | os.PathLike, fmt: str | None = None,
           dot_path: Path | None = None) -> Path:
    """Render DOT `source` to `path` (format from the suffix unless given) with Graphviz's
    `dot`. DotNotInstalledError, carrying `dot_path`, when the program is missing."""
    import graphviz

    out = Path(path)
    fmt = (fmt or out.suffix.lstrip(".")).lower()
    if fmt not in FORMATS or fmt == "dot":
        raise DotError(f"cannot render format {fmt!r}; use one of svg, png, pdf")
    try:
        data = graphviz.Source(source).pipe(format=fmt, engine="dot")
    except graphviz.ExecutableNotFound:
        where = f"; the DOT source is in {dot_path}" if dot_path else ""
        again = f", or run `dot -T{fmt} {dot_path} -o {out}`" if dot_path else ""
        raise DotNotInstalledError(
            f"Graphviz's `dot` program is not on PATH, so {out} was not rendered{where}. To "
            f"draw it, {INSTALL_HINT}; then run the same command again{again}",
            dot_path) from None
    except graphviz.CalledProcessError as e:
        msg = (e.stderr or b"").decode(errors="replace").strip()[-600:]
        raise DotError(f"dot failed to render {out}: {msg}") from None
    out.write_bytes(data)
    return out


def write(graph: Graph, path: str | os.PathLike, plan: Plan | None = None,
          **options: object) -> list[Path]:
    """Write the picture of `graph` to `path` (.dot, .svg, .png or .pdf). The DOT source is
    always written (beside a rendered file, with the suffix .dot) so it survives a missing
    `dot` program. Returns the files written; options are to_dot's."""
    out = Path(path)
    fmt = out.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise DotError(f"unknown picture format {out.suffix or '(no suffix)'!r} for {out}: "
                       f"use .dot, .svg, .png or .pdf")
    source = to_dot(graph, plan, **options)  # type: ignore[arg-type]
    dot_path = out if fmt == "dot" else out.with_suffix(".dot")
    dot_path.write_text(source)
    if fmt == "dot":
        return [dot_path]
    return [dot_path, render(source, out, fmt, dot_path)]


__all__ = ["DEFAULT_MAX_NODES", "FAMILIES", "FORMATS", "DotError", "DotNotInstalledError",
           "GraphTooLargeError", "UnknownLayerError", "assign_layers", "graph_layers",
           "parse_layers", "render", "to_dot", "where_by_name", "write"]
