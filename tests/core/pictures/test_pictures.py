"""Pictures that read at a glance (issue 17): a layer picture outlines the peak it names, the
summary's layer boxes show each layer's memory (and time), one memory map when the strategies
agree, and legends that never cover data (checked on matplotlib's bounding boxes).

Set GGRAPH_DOT_OUT=/some/dir to keep the rendered pictures for a look.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from ggraph import Context, build_graph, ops

from ggraph.pictures import alloc_report as R, dot
from ggraph.plan.alloc import GraphAllocator
from ggraph.cli import main as cli
from ggraph.pictures.dot_summary import BAR_WIDTH, MEMORY_BAR, TIME_BAR, WEIGHT_BAR


def layered_graph():
    """Three llama-named layers (the last with an extra op and a wider weight) and a global
    output bigger than anything in a layer, so the graph's peak lies outside every layer."""
    ctx = Context()
    x = ctx.new_tensor("f32", (64, 16), name="inp_embd").set_input()
    h = x
    for il in range(3):
        width = 128 if il == 2 else 64
        w = ctx.new_tensor("f32", (64, width), name=f"blk.{il}.ffn_up.weight")
        w.buffer = "model"
        up = ops.mul_mat(w, h, name=f"ffn_up-{il}")
        act = ops.silu(up, name=f"ffn_act-{il}")
        if il == 2:
            act = ops.scale(act, 0.5, name=f"ffn_scaled-{il}")
        down = ctx.new_tensor("f32", (width, 64), name=f"blk.{il}.ffn_down.weight")
        down.buffer = "model"
        h = ops.add(ops.mul_mat(down, act, name=f"ffn_out-{il}"), h, name=f"l_out-{il}")
    head = ctx.new_tensor("f32", (64, 4096), name="output.weight")
    head.buffer = "model"
    return build_graph(ops.mul_mat(head, h, name="result_output").set_output())


def node_lines(src: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*(n\d+|l\d+|L\d+) \[(.*)\];$",
                                                        src, re.MULTILINE)}


def outlined(src: str) -> set[str]:
    """Bold names of the drawn tensors with a red outline."""
    out = set()
    for attrs in node_lines(src).values():
        if f'color="{dot.PEAK_COLOR}"' in attrs and re.search(r'penwidth="[23]"', attrs):
            m = re.search(r"<B>([^<]+)</B>", attrs) or re.search(r"from ([^<(]+?)[ <(]", attrs)
            out.add(m.group(1).strip())
    return out


