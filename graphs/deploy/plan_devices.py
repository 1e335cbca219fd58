"""Planning a deployment over virtual devices: per-device weights, KV cache and compute
buffer, the host buffer, copies per ubatch and per token, and whether each device fits.

The worst-case graph (as llama.cpp reserves it) is scheduled with ggraph.plan.sched exactly as a
real run would be, with every virtual device assumed to run every op, and each device's graph
is planned by its own allocator (CUDA's 128-byte alignment on devices, the CPU's 32 on the
host). Weights are counted from the model's tensor table in their real format, so a preset
with Q2_K-sized weights (bytes per weight) plans like the file would.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ggraph.plan.alloc import Plan, plan_graph
from ggraph.plan.sched import Schedule, schedule_graph
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType, MIB

from ggraph.backends import registry
from ggraph.graphs.deploy.placement import (VIRTUAL, Device, LayerMap, layer_map, place_tensors,
                                            tensor_layer)

GIB = 1 << 30
DEVICE_ALIGNMENT = VIRTUAL.alignment            # planned devices are CUDA-like (placement.py)
HOST_ALIGNMENT = registry.alignment("cpu")


@dataclass
class DevicePlan:
    name: str
    memory: int | None
    layers: list[int]
    weights: int
    kv: int
    compute: int
    compute_ggml: int
    copies_ubatch: int      # bytes copied into this device per worst-case ubatch
    copies_token: int       # ... per generated token
    plan: Plan = field(repr=False)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    @property
    def fits(self) -> bool | None:
        return None if self.memory is None else self.total <= self.memory

    def layer_text(self) -> str:
        ls = self.layers
        if not ls:
            return "-"
        runs, start = [], ls[0]
        for a, b in zip(ls, ls[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        return ",".join(runs)


@dataclass
class DeploymentPlan:
    source: str
    n_ctx: int
    n_ubatch: int
    n_tokens: int
    amb_mib: int
    type_k: GGMLType
    flash: bool
    path: str
    n_gpu_layers: int
    tensor_split: list[float] | None
    layer_map: LayerMap
    devices: list[DevicePlan]          # offload devices, then the host
    n_splits: int
    n_splits_token: int
    n_nodes: int
    n_copies: int
    advice: list[str]
    build_s: float
    plan_s: float
    schedule: Schedule = field(repr=False)
    schedule_token: Schedule | None = field(default=None, repr=False)  # of a decode step

    @property
    def host(self) -> DevicePlan:
        return self.devices[-1]


def _layer_sizes(model: Any, cache: Any) -> tuple[list[int], list[int], dict[str, int]]:
    """Weight bytes per layer, KV bytes per layer, and bytes of the input/output tensors."""
    n_layer = model.hp.n_layer
    w, kv = [0] * n_layer, [0] * n_layer
    io = {"input": 0, "output": 0, "other": 0}
    for name in model.gguf.tensors:
        where = tensor_layer(name)
        size = model.gguf.tensor_size(name)
        if isinstance(where, int) and where < n_layer:
            w[where] += size
        else:
            io[where if isinstance(where, str) else "other"] += size
    for il in range(n_layer):
        kv[il] = cache.k[il].nbytes + (cache.v[il].nbytes if cache.v else 0)
    return w, kv, io


def plan_devices(model: Any, source: str, devices: Sequence[Device], n_ctx: int,
                 n_ubatch: int = 512, amb_mib: int = 0, type_k: str = "f16",
                 flash: bool = False, path: str | None = None, strategy: str = "ggml",
                 n_gpu_layers: int = -1, tensor_split: Sequence[float] | None = None,
                 host_memory: int | None = None, n_copies: int | None = None
                 ) -> DeploymentPlan:
    """n_copies: pipeline copies of inputs (None: llama.cpp's rule, see pipeline_copies)."""
    hp = model.hp
    if not devices:
        raise ValueError("give at least one device (e.g. --devices 2x24GiB)")
    if n_ctx <= 0 or n_ubatch <= 0:
        raise ValueError("context and ubatch sizes must be positive")
    if n_ctx > hp.n_ctx_train:
        raise ValueError(f"context {n_ctx} is larger than the model's training context "
                         f"{hp.n_ctx_train} ({source})")
    n = len(devices)
    if n_copies is None:
        n_copies = pipeline_copies(n, n_gpu_layers, hp.n_layer)
    lm = layer_map(hp.n_layer, n, n_gpu_layers, tensor_split, [d.memory for d in devices])
    tk = GGMLType.parse(type_k)
    t0 = time.perf_counter()
    ctx = Context("plan-devices")
    cache = model.new_cache(ctx, n_ctx, tk, flash_attn=flash)
    w_layer, kv_layer, io = _layer_sizes(model, cache)
    _check_layer_fit(devices, lm, w_layer, kv_layer)
    n_tokens = min(n_ctx, n_ubatch)
    kw = {"path": path} if path is not None else {}
    mg = model.build(ctx, cache, n_tokens, n_ctx, n_tokens, flash, amb_mib, **kw)
    tg = model.build(ctx, cache, 1, n_ctx, 1, flash, amb_mib, **kw)
    t1 = time.perf_counter()
    names = [d.name for d in devices] + ["CPU"]
    every = [lambda t: True] * (n + 1)   # a virtual device runs every op

    def placed(graph: Any) -> dict[Tensor, int]:
        leafs = list(graph.leafs) + cache.k + cache.v
        return place_tensors(leafs, lm)

    sch = schedule_graph(mg.graph, names, every, placed(mg.graph), n, n_copies)
    sch_tg = schedule_graph(tg.graph, names, every, placed(tg.graph), n)
    plans = [plan_graph(g, DEVICE_ALIGNMENT if i < n else HOST_ALIGNMENT, strategy,
                        name=names[i], keep_order=True)
             for i, g in enumerate(sch.device_graphs)]
    t2 = time.perf_counter()
    cu, ct = sch.copy_bytes(), sch_tg.copy_bytes()
    out = []
    for i in range(n + 1):
        layers = [il for il, d in enumerate(lm.layers) if d == i]
        weights = sum(w_layer[il] for il in layers)
        weights += (io["input"] if lm.input == i else 0) + \
            (io["output"] if lm.output == i else 0) + (io["other"] if i == n else 0)
        kv = sum(kv_layer[il] for il in layers)
        mem = devices[i].memory if i < n else host_memory
        p = plans[i]
        out.append(DevicePlan(names[i], mem, layers, weights, kv, p.size, p.ggml_size, cu[i],
                              ct[i], p))
    dp = DeploymentPlan(source, n_ctx, n_ubatch, n_tokens, amb_mib, tk, flash,
                        mg.path or ("absorbed" if not flash else "flash"),
                        n_gpu_layers, list(tensor_split) if tensor_split else None, lm, out,
                        sch.n_splits, sch_tg.n_splits, mg.graph.n_nodes, n_copies, [], t1 - t0,
                        t2 - t1,
                        sch, sch_tg)
    dp.advice = advice(dp, w_layer, kv_layer, io)
    return dp


def pipeline_copies(n_devices: int, n_gpu_layers: int, n_layer: int) -> int:
    """llama.cpp turns on pipeline parallelism (GGML_SCHED_MAX_COPIES = 4 copies of the
    inputs) with several devices and every layer, the output layer too, offloaded."""
    every = n_gpu_layers < 0 or n_gpu_layers > n_layer
    return 4 if n_devices > 1 and every else 1


def _check_layer_fit(devices: Sequence[Device], lm: LayerMap, w_layer: list[int],
                     kv_layer: list[int]) -> None:
    """A device that gets layers but cannot hold even the smallest of them is an error."""
    for i, d in enumerate(devices):
        mine = [il for il, x in enumerate(lm.layers) if x == i]
        if d.memory is None or not mine:
            continue
        il = min(mine, key=lambda k: w_layer[k] + kv_layer[k])
        need = w_layer[il] + kv_layer[il]
        if need > d.memory:
            raise ValueError(
                f"device {d.name} ({_h(d.memory)}) is too small for one layer: layer {il} "
                f"alone needs {_h(need)} (weights {_h(w_layer[il])} + KV cache "
                f"{_h(kv_layer[il])}) before any compute buffer; give {d.name} a "
                f"--tensor-split share of 0, or drop it from --devices")


def advice(dp: DeploymentPlan, w_layer: list[int], kv_layer: list[int],
           io: dict[str, int]) -> list[str]:
    """What does not fit, by how much, and what to change: a tensor split that fits when the
    devices have room in all, else what a quantized cache, fewer pipeline copies and a
    smaller ubatch would save."""
    devs = dp.devices[:-1]
    over = [d for d in devs if d.fits is False]
    if not over:
        return []
    out = []
    short = lambda d: (d.fits is False, d.total - (d.memory or 0), d.weights, d.kv,  # noqa: E731
                       d.compute)
    for who, run in _runs(devs, short):
        d = run[0]
        if d.fits is False:
            who += " (each)" if len(run) > 1 else ""
            out.append(f"{who} over by {_h(d.total - d.memory)}: weights {_h(d.weights)} + "
                       f"KV {_h(d.kv)} + compute {_h(d.compute)} in {_h(d.memory)}")
    counts = suggest_counts(dp, w_layer, kv_layer, io)
    if counts is not None:
        out.append("the devices have room in all: --tensor-split " +
                   ",".join(str(c) for c in counts) + " places the layers where they fit; "
                   "or save memory where it is short:")
    else:
        need = sum(d.total for d in devs)
        have = sum(d.memory for d in devs if d.memory is not None)
        out.append(f"in all the devices need {_h(need)} and have {_h(have)}: no tensor split "
                   f"fits; add devices, use smaller weights, or shrink the cache or buffers:")
    d = max(over, key=lambda x: x.total - x.memory)
    if d.kv and not dp.type_k.is_quantized:
        q8 = d.kv * 34 // (32 * dp.type_k.type_size)
        fa = "" if dp.flash else " --fa"
        out.append(f"  -ctk q8_0{fa}: KV cache {_h(d.kv)} -> {_h(q8)} on {d.name}")
    pipe = dp.schedule.pipeline_bytes
    i = dp.devices.index(d)
    if dp.n_copies > 1 and pipe and pipe[i]:
        out.append(f"  {_h(pipe[i])} of {d.name}'s compute buffer are the {dp.n_copies - 1} "
                   f"extra pipeline copies of its inputs: -ngl <= n_layer (output layer on the "
                   f"CPU) or llama.cpp built with GGML_SCHED_MAX_COPIES=1 drops them")
    out.append(f"  a smaller -ub (or --amb) shrinks the mask, its copies and K*Q: {d.name}'s "
               f"compute buffer is {_h(d.compute)} at -ub {dp.n_ubatch}")
    return out


def suggest_counts(dp: DeploymentPlan, w_layer: list[int], kv_layer: list[int],
                   io: dict[str, int]) -> list[int] | None:
    """A --tensor-split (layers per device) under which every device fits: the offloaded
    layers (and the output layer, when offloaded) fill the devices in order, each beside its
    compute buffer as planned; None when the devices cannot hold them all. Shares equal to
    these counts make llama.cpp's rule give exactly these counts."""
    devs = dp.devices[:-1]
    lm = dp.layer_map
    if any(d.memory is None for d in devs):
        return None
    units = [w_layer[il] + kv_layer[il] for il, d in enumerate(lm.layers) if d < len(devs)]
    if lm.output < len(devs):
        units.append(io["output"])
    if not units:
        return None
    counts, k = [], 0
    for d in devs:
        room, c = d.memory - d.compute, 0
        while k < len(units) and units[k] <= room:
            room -= units[k]
            k += 1
            c += 1
        counts.append(c)
    return counts if k == len(units) else None


def _runs(devs: list[DevicePlan], key: Callable[[DevicePlan], Any]
          ) -> list[tuple[str, list[DevicePlan]]]:
    """Runs of consecutive devices with equal key(device), named 'CUDA1' or 'CUDA1..CUDA13'."""
    out = []
    for _, group in itertools.groupby(devs, key):
        run = list(group)
        out.append((run[0].name if len(run) == 1 else f"{run[0].name}..{run[-1].name}", run))
    return out


def _h(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / MIB:,.2f} MiB"


def format_lines(dp: DeploymentPlan) -> list[str]:
    lm = dp.layer_map
    n = len(dp.devices) - 1
    offl = sum(1 for d in lm.layers if d < n)
    split = ",".join(f"{x:g}" for x in dp.tensor_split) if dp.tensor_split else "by memory"
    lines = [
        (f"ggraph plan: {dp.source} on {n} device{'s' if n != 1 else ''} + host: ctx "
         f"{dp.n_ctx}, ubatch {dp.n_ubatch}, amb {dp.amb_mib} MiB, K cache {dp.type_k}, "
         f"flash attention {'on' if dp.flash else 'off'} (MLA path {dp.path})"),
        (f"layers: {offl}/{len(lm.layers)} repeating layers offloaded (-ngl "
         f"{dp.n_gpu_layers if dp.n_gpu_layers >= 0 else 'all'}), output layer on "
         f"{dp.devices[lm.output].name}, tensor split {split}"),
        f"{'device':<8} {'layers':>9} {'n':>3} {'weights':>12} {'KV cache':>12} "
        f"{'compute':>12} {'total':>12} {'memory':>12}  fits",
    ]
    for d in dp.devices:
        mem = _h(d.memory) if d.memory is not None else "-"
        fit = {None: "-", True: "yes", False: "NO"}[d.fits]
        lines.append(f"{d.name:<8} {d.layer_text():>9} {len(d.layers):>3} {_h(d.weights):>12} "
                     f"{_h(d.kv):>12} {_h(d.compute):>12} {_h(d.total):>12} {mem:>12}  {fit}")
    tot = dp.devices
    lines.append(f"{'total':<8} {'':>9} {len(lm.layers):>3} {_h(sum(d.weights for d in tot)):>12}"
                 f" {_h(sum(d.kv for d in tot)):>12} {_h(sum(d.compute for d in tot)):>12} "
                 f"{_h(sum(d.total for d in tot)):>12}")
    lines.append(f"host (CPU) compute buffer = {dp.host.compute / MIB:,.2f} MiB: graph inputs "
                 f"(mask, positions, ids), the input layer and what runs on the CPU")
    if dp.n_copies > 1:
        lines.append(f"pipeline parallelism: {dp.n_copies} copies of the graph inputs and of "
                     f"each device's split inputs (llama.cpp's rule: several devices, every "
                     f"layer offloaded); --pipeline-copies 1 plans without")
    cu = sum(d.copies_ubatch for d in tot)
    ct = sum(d.copies_token for d in tot)
    lines.append(f"copies: {dp.n_splits} graph splits per ubatch of {dp.n_tokens} tokens, "
                 f"{_h(cu)} copied between devices; {dp.n_splits_token} splits and "
                 f"{ct / 1024:,.1f} KiB per generated token")
    lines.append(f"graph: {dp.n_nodes} nodes; built in {dp.build_s:.2f} s, scheduled and "
                 f"planned in {dp.plan_s:.2f} s")
    ggml = [d for d in dp.devices if d.compute_ggml != d.compute]
    if ggml:
        lines.append("compute buffers by ggml-alloc's rules (what llama.cpp would allocate): "
                     + ", ".join(f"{who} {run[0].compute_ggml / MIB:,.2f} MiB" for who, run in
                                 _runs(dp.devices, lambda d: d.compute_ggml)))
    if dp.advice:
        lines += ["does not fit:"] + [f"  {a}" for a in dp.advice]
    elif all(d.fits for d in dp.devices[:-1]):
        lines.append("every device fits")
    return lines


def to_json(dp: DeploymentPlan) -> dict[str, Any]:
    return {
        "source": dp.source, "n_ctx": dp.n_ctx, "n_ubatch": dp.n_ubatch,
        "n_tokens": dp.n_tokens, "amb_mib": dp.amb_mib, "cache_type_k": str(dp.type_k),
        "flash_attn": dp.flash, "path": dp.path, "n_gpu_layers": dp.n_gpu_layers,
        "tensor_split": dp.tensor_split, "output_device": dp.devices[dp.layer_map.output].name,
        "devices": [{"name": d.name, "memory_bytes": d.memory, "layers": d.layers,
                     "weights_bytes": d.weights, "kv_cache_bytes": d.kv,
                     "compute_buffer_bytes": d.compute,
                     "compute_buffer_ggml_bytes": d.compute_ggml, "total_bytes": d.total,
                     "fits": d.fits, "copies_per_ubatch_bytes": d.copies_ubatch,
                     "copies_per_token_bytes": d.copies_token} for d in dp.devices],
        "n_splits": dp.n_splits, "n_splits_per_token": dp.n_splits_token,
        "n_nodes": dp.n_nodes, "n_copies": dp.n_copies, "advice": dp.advice, "build_s": dp.build_s,
        "plan_s": dp.plan_s,
    }


def render_png(dp: DeploymentPlan, path: str) -> None:
    """One bar per device: weights, KV cache, compute buffer (its pipeline copies hatched)
    stacked against the device's memory, so a glance shows who is full and why."""
    import matplotlib.pyplot as plt

    fig = plan_figure(dp)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_figure(dp: DeploymentPlan) -> Any:
    """render_png's matplotlib Figure (the caller closes it). The legend sits under the axes
    and each total right of its bar and memory mark: nothing covers a bar or a memory line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devs = dp.devices
    pipe = dp.schedule.pipeline_bytes or [0] * len(devs)
    names = [d.name for d in devs]
    gib = float(GIB)
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(devs) + 2.0))
    y = list(range(len(devs)))[::-1]
    parts = [("weights", [d.weights for d in devs], "#4c72b0", None),
             ("KV cache", [d.kv for d in devs], "#dd8452", None),
             ("compute", [d.compute - p for d, p in zip(devs, pipe)], "#55a868", None),
             (f"compute: {dp.n_copies - 1} extra pipeline copies of inputs", pipe, "#55a868",
              "//")]
    left = [0.0] * len(devs)
    for label, vals, color, hatch in parts:
        if not any(vals):
            continue
        w = [v / gib for v in vals]
        ax.barh(y, w, left=left, color=color, hatch=hatch, edgecolor="white", label=label)
        left = [a + b for a, b in zip(left, w)]
    right = max(max(left), max((d.memory or 0) / gib for d in devs)) or 1.0
    for yi, d, total in zip(y, devs, left):
        mem = d.memory / gib if d.memory is not None else None
        if mem is not None:
            ax.plot([mem] * 2, [yi - 0.45, yi + 0.45], color="#c44e52", lw=2)
        # right of both the bar and the memory mark, so the text crosses neither
        text = f"{total:.1f}" + (f" of {mem:.0f} GiB" if mem is not None else " GiB")
        if d.fits is False:
            text += ": does not fit"
        ax.text(max(total, mem or 0.0) + right * 0.01, yi, text, va="center", fontsize=8,
                color="#c44e52" if d.fits is False else "black")
    ax.plot([], [], color="#c44e52", lw=2, label="device memory")
    ax.set_yticks(y, names)
    ax.set_xlabel("GiB")
    ax.set_title(f"{dp.source}: ctx {dp.n_ctx}, ubatch {dp.n_ubatch}, amb {dp.amb_mib} MiB, "
                 f"K cache {dp.type_k}", fontsize=10)
    ax.set_xlim(0, right * 1.22)     # room for the totals
    ax.set_ylim(-0.6, len(devs) - 0.4)
    handles, labels = ax.get_legend_handles_labels()
    height = 0.38 * len(devs) + 2.0
    rows = -(-len(labels) // 3)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8,
               frameon=False)
    # the legend's rows (about 0.22 in each) are kept out of the axes' area
    fig.tight_layout(rect=(0, (0.22 * rows + 0.1) / height, 1, 1))
    return fig
