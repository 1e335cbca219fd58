"""Reports of a memory plan (ggraph.plan.alloc.Plan) that people can read.

This file owns the presentation of plans: the llama.cpp-style size line
(`CPU compute buffer size = 99.38 MiB`), the comparison with ggml-alloc's plan, the tensors
live at the peak and what dominates it, the tensor table, the same as JSON, and a PNG memory
map (offset against node index, one rectangle per tensor, the peak marked). Partial plans from
an AllocError print the same way, with the error on top.
"""
from __future__ import annotations

import json
import textwrap
from typing import Any

from ggraph.plan.alloc import Placement, Plan
from ggraph.ir.tensor import fmt_ne
from ggraph.ir.types import MIB


def human(n: int) -> str:
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    if n >= 1024:
        return f"{n / 1024:.2f} KiB"
    return f"{n} B"


def _step(s: int) -> str:
    return "in" if s < 0 else str(s)


def _name(t: Any) -> str:
    return t.name or f"#{t.id}"


# -- text -----------------------------------------------------------------------------------

def size_lines(plan: Plan) -> list[str]:
    """`CPU compute buffer size = X MiB` and how the plan compares with ggml-alloc's."""
    need = plan.needed
    over = f" (over max_bytes = {human(plan.max_bytes)})" \
        if plan.max_bytes is not None and need > plan.max_bytes else ""
    lines = [f"{plan.name} compute buffer size = {need / MIB:.2f} MiB{over}"]
    if plan.baseline is not None:
        g = plan.baseline.size
        d = g - need
        pct = f"saves {human(d)}, {100 * d / g:.1f}%" if d else "the same"
        best = plan.method if plan.complete else min(plan.candidates, key=plan.candidates.get)
        lines.append(f"  strategy {plan.strategy} (best candidate: {best}): "
                     f"{human(need)}; ggml-alloc's rules: {human(g)} ({pct})")
    else:
        lines.append(f"  strategy {plan.strategy}: {human(need)} (ggml-alloc's rules)")
    if not plan.complete:
        failed = plan.failed
        lines.append(f"  partial plan ({plan.method}): {len(plan.placements)} tensors placed in "
                     f"{human(plan.size)} before {_name(failed.tensor)} ({human(failed.size)}) "
                     f"did not fit at node {_step(failed.step)}")
    ps = plan.placements.values()
    n_inplace = sum(1 for p in ps if p.reused is not None)
    n_pre = sum(1 for p in ps if p.role != "node")
    lines.append(f"  {len(plan.placements)} planned tensors ({n_pre} leafs/inputs, "
                 f"{len(plan.placements) - n_pre} nodes, {n_inplace} in place) of "
                 f"{len(plan.graph.nodes)} nodes, {len(plan.graph.leafs)} leafs; alignment "
                 f"{plan.alignment}")
    if plan.reordered:
        lines.append("  nodes run in a new order that keeps every dependency: backends must "
                     "follow plan.order")
    return lines


def live_by_step(plan: Plan) -> list[int]:
    """Bytes live at each step: element s + 1 for step s (element 0: before node 0). An
    in-place child shares its parent's bytes at the hand-over step, so it counts from the
    step after (the rule that puts plan.peak_step where it is)."""
    n = len(plan.order)
    diff = [0] * (n + 2)
    for p in plan.placements.values():
        start = p.first + 1 if p.reused is not None else p.first
        if start <= p.last:
            diff[start + 1] += p.alloc_size
            diff[min(p.last, n - 1) + 2] -= p.alloc_size
    out, live = [], 0
    for i in range(n + 1):
        live += diff[i]
        out.append(live)
    return out


def peak_within(plan: Plan, nodes: Any, live: list[int] | None = None) -> int | None:
    """The first step among `nodes` (tensors of plan.order) with the most bytes live: the
    high-water mark of a part of the graph (one layer); None when none of them runs.
    `live`: live_by_step(plan), when the caller asks for many parts."""
    live = live_by_step(plan) if live is None else live
    want = set(nodes)
    steps = [i for i, t in enumerate(plan.order) if t in want]
    return max(steps, key=lambda i: (live[i + 1], -i)) if steps else None