def keep(path: Path) -> None:
    out = os.environ.get("GGRAPH_DOT_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


# -- a layer picture outlines the peak it names --------------------------------------------

def test_layer_picture_outlines_its_own_peak_and_says_where_the_graphs_is():
    g = layered_graph()
    plan = GraphAllocator().plan(g)
    graph_peak = R.peak_info(plan)["node"]
    assert graph_peak.name == "result_output"            # outside every layer
    src = dot.to_dot(g, plan, layers=(1, 1))
    assert (f"graph peak ({dot.human(R.peak_info(plan)['live_bytes'])} live) at step "
            f"{plan.peak_step}, result_output outside the layers: not drawn here") in src
    m = re.search(r"own peak at step (\d+), ([^:]+): ([\d.]+ \w+) live in (\d+) tensors", src)
    assert m, src[:600]
    step, name = int(m.group(1)), m.group(2)
    layer1 = [t for t in plan.order if t.name.endswith("-1")]
    # the step named is layer 1's high-water mark, worked out here step by step
    want = max(range(len(plan.order)), key=lambda s: (
        plan.order[s] in layer1, R.peak_info(plan, s)["live_bytes"], -s))
    assert step == want and name == plan.order[want].name
    info = R.peak_info(plan, step)
    assert m.group(3) == dot.human(info["live_bytes"]) and int(m.group(4)) == len(info["live"])
    # the named node carries the peak mark and every red outline is a tensor live then
    peak_line = next(v for v in node_lines(src).values() if f"<B>{name}</B>" in v)
    assert "PEAK of the drawn layers" in peak_line and 'penwidth="3"' in peak_line
    live_names = {p.tensor.name for p in info["live"]}
    drawn_red = outlined(src)
    assert name in drawn_red and drawn_red <= live_names
    assert "l_out-0" in drawn_red          # the layer's input from layer 0: a red stub


def test_layer_picture_with_the_graphs_peak_is_unchanged():
    ctx = Context()
    x = ctx.new_tensor("f32", (64, 16), name="x").set_input()
    big = ops.scale(ops.mul_mat(ctx.new_tensor("f32", (64, 2048), name="blk.0.w"), x,
                                name="wide-0"), 2.0, name="scaled-0")
    g = build_graph(ops.sum_rows(big, name="small-1").set_output())
    plan = GraphAllocator().plan(g)
    peak = R.peak_info(plan)["node"]
    assert peak.name.endswith("-0")
    src = dot.to_dot(g, plan, layers=(0, 0))
    assert "not drawn here" not in src and "outlined instead" not in src
    assert f"peak at step {plan.peak_step}, {peak.name} in layer 0" in src
    assert "PEAK: runs at the high-water mark" in src


def test_split_picture_of_deepseek_names_a_drawn_peak(tmp_path):
    pytest.importorskip("ggraph.graphs.deploy.presets", reason="this installation has no presets")
    from ggraph.graphs.deploy.presets import preset_model
    from ggraph.tools.dot import model_graph

    model = preset_model("deepseek-v3")[0]
    g = model_graph(model, 16384, 512, amb=256).graph
    plan = GraphAllocator().plan(g)
    il = dot.where_by_name(R.peak_info(plan)["node"].name)[0]
    other = 3 if il != 3 else 4
    src = dot.to_dot(g, plan, layers=(other, other), max_nodes=0)
    m = re.search(r"own peak at step \d+, ([^:]+):", src)
    assert m and dot.where_by_name(m.group(1))[0] == other
    assert m.group(1) in outlined(src)
    assert f"in layer {il}: not drawn here (draw it: --layer {il})" in src
    # the layer that holds the graph's peak outlines that peak itself
    src = dot.to_dot(g, plan, layers=(il, il), max_nodes=0)
    assert R.peak_info(plan)["node"].name in outlined(src) and "not drawn here" not in src


# -- the summary: per-layer memory and time --------------------------------------------------

def test_summary_boxes_show_each_layers_memory_and_time():
    g = layered_graph()
    plan = GraphAllocator().plan(g)
    seconds = {t: 1e-3 * (1 + i % 5) for i, t in enumerate(g.nodes)}
    src = dot.to_dot(g, plan, summary=True, node_seconds=seconds)
    boxes = {k: v for k, v in node_lines(src).items() if k.startswith("L")}
    assert sorted(boxes) == ["L0", "L1", "L2"]
    assert len(set(boxes.values())) == 3                 # every label differs
    live = R.live_by_step(plan)
    times = {}
    for il, label in boxes.items():
        nodes = [t for t in g.nodes if dot.where_by_name(t.name)[0] == int(il[1:])]
        peak = max(live[plan.order.index(t) + 1] for t in nodes)
        assert f"compute peak <B>{dot.human(peak)}</B>" in label
        weights = sum(w.nbytes for t in nodes for w in t.src
                      if w is not None and w.name.startswith("blk."))
        assert f"weights {dot.human(weights)}" in label
        times[il] = sum(seconds[t] for t in nodes)
        assert f"time <B>{times[il] * 1e3:.3g} ms</B>" in label
    # layer 1 has layer 0's ops; layer 2 has one more op and is told in full
    assert "ops as layer 0" in boxes["L1"] and "ops as layer" not in boxes["L2"]
    assert "scale×1" in boxes["L2"]

    def bar(label: str, colour: str) -> int:
        return int(re.search(rf'WIDTH="(\d+)" HEIGHT="6" FIXEDSIZE="TRUE" '
                             rf'BGCOLOR="{colour}"', label).group(1))
    slowest = max(times.values())
    for il, label in boxes.items():
        assert bar(label, TIME_BAR) == max(1, round(BAR_WIDTH * times[il] / slowest))
    # layer 2's weights are heavier: a weight bar, full for layer 2 only
    assert bar(boxes["L2"], WEIGHT_BAR) == BAR_WIDTH > bar(boxes["L0"], WEIGHT_BAR)
    assert all(bar(v, MEMORY_BAR) <= BAR_WIDTH for v in boxes.values())


def test_summary_without_plan_or_times_has_no_memory_or_time_bars():
    src = dot.to_dot(layered_graph(), summary=True)
    assert MEMORY_BAR not in src and TIME_BAR not in src
    assert WEIGHT_BAR in src                 # the layers' weights differ
    assert "weights " in src and "nodes #" in src


# -- memory maps and the plan picture: panels and legends ------------------------------------

def _no_overlap(a, b) -> bool:
    return a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0


def test_one_memory_map_when_the_strategies_agree(tmp_path):
    import matplotlib.pyplot as plt

    from ggraph.tools.report import attention_graph

    plan = GraphAllocator().reserve(attention_graph(n_tokens=64, n_kv=256))
    assert R.plans_agree(plan.baseline, plan)
    fig = R.memory_map_figure(plan)
    try:
        assert len(fig.axes) == 1 and "agree" in fig.axes[0].get_title()
        _legend_clear(fig)
    finally:
        plt.close(fig)
    plan = GraphAllocator().reserve(layered_graph())
    differ = not R.plans_agree(plan.baseline, plan)
    fig = R.memory_map_figure(plan)
    try:
        assert len(fig.axes) == (2 if differ else 1)
        _legend_clear(fig)
    finally:
        plt.close(fig)
    R.render_png(plan, tmp_path / "map.png")
    keep(tmp_path / "map.png")


def _legend_clear(fig) -> None:
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    assert legends
    for lg in legends:
        box = lg.get_window_extent(r)
        for ax in fig.axes:
            assert _no_overlap(box, ax.get_window_extent(r)), "legend covers a plot"


def test_plan_png_legend_and_totals_cover_no_data(tmp_path):
    import matplotlib.pyplot as plt

    pytest.importorskip("ggraph.graphs.deploy.presets", reason="this installation has no presets")
    from ggraph.graphs.deploy.placement import parse_devices
    from ggraph.graphs.deploy.plan_devices import plan_figure, render_png
    from ggraph.graphs.deploy.presets import preset_model

    model = preset_model("qwen2-7b")[0]
    dp = plan_devices_small(model, parse_devices("2x2GiB,1x1GiB"))
    fig = plan_figure(dp)
    try:
        _legend_clear(fig)
        ax = fig.axes[0]
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        data = [p.get_window_extent(r) for p in ax.patches] + \
            [ln.get_window_extent(r) for ln in ax.lines if len(ln.get_xdata())]
        texts = [t for t in ax.texts if "GiB" in t.get_text()]
        assert len(texts) == len(dp.devices)
        for t in texts:
            tb = t.get_window_extent(r)
            assert all(_no_overlap(tb, d) for d in data), f"{t.get_text()!r} covers a bar"
            assert ax.get_window_extent(r).contains(tb.x1 - 1, tb.y0 + 1)
    finally:
        plt.close(fig)
    render_png(dp, str(tmp_path / "devices.png"))
    keep(tmp_path / "devices.png")


def plan_devices_small(model, devices):
    from ggraph.graphs.deploy.plan_devices import plan_devices

    return plan_devices(model, "qwen2-7b", devices, n_ctx=4096, n_ubatch=512)


# -- graphs and models are named the same way everywhere ------------------------------------

GRAPH_FILE = """
from ggraph import Context, ops

def graph():
    ctx = Context()
    x = ctx.new_tensor("f32", (64, 8), name="x").set_input()
    return ops.scale(ops.silu(x, name="act"), 2.0).set_name("out").set_output()
"""


def test_report_takes_a_graph_file_as_dot_does(tmp_path, capsys):
    f = tmp_path / "mine.py"
    f.write_text(GRAPH_FILE)
    assert cli(["dot", "--graph", f"{f}:graph"]) == 0
    assert "<B>act</B>" in capsys.readouterr().out
    png = tmp_path / "r.png"
    assert cli(["report", "--graph", f"{f}:graph", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "CPU compute buffer size" in out and "act" in out and png.stat().st_size > 5000
    assert cli(["report", "--graph", f"{tmp_path}/none.py:graph"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_report_takes_a_model_name(capsys):
    from ggraph.graphs.gguf.fetch import resolve_model

    try:
        resolve_model("default")
    except Exception as e:          # noqa: BLE001 - offline without the cached file
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched here: {e}")
    assert cli(["report", "default", "--n-kv", "256", "--n-tokens", "32", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "result_output" in out and "CPU compute buffer size" in out
    assert cli(["report", "-m", "smollm2", "--n-kv", "256", "--n-tokens", "32"]) == 0
    assert cli(["report", "default", "--graph", "x:y"]) == 1
    assert "not both" in capsys.readouterr().err
