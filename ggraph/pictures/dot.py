"""Graph pictures: a Graph (and, optionally, its memory Plan) as Graphviz DOT, rendered to
SVG/PNG/PDF through the `graphviz` package and Graphviz's `dot` program.

This file owns what a picture shows: every node with its name, op, type and ne; layers
(tensor names ending in `-{il}`, weights `blk.{il}.*`, caches `*_l{il}`) as clusters,
split-attention steps (`-{il}-s{step}`) as nested clusters; a layer filter that draws part of
the graph with its outside neighbours as stubs; with a plan, in-place reuse as an edge style of
its own, and a peak the picture holds (a layer picture without the graph's peak outlines the
layer's own high-water mark and says where the graph's is). A graph too big to read is
refused with a suggestion instead of drawn as a hairball.
It also writes and renders the files. The rest lives apart: how a tensor reads (colours of op
families, leaf shapes, plan rows, the peak outlined red) in ggraph.pictures.dot_style, layers from
names
in ggraph.pictures.dot_layers, the summary (one box per layer) in ggraph.pictures.dot_summary, the
errors in
ggraph.pictures.dot_errors; this module re-exports their public names.
ggml_graph_dump_dot (facts page section 4) is the starting point: its record nodes, pink leafs
and `src j` edges become coloured HTML-label nodes, shaped leafs and labels only where the
source order matters (ops whose record sets src_labels).
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ggraph.pictures.dot_errors import DotError, DotNotInstalledError, GraphTooLargeError, \
    UnknownLayerError
from ggraph.pictures.dot_layers import (Where, assign_layers, check_layers, graph_layers,
                                        layer_span, parse_layers, where_by_name)
from ggraph.pictures.dot_style import (FAMILIES, INPLACE_COLOR, LEAF_STYLE, OUTPUT_COLOR,
                                       PEAK_COLOR, DrawContext, Writer, attr_str, display_name,
                                       draw_context, esc, family, human, leaf_kind, ne_text,
                                       node_attrs, node_id, write_header)
from ggraph.pictures.dot_summary import summary_dot
from ggraph.ir.graph import Graph
from ggraph.ir.opkind import OpKind
from ggraph.ops.registry import get_op
from ggraph.ir.tensor import Tensor

if TYPE_CHECKING:
    from ggraph.plan.alloc import Plan

DEFAULT_MAX_NODES = 400     # past this a drawing of the whole graph does not read
FORMATS = ("dot", "svg", "png", "pdf")
INSTALL_HINT = ("install Graphviz: `apt-get install graphviz` (Debian/Ubuntu), "
                "`brew install graphviz` (macOS), or `bash scripts/setup.sh --test`")


# -- the picture --------------------------------------------------------------------------------

def _drawn(t: Tensor, views: bool) -> Tensor:
    """With views hidden, a view is drawn as the tensor it reads (through chains of views)."""
    while not views and family(t) == "view" and t.src and t.src[0] is not None:
        t = t.src[0]
    return t


def to_dot(graph: Graph, plan: Plan | None = None, *, layers: tuple[int, int] | None = None,
           summary: bool = False, clusters: bool = True, views: bool = True,
           max_nodes: int = DEFAULT_MAX_NODES, title: str = "",
           node_seconds: Mapping[Tensor, float] | None = None) -> str:
    """DOT source of `graph` (with `plan`: offsets, sizes, in-place edges, the peak).

    layers=(a, b) draws layers a..b only (their outside sources and consumers as stubs);
    summary=True draws one box per layer; clusters groups nodes per layer and split step;
    views=False draws edges through view nodes. A drawing of more than `max_nodes` tensors
    (0: no limit) raises GraphTooLargeError naming a filter that works. With a layer filter
    that leaves the plan's peak out, the drawn layers' own peak is outlined and the title
    says where the graph's lies. `node_seconds` (seconds per node, from a profile) puts each
    layer's time in the summary."""
    if layers is not None:
        check_layers(graph, layers)
    c = draw_context(graph, plan, layers, globals_drawn=summary)   # the summary draws them
    if summary:
        return summary_dot(c, layers, title, max_nodes, node_seconds)

    def inside(t: Tensor) -> bool:
        il = c.where[t][0]
        return layers is None or (il is not None and layers[0] <= il <= layers[1])

    sel = [t for t in graph.nodes if inside(t) and (views or family(t) != "view")]
    chosen = set(sel)
    # dicts as ordered sets: leafs and stubs are drawn in the order they are first met
    leafs: dict[Tensor, None] = {}
    stubs_in: dict[Tensor, None] = {}
    for t in sel:
        for s in t.src:
            if s is None:
                continue
            s = _drawn(s, views)
            if s.op is None:
                leafs.setdefault(s)
            elif s not in chosen:
                stubs_in.setdefault(s)
    consumers: dict[Tensor, list[Tensor]] = defaultdict(list)   # drawn tensor -> readers
    for t in graph.nodes:                                       # outside the drawing
        if inside(t) or (not views and family(t) == "view"):
            continue
        for s in t.src:
            if s is not None and (d := _drawn(s, views)) in chosen and t not in consumers[d]:
                consumers[d].append(t)
    n_draw = len(sel) + len(leafs)
    if max_nodes and n_draw > max_nodes:
        raise GraphTooLargeError(_too_large(graph, n_draw, max_nodes, layers))

    w = Writer()
    w.lines.append("digraph ggraph {")
    # split steps: dot's crossing minimisation shuffles sibling clusters (rank=same, flat
    # edges and ordering=out do not hold them); a short mincross keeps them in input order
    has_steps = any(c.where[t][1] is not None for t in sel) and clusters
    write_header(w, c, layers, title, len(sel), len(leafs),
                 "mclimit=0.1, " if has_steps else "")
    # clusters: layer -> step -> tensors; global nodes and leafs outside
    groups: dict[int | None, dict[int | None, list[Tensor]]] = defaultdict(
        lambda: defaultdict(list))
    for t in list(leafs) + sel:   # shared inputs (mask, positions) have no layer
        il, st = c.where[t] if clusters else (None, None)
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
                w.add(f"{node_id(c, t)} {attr_str(node_attrs(c, t))};")
            if st is not None:
                w.depth -= 1
                w.add("}")
        if il is not None:
            w.depth -= 1
            w.add("}")
    for s in stubs_in:
        il = c.where[s][0]
        where = f" (layer {il})" if il is not None else ""
        # a source from another layer that is live at the outlined peak is outlined too
        line = f"color=\"{PEAK_COLOR}\", penwidth=\"2\"" if s in c.live else \
            "color=\"#999999\""
        w.add(f"{node_id(c, s)} [shape=box, style=\"dashed,rounded\", {line}, "
              f"fontcolor=\"#666666\", fontsize=9, label=<from {esc(display_name(s))}{where}"
              f"<BR/>{s.type} {ne_text(s)}>];")
    _edges(w, c, sel, views)
    for k, (src, users) in enumerate(consumers.items()):
        names = ", ".join(esc(display_name(u), 24) for u in users[:2]) + \
            (f" +{len(users) - 2}" if len(users) > 2 else "")
        w.add(f"out{k} [shape=plaintext, fontsize=9, fontcolor=\"#666666\", label=<to {names}>];")
        w.add(f"{node_id(c, src)} -> out{k} [style=dashed, color=\"#999999\"];")
    w.lines.append("}")
    return "\n".join(w.lines) + "\n"


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


