"""Graph pictures (ggraph.pictures.dot, `ggraph dot`): what a node shows, layers and split steps as
clusters, plans drawn into the picture, SVGs of real model layers rendered by Graphviz's `dot`,
and the bad inputs (an unknown layer, a graph too big to draw, `dot` missing).

Set GGRAPH_DOT_OUT=/some/dir to keep the rendered SVG/PNG pictures for a look.
"""
from __future__ import annotations

import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ggraph import Context, build_graph, ops

from ggraph.pictures import dot
from ggraph.plan.alloc import GraphAllocator
from ggraph.cli import main as cli

HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz's dot program is not installed "
                               "(scripts/setup.sh --test installs it)")


def attention_graph():
    """The README's hand-built attention: inputs, a KV 'cache' leaf, in-place softmax."""
    ctx = Context()
    q = ctx.new_tensor("f32", (64, 8, 4), name="q").set_input()
    k = ctx.new_tensor("f16", (64, 128, 4), name="k").set_input()
    v = ctx.new_tensor("f16", (128, 64, 4), name="v").set_input()
    mask = ctx.new_tensor("f16", (128, 8), name="mask").set_input()
    kq = ops.mul_mat(k, q, name="kq")
    kq = ops.soft_max_ext(kq, mask, scale=0.125, name="kq_soft_max")
    out = ops.mul_mat(v, kq, name="kqv").set_output()
    return build_graph(out)