def peak_info(plan: Plan, step: int | None = None) -> dict[str, Any]:
    """The step with the most bytes live (or the given step), the tensors live then, and the
    dominant one."""
    step = plan.peak_step if step is None else step
    live = plan.live_at(step)
    # at an in-place hand-over the parent and its child share bytes: list the child only
    handed = {p.reused.owner for p in live if p.reused is not None and p.first == step}
    uniq = sorted((p for p in live if p.tensor not in handed), key=lambda p: -p.alloc_size)
    live_bytes = sum(p.alloc_size for p in uniq)
    node = plan.order[step] if 0 <= step < len(plan.order) else None
    return {"step": step, "node": node, "live": uniq, "live_bytes": live_bytes,
            "dominant": uniq[0] if uniq else None}


def peak_lines(plan: Plan, limit: int = 12) -> list[str]:
    info = peak_info(plan)
    if not info["live"]:
        return ["  nothing planned"]
    node = info["node"]
    at = f"at node {info['step']} {_name(node)} ({node.op})" if node is not None else \
        "before the first node"
    gap = plan.size - info["live_bytes"]
    gaps = f"; the buffer's other {human(gap)} are gaps between live tensors" if gap > 0 else ""
    lines = [f"peak {at}: {human(info['live_bytes'])} live in {len(info['live'])} tensors{gaps}"]
    for p in info["live"][:limit]:
        pct = 100 * p.alloc_size / plan.size if plan.size else 0
        lines.append(f"  {human(p.alloc_size):>12} {pct:5.1f}%  {_name(p.tensor):<28} "
                     f"{p.tensor.op or 'leaf'!s:<10} {p.tensor.type} {fmt_ne(p.tensor.ne)}"
                     f" @ {p.offset}")
    if len(info["live"]) > limit:
        rest = sum(p.alloc_size for p in info["live"][limit:])
        lines.append(f"  {human(rest):>12}         ({len(info['live']) - limit} more)")
    d: Placement = info["dominant"]
    pct = 100 * d.alloc_size / plan.size if plan.size else 0
    lines.append(f"  dominated by {_name(d.tensor)} ({d.tensor.op or 'leaf'}, "
                 f"{human(d.alloc_size)}, {pct:.1f}% of the buffer); the rest is "
                 f"{human(plan.size - d.alloc_size)}")
    return lines


def table_lines(plan: Plan, top: int = 0) -> list[str]:
    """One row per planned tensor in execution order; `top` > 0 keeps the largest."""
    ps = list(plan.placements.values())
    shown = ps if top <= 0 or len(ps) <= top else \
        sorted(ps, key=lambda p: -p.alloc_size)[:top]
    shown.sort(key=lambda p: (p.first, p.offset))
    head = (f"{'name':<30} {'op':<10} {'type':<5} {'ne':<24} {'offset':>12} {'size':>12} "
            f"{'first':>5} {'last':>5}  reused")
    lines = [head, "-" * len(head)]
    for p in shown:
        t = p.tensor
        reused = "" if p.reused is None else _name(p.reused.owner) + \
            (f" (via {_name(p.reused)})" if p.reused.is_view else "")
        last = str(p.last) if p.freed else "end"
        lines.append(f"{_name(t)[:30]:<30} {t.op or 'leaf'!s:<10} {t.type!s:<5} "
                     f"{fmt_ne(t.ne):<24} {p.offset:>12} {human(p.size):>12} "
                     f"{_step(p.first):>5} {last:>5}  {reused}")
    if len(shown) < len(ps):
        lines.append(f"({len(shown)} largest of {len(ps)} tensors shown)")
    return lines


def format_report(plan: Plan, top: int = 40) -> str:
    out = []
    if not plan.complete:
        out += [f"error: {plan.error}", ""]
    out += size_lines(plan) + [""] + peak_lines(plan) + [""] + table_lines(plan, top)
    return "\n".join(out)


# -- JSON -----------------------------------------------------------------------------------

def _row(p: Placement) -> dict[str, Any]:
    t = p.tensor
    return {"name": _name(t), "op": str(t.op) if t.op else None, "role": p.role,
            "type": str(t.type), "ne": list(t.ne), "offset": p.offset, "size": p.size,
            "alloc_size": p.alloc_size, "first": p.first, "last": p.last, "freed": p.freed,
            "reused": None if p.reused is None else _name(p.reused),
            "reused_root": None if p.reused is None else _name(p.reused.owner)}