def _edges(w: Writer, c: DrawContext, sel: list[Tensor], views: bool) -> None:
    reused: dict[Tensor, Tensor] = {}      # tensor -> the source it runs in place on
    if c.plan is not None:
        reused = {p.tensor: p.reused for p in c.plan.placements.values()
                  if p.reused is not None}
    for t in sel:
        srcs = [(j, s) for j, s in enumerate(t.src) if s is not None]
        for j, s in srcs:
            d = _drawn(s, views)
            attrs: dict[str, str] = {}
            if len(srcs) > 1 and t.op is not None and get_op(t.op).src_labels:
                attrs.update(label=f"src{j}", fontsize="8", fontcolor="#777777")
            st_s, st_t = c.where[d][1], c.where[t][1]
            if st_s is not None and st_t is not None and st_s != st_t:
                attrs["constraint"] = "false"   # step k+1's copy waits for step k's: keep
                #                                 the steps side by side, not a staircase
            if reused.get(t) is s:
                attrs.update(color=INPLACE_COLOR, penwidth="2.5", style="bold",
                             arrowhead="empty", label="in place", fontcolor=INPLACE_COLOR,
                             fontsize="9")
            elif d.op is None:
                attrs.update(color="#aaaaaa")
            elif family(d) == "view" or d.is_view:
                attrs.update(style="dashed")
            w.add(f"{node_id(c, d)} -> {node_id(c, t)}" + (f" {attr_str(attrs)}" if attrs else "")
                  + ";")


def _too_large(graph: Graph, n: int, limit: int, layers: tuple[int, int] | None) -> str:
    have = graph_layers(graph)
    if layers is not None:
        return (f"layers {layers[0]}-{layers[1]} are {n} tensors to draw, more than "
                f"max_nodes={limit}: a picture that big does not read. Draw fewer layers "
                f"(--layer {layers[0]}), the summary (--summary), or raise --max-nodes")
    hint = (f"one layer (--layer {have[0]}; this graph has layers {layer_span(have)}), a range "
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


# the names of dot_errors, dot_layers and dot_style that callers use through ggraph.pictures.dot
__all__ = ["DEFAULT_MAX_NODES", "FAMILIES", "FORMATS", "INPLACE_COLOR", "LEAF_STYLE",
           "OUTPUT_COLOR", "PEAK_COLOR", "DotError", "DotNotInstalledError",
           "GraphTooLargeError", "UnknownLayerError", "Where", "assign_layers", "check_layers",
           "family", "graph_layers", "human", "leaf_kind", "parse_layers", "render", "to_dot",
           "where_by_name", "write"]