def node_lines(src: str) -> dict[str, str]:
    """DOT node id -> its attribute text."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*(n\d+|l\d+) \[(.*)\];$", src,
                                                        re.MULTILINE)}


def keep(path: Path) -> None:
    out = os.environ.get("GGRAPH_DOT_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


# -- naming and the small picture ------------------------------------------------------------

@pytest.mark.parametrize("name, where", [
    ("attn_norm-3", (3, None)), ("Kcur-12 (roped) (reshaped)", (12, None)),
    ("kq-3-s1", (3, 1)), ("kqv_split-3-s2 (copy of kqv-3-s2 (permuted))", (3, 2)),
    ("blk.7.attn_q.weight", (7, None)), ("cache_k_l4", (4, None)),
    ("cache_v_l4 (reshaped) (set_rows)", (4, None)), ("ffn_shexp-24_gate", (24, None)),
    ("result_norm", (None, None)), ("inp_embd", (None, None)), ("", (None, None)),
])
def test_layer_and_step_from_names(name, where):
    assert dot.where_by_name(name) == where


def test_nodes_show_name_op_type_ne_and_roles():
    g = attention_graph()
    src = dot.to_dot(g)
    lines = node_lines(src)
    kq = next(v for v in lines.values() if "<B>kq</B>" in v)
    assert "X  mul_mat" in kq and "f32 [128, 8, 4]" in kq and dot.FAMILIES["matmul"][0] in kq
    kqv = next(v for v in lines.values() if "<B>kqv</B>" in v)
    assert 'peripheries="2"' in kqv and "OUTPUT" in kqv
    mask = next(v for v in lines.values() if "<B>mask</B>" in v)
    assert "input" in mask and 'fillcolor="#c7e9c0"' in mask
    assert "src0" in src and "src1" in src          # mul_mat's operands are told apart
    assert src.count(" -> ") == 6


def test_plan_shows_offsets_in_place_and_the_peak():
    g = attention_graph()
    plan = GraphAllocator().plan(g)
    src = dot.to_dot(g, plan)
    soft = next(v for v in node_lines(src).values() if "<B>kq_soft_max</B>" in v)
    assert "in place of kq" in soft and "@ " in soft and "steps" in soft
    inplace = [ln for ln in src.splitlines() if 'label="in place"' in ln]
    assert len(inplace) == 1 and dot.INPLACE_COLOR in inplace[0]
    assert "PEAK" in src and dot.PEAK_COLOR in src
    assert f"compute buffer {dot.human(plan.size)}" in src
    other = GraphAllocator().plan(attention_graph())
    with pytest.raises(dot.DotError, match="another graph"):
        dot.to_dot(g, other)


def test_views_can_be_drawn_through():
    ctx = Context()
    a = ctx.new_tensor("f32", (8, 4), name="a").set_input()
    b = ops.reshape(ops.scale(a, 2.0, name="s"), 4, 8)
    out = ops.add(b, b, name="sum").set_output()
    g = build_graph(out)
    assert "reshape" in dot.to_dot(g)
    src = dot.to_dot(g, views=False)
    assert "reshape" not in src and len(node_lines(src)) == 3


def test_unknown_format_and_reversed_range(tmp_path):
    with pytest.raises(dot.DotError, match=r"'\.jpg'"):
        dot.write(attention_graph(), tmp_path / "x.jpg")
    with pytest.raises(dot.DotError, match="reversed: write 2-5"):
        dot.parse_layers("5-2")
    with pytest.raises(dot.UnknownLayerError, match="no layers"):
        dot.to_dot(attention_graph(), layers=(0, 0))


# -- SmolLM2: layers, clusters, split steps, bad input -----------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from ggraph.tools.dot import load_model

    return load_model("default")[0]


@pytest.fixture(scope="module")
def smol_split(smollm2):
    """EngineConfig(amb_mib=16, n_ctx=4096, n_ubatch=512): 6 split steps per layer."""
    from ggraph.tools.dot import model_graph

    return model_graph(smollm2, 4096, 512, amb=16).graph


def test_layer_filter_clusters_and_stubs(smollm2):
    from ggraph.tools.dot import model_graph

    g = model_graph(smollm2).graph
    assert dot.graph_layers(g) == list(range(30))
    src = dot.to_dot(g, layers=(3, 3))
    assert "subgraph cluster_L3 {" in src and "cluster_L2" not in src
    assert "<B>blk.3.attn_q.weight</B>" in src and "blk.4." not in src
    assert "from l_out-2 (layer 2)" in src and "to norm-4, ffn_inp-4" in src
    two = dot.to_dot(g, layers=(0, 1))
    assert "cluster_L0 {" in two and "cluster_L1 {" in two
    last = dot.to_dot(g, layers=(29, 29))     # the unnamed get_rows on out_ids are layer 29's
    assert "inp_out_ids" in last and "from l_out-28" in last


def test_split_steps_are_clusters(smol_split):
    plan = GraphAllocator().plan(smol_split)
    src = dot.to_dot(smol_split, plan, layers=(3, 3))
    steps = re.findall(r"subgraph cluster_L3_s(\d+) \{", src)
    assert steps == [str(i) for i in range(6)]
    assert "split-attention step 0 · heads 0-1" in src and "step 1 · head 2" in src
    assert "mclimit" in src                           # keeps the steps in execution order
    kq = [v for v in node_lines(src).values() if re.search(r"<B>kq-3-s\d</B>", v)]
    assert len(kq) == 6 and all("MiB" in v for v in kq)


def test_summary_is_one_box_per_layer(smol_split):
    plan = GraphAllocator().plan(smol_split)
    src = dot.to_dot(smol_split, plan, summary=True)
    boxes = re.findall(r"^\s*L(\d+) \[", src, re.MULTILINE)
    assert boxes == [str(i) for i in range(30)]
    assert "6 split-attention steps" in src and "+29 more" in src
    assert len(src.splitlines()) < 120


def test_unknown_layer_and_too_large(smollm2, capsys):
    assert cli(["dot", "--layer", "40"]) == 1
    err = capsys.readouterr().err
    assert "layer 40 is not in this graph: its layers are 0-29 (30 layers)" in err
    assert cli(["dot"]) == 1
    err = capsys.readouterr().err
    assert "more than max_nodes=400" in err and "--layer 0" in err and "--summary" in err
    assert "Traceback" not in err
    assert cli(["dot", "--layers", "0-20"]) == 1
    assert "Draw fewer layers" in capsys.readouterr().err
    assert cli(["dot", "--layer", "1", "--layers", "0-2"]) == 1
    assert cli(["dot", "-o", "x.jpeg"]) == 1
    assert "use .dot, .svg, .png or .pdf" in capsys.readouterr().err


def test_cli_dot_to_stdout_and_user_graph_file(tmp_path, capsys):
    f = tmp_path / "mine.py"
    f.write_text("from ggraph import Context, ops\n"
                 "def build():\n"
                 "    ctx = Context()\n"
                 "    x = ctx.new_tensor('f32', (4, 2), name='x').set_input()\n"
                 "    return ops.silu(x, name='act-0').set_output()\n")
    assert cli(["dot", "--graph", f"{f}:build", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph ggraph {") and "<B>act-0</B>" in out
    assert cli(["dot", "--graph", f"{f}:nope"]) == 1
    assert "cannot load it" in capsys.readouterr().err


def test_missing_dot_program_still_writes_dot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "att.svg"
    assert cli(["dot", "--graph", "ggraph.tools.report:attention_graph", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert (tmp_path / "att.dot").read_text().startswith("digraph")
    assert not out.exists()
    assert "apt-get install graphviz" in err and f"dot -Tsvg {tmp_path / 'att.dot'}" in err


# -- real pictures, rendered by Graphviz -----------------------------------------------------------

def svg_texts(path: Path) -> str:
    root = ET.parse(path).getroot()      # also proves the SVG is well-formed
    return " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))


@needs_dot
def test_smollm2_layer_svg_and_png(smollm2, smol_split, tmp_path):
    from ggraph.tools.dot import model_graph

    g = model_graph(smollm2).graph
    plan = GraphAllocator().plan(g)
    files = dot.write(g, tmp_path / "smollm2_layer3.svg", plan, layers=(3, 3),
                      title="SmolLM2-135M layer 3")
    text = svg_texts(files[1])
    for want in ("layer 3", "kq-3", "kq_soft_max-3", "in place of kq-3", "72.00 MiB",
                 "blk.3.ffn_up.weight", "from l_out-2 (layer 2)"):
        assert want in text, want
    split = dot.write(smol_split, tmp_path / "smollm2_layer3_amb16.png",
                      GraphAllocator().plan(smol_split), layers=(3, 3))
    assert split[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for f in files + split:
        keep(f)


@needs_dot
def test_deepseek2_layer_svg_with_split_steps(tmp_path):
    pytest.importorskip("ggraph.graphs.models.archs.deepseek2",
                        reason="the DeepSeek2 builder (graphs/models/archs/deepseek2.py) is not there")
    from ggraph.tools.dot import load_preset, model_graph

    model = load_preset("deepseek-v3")[0]
    g = model_graph(model, 4096, 512, amb=256).graph   # K*Q of 128 heads: 1 GiB -> 4 steps
    plan = GraphAllocator().plan(g)
    files = dot.write(g, tmp_path / "deepseek2_layer3_amb256.svg", plan, layers=(3, 3),
                      title="DeepSeek-V3 layer 3, --amb 256")
    src = files[0].read_text()
    steps = re.findall(r"subgraph cluster_L3_s(\d+) \{", src)
    assert len(steps) >= 2 and steps == sorted(steps, key=int)
    text = svg_texts(files[1])
    assert "split-attention step 0" in text and "layer 3" in text
    png = dot.render(src, tmp_path / "deepseek2_layer3_amb256.png")
    for f in files + [png]:
        keep(f)