def to_json(plan: Plan) -> dict[str, Any]:
    info = peak_info(plan)
    node = info["node"]
    return {
        "buffer": plan.name, "alignment": plan.alignment, "strategy": plan.strategy,
        "method": plan.method, "size": plan.size, "size_mib": round(plan.size / MIB, 4),
        "ggml_size": plan.ggml_size, "complete": plan.complete, "error": plan.error,
        "max_bytes": plan.max_bytes, "needed": plan.needed, "candidates": plan.candidates,
        "failed": None if plan.failed is None else {
            "name": _name(plan.failed.tensor), "offset": plan.failed.offset,
            "size": plan.failed.size, "step": plan.failed.step},
        "n_nodes": len(plan.graph.nodes), "n_leafs": len(plan.graph.leafs),
        "reordered": plan.reordered, "order": [_name(t) for t in plan.order],
        "peak": {"step": info["step"], "node": _name(node) if node is not None else None,
                 "live_bytes": info["live_bytes"],
                 "live": [_name(p.tensor) for p in info["live"]],
                 "dominant": _name(info["dominant"].tensor) if info["dominant"] else None},
        "tensors": [_row(p) for p in sorted(plan.placements.values(),
                                            key=lambda p: (p.first, p.offset))],
    }


def write_json(plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_json(plan), f, indent=1)


# -- PNG memory map ---------------------------------------------------------------------------

def plans_agree(a: Plan, b: Plan) -> bool:
    """Whether two plans of one graph lay it out alike: the same order, and every tensor at
    the same offset for the same steps (then one picture shows both)."""
    if a.graph is not b.graph or a.size != b.size or a.order != b.order or \
            a.placements.keys() != b.placements.keys():
        return False
    return all((p.offset, p.alloc_size, p.first, p.last) ==
               (q.offset, q.alloc_size, q.first, q.last)
               for p, q in ((p, b.placements[t]) for t, p in a.placements.items()))


