"""Layers and split-attention steps of a graph, read from tensor names by llama.cpp's
conventions, and the layer filters of `ggraph dot`.

Layers are tensor names ending in `-{il}` (also `-{il}_{suffix}`), weights `blk.{il}.*` and
caches `*_l{il}`; split-attention steps are `-{il}-s{step}`. Pictures use them for clusters
(ggraph.pictures.dot) and layer boxes (ggraph.pictures.dot_summary).
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

from ggraph.pictures.dot_errors import DotError, UnknownLayerError
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor

Where = tuple["int | None", "int | None"]   # (layer, split step)

_SPLIT = re.compile(r"-(\d+)-s(\d+)$")
_LAYER = re.compile(r"-(\d+)(?:_[A-Za-z]\w*)?$")   # "ffn_gate-3" and also "ffn-3_gate"
_WEIGHT = re.compile(r"^blk\.(\d+)\.")
_CACHE = re.compile(r"_l(\d+)$")


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


def assign_layers(graph: Graph) -> dict[Tensor, Where]:
    """(layer, step) of every node and leaf. Named nodes without a layer stay global
    (result_norm). Unnamed nodes (llama's get_rows on out_ids in the last layer) join the
    layer of their first consumer that has one (walking backwards, so chains of unnamed nodes
    resolve), else the highest layer among their sources."""
    out: dict[Tensor, Where] = {t: where_by_name(t.name) for t in graph.leafs}
    unnamed: list[Tensor] = []
    users: dict[Tensor, list[Tensor]] = defaultdict(list)
    for t in graph.nodes:
        out[t] = where_by_name(t.name)
        if not t.name.split(" (", 1)[0]:
            unnamed.append(t)
        for s in t.src:
            if s is not None:
                users[s].append(t)
    for t in reversed(unnamed):
        il = next((out[u][0] for u in users[t] if out[u][0] is not None), None)
        if il is None:
            il = max((out[s][0] for s in t.src if s is not None and s.op is not None
                      and out[s][0] is not None), default=None)
        out[t] = (il, None)
    return out


def graph_layers(graph: Graph) -> list[int]:
    """The layer numbers that the graph's nodes belong to, sorted."""
    where = assign_layers(graph)
    return sorted({where[t][0] for t in graph.nodes if where[t][0] is not None})


def parse_layers(spec: str) -> tuple[int, int]:
    """"3" -> (3, 3), "2-5" -> (2, 5); DotError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", spec)
    if not m:
        raise DotError(f"layers must be N or A-B (e.g. 3 or 0-2), got {spec!r}")
    a, b = int(m.group(1)), int(m.group(2) or m.group(1))
    if b < a:
        raise DotError(f"layer range {spec!r} is reversed: write {b}-{a}")
    return a, b


def layer_span(layers: Sequence[int]) -> str:
    """Layer numbers for a message: "0-29" when consecutive, else listed."""
    if not layers:
        return "none"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ", ".join(map(str, layers))


def check_layers(graph: Graph, layers: tuple[int, int]) -> None:
    """UnknownLayerError unless both ends of the filter are layers of the graph."""
    have = graph_layers(graph)
    if not have:
        raise UnknownLayerError(
            f"layer filter {layers[0]}-{layers[1]}: this graph has no layers (no node name ends "
            f"in -N or contains -N-sK, llama.cpp's naming); draw it whole or as a summary")
    missing = [il for il in (layers[0], layers[1]) if il not in have]
    if missing:
        raise UnknownLayerError(f"layer {missing[0]} is not in this graph: its layers are "
                                f"{layer_span(have)} ({len(have)} layers)")


__all__ = ["Where", "assign_layers", "check_layers", "graph_layers", "layer_span",
           "parse_layers", "where_by_name"]