def render_png(plan: Plan, path: str, label_min: float = 0.04) -> None:
    """Memory map: x = node index, y = offset; one rectangle per tensor, the peak marked.
    With a baseline (ggml's plan) that lays the graph out differently, both maps are drawn
    side by side on the same scale; when they agree, one map says so."""
    import matplotlib.pyplot as plt

    fig = memory_map_figure(plan, label_min)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_map_figure(plan: Plan, label_min: float = 0.04) -> Any:
    """render_png's matplotlib Figure, one axes per map (the caller closes it); the legend
    lies under the maps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agree = plan.baseline is not None and plan.complete and plans_agree(plan.baseline, plan)
    plans = [plan] if agree else [p for p in (plan.baseline, plan) if p is not None]
    fig, axes = plt.subplots(1, len(plans), figsize=(7.5 * len(plans), 6.2), squeeze=False,
                             sharey=True)
    top = max([p.size for p in plans] + [plan.max_bytes or 0] +
              [plan.failed.offset + plan.failed.size if plan.failed else 0])
    unit, uname = (MIB, "MiB") if top >= MIB else (1024, "KiB") if top >= 1024 else (1, "B")
    ops = sorted({str(p.tensor.op or "leaf") for q in plans for p in q.placements.values()})
    cmap = plt.get_cmap("tab20")
    # strong hues first (even tab20 slots), their light partners only past ten ops
    colour = {op: cmap((2 * i) % 20 + (i // 10) % 2) for i, op in enumerate(ops)}
    for ax, q in zip(axes[0], plans):
        _draw(ax, q, unit, colour, label_min * top)
        title = "ggml-alloc's rules" if q.strategy == "ggml" else \
            f"{q.strategy} strategy: best candidate '{q.method}'"
        if agree:
            title = (f"{q.strategy} strategy and ggml-alloc's rules agree: "
                     f"the same layout")
        size = f"{q.name} compute buffer {human(q.size)}"
        if not q.complete:
            title = f"partial plan ({q.method})"
            size = f"{human(q.size)} placed before {_name(q.failed.tensor)} did not fit"
        ax.set_title(f"{title}\n{size}", fontsize=10)
        ax.set_xlabel("node index (execution order; 'in' = before node 0)")
        if plan.max_bytes:
            ax.axhline(plan.max_bytes / unit, color="red", lw=1.2, ls="-.")
            ax.annotate(f"max_bytes {human(plan.max_bytes)}", (0.99, plan.max_bytes / unit),
                        xycoords=("axes fraction", "data"), ha="right", va="bottom",
                        color="red", fontsize=8)
    axes[0][0].set_ylabel(f"offset ({uname})")
    axes[0][0].set_ylim(0, top / unit * 1.08 if top else 1)
    handles = [matplotlib.patches.Patch(color=colour[o], label=o) for o in ops]
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(len(ops), 8), fontsize=8,
                   frameon=False)
    if not plan.complete:
        fig.suptitle(textwrap.fill(plan.error or "", 170), color="red", fontsize=8)
    rows = -(-len(handles) // 8)   # legend rows of about 0.2 in, kept out of the maps
    fig.tight_layout(rect=(0, (0.2 * rows + 0.12) / 6.2, 1,
                           0.97 if not plan.complete else 0.94))
    return fig


def _draw(ax: Any, plan: Plan, unit: int, colour: dict, label_bytes: float) -> None:
    import matplotlib
    from matplotlib.collections import PolyCollection

    # a tensor handed over in place ends where its child starts, so the pair reads as one slot
    handed = {p.reused.owner for p in plan.placements.values() if p.reused is not None}
    n = max(len(plan.order), 1)
    top = max(plan.size, 1)
    polys, faces, edges, labels = [], [], [], []
    for p in plan.placements.values():
        x0 = p.first - 0.45
        x1 = p.last - 0.5 if p.tensor in handed and p.last > p.first else p.last + 0.45
        y0, y1 = p.offset / unit, (p.offset + max(p.alloc_size, 1)) / unit
        polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        faces.append(colour[str(p.tensor.op or "leaf")])
        edges.append("black" if p.role != "node" else "white")
        if p.alloc_size >= label_bytes:
            # along the longer side of the box (axes are ~1.6:1), if the name fits there
            w, h = (x1 - x0) / (n + 1) * 1.6, p.alloc_size / top
            room = max(w, h) / 0.013                   # characters of 7 pt text that fit
            text = _name(p.tensor)[:24]
            if p.reused is not None and len(text) + 11 <= room:
                text += " (in place)"
            if len(text) <= room:
                labels.append(((x0 + x1) / 2, (y0 + y1) / 2, text, 90 if h > w else 0,
                               (x1 - x0) * p.alloc_size))
    lw = 0.6 if len(polys) < 400 else 0.0
    ax.add_collection(PolyCollection(polys, facecolors=faces, edgecolors=edges, linewidths=lw,
                                     alpha=0.9))
    ax.set_xlim(-1.6, n - 0.4)
    labels.sort(key=lambda lb: -lb[4])            # the largest areas get their names
    ymax = top / unit * 1.08
    boxes: list[tuple[float, float, float, float]] = []   # placed labels, axes fractions
    for x, y, text, rot, _ in labels:
        fx, fy = (x + 1.6) / (n + 1.2), y / ymax
        hw, hh = (0.006, len(text) * 0.0065) if rot else (len(text) * 0.004, 0.015)
        if len(boxes) >= 12 or any(abs(fx - bx) < hw + bw and abs(fy - by) < hh + bh
                                   for bx, by, bw, bh in boxes):
            continue
        boxes.append((fx, fy, hw, hh))
        ax.text(x, y, text, ha="center", va="center", fontsize=7, rotation=rot, clip_on=True)
    if plan.failed is not None:                 # where the tensor that did not fit would go
        failed = plan.failed
        ax.add_patch(matplotlib.patches.Rectangle(
            (failed.step - 0.45, failed.offset / unit), max(0.9, n / 150), failed.size / unit,
            fill=False, edgecolor="red", hatch="///", lw=1.2))
        ax.annotate(f"{_name(failed.tensor)} does not fit",
                    (failed.step, (failed.offset + failed.size) / unit), color="red",
                    textcoords="offset points", xytext=(4, 2), fontsize=8)
    ax.axhline(plan.size / unit, color="black", lw=1, ls="--")
    if plan.placements:
        info = peak_info(plan)
        step = info["step"]
        ax.axvline(step, color="crimson", lw=1, ls=":")
        ax.plot([step], [plan.size / unit], marker="v", color="crimson", ms=9)
        when = f"node {step}" if step >= 0 else "before node 0"
        gap = plan.size - info["live_bytes"]
        note = f" ({human(gap)} in gaps)" if gap > 0 else ""
        right = step > 0.55 * n         # near the right edge the note reads leftwards,
        ax.annotate(f"peak at {when}: {human(info['live_bytes'])} live{note}",  # in the axes
                    (step, plan.size / unit), textcoords="offset points",
                    xytext=(-8 if right else 6, 4), ha="right" if right else "left",
                    color="crimson", fontsize=8)
    # "in" (before node 0) takes the place of the tick at 0 once the axis is crowded
    ticks = [t for t in ax.get_xticks() if (t >= 1 or (t == 0 and n <= 12)) and t < n]
    ax.set_xticks([-1] + ticks)
    ax.set_xticklabels(["in"] + [str(int(t)) for t in ticks])
