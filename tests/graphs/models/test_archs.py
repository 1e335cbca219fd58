"""Architectures by interface (graphs/models/arch.py, graphs/models/archs/): a new module is found without
editing a list; the interface and its capabilities are checked when a class registers; tensor
names are gguf-py's; no module outside graphs/models/archs/ names an architecture module; the
shared graph types and the head-group join serve every architecture.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from ggraph import ops as O
from ggraph.ir.graph import Graph
from ggraph.graphs.models import archs, model_graph
from ggraph.graphs.runtime import engine
from ggraph.graphs.models.arch import (ARCHITECTURES, Architecture, MLAPlanner, architectures_with,
                                discover_architectures, model_class, register_arch, supports)
from ggraph.graphs.models.attention import HeadJoin
from ggraph.graphs.gguf.gguf_file import GGUFError, GGUFModel
from ggraph.graphs.models.tensor_names import TensorNames, expect_tensor
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Context
from paths import ROOT


TOY_MODULE = '''
"""A toy architecture written by tests/graphs/models/test_archs.py."""
from ggraph.graphs.models.arch import Architecture, register_arch
from ggraph.graphs.models.tensor_names import TensorNames


@register_arch("toy")
class ToyModel(Architecture):
    hparams_class = dict
    tensors = TensorNames.of("llama")

    def __init__(self, gguf, **overrides):
        self.gguf = gguf

    def new_cache(self, ctx, size, type_k="f16", type_v="f16", flash_attn=False, n_ubatch=512):
        return None

    def graph_capacity(self, n_tokens, n_kv, amb_mib):
        return 8

    def build(self, ctx, cache, n_tokens, n_kv, n_outputs, flash_attn=False, amb_mib=0):
        raise NotImplementedError

    def batch_inputs(self, mg, cache, tokens, n_past, out_rows):
        return {}
'''


@pytest.fixture
def scratch_archs(tmp_path, monkeypatch):
    """A folder added to the graphs.archs package: a module written there is an architecture
    module like those in graphs/models/archs/. Registrations and imports made from it are undone."""
    before = dict(discover_architectures())
    monkeypatch.setattr(archs, "__path__", list(archs.__path__) + [str(tmp_path)])
    yield tmp_path
    for name in set(ARCHITECTURES) - set(before):
        del ARCHITECTURES[name]
    for mod in [m for m in sys.modules if m.startswith(archs.__name__ + ".toy")]:
        del sys.modules[mod]


def test_a_new_module_is_found_without_editing_a_list(scratch_archs):
    with pytest.raises(GGUFError, match="unknown architecture 'toy'"):
        model_class("toy")
    (scratch_archs / "toy_arch.py").write_text(TOY_MODULE)
    cls = model_class("toy")
    assert cls.__module__ == "ggraph.graphs.models.archs.toy_arch" and cls.arch_name == "toy"
    assert issubclass(cls, Architecture) and not supports(cls, MLAPlanner)
    assert {"toy", "llama", "deepseek2"} <= set(discover_architectures())


def test_builtin_architectures_are_modules_of_the_package():
    found = discover_architectures()
    assert {"llama", "deepseek2", "qwen2", "qwen3"} <= set(found)
    for name, cls in found.items():
        assert cls.__module__.startswith("ggraph.graphs.models.archs."), (name, cls.__module__)
        assert cls.arch_name == name
    known = ", ".join(sorted(found))       # every registered builder, in order
    with pytest.raises(GGUFError, match=r"x\.gguf: unknown architecture 'mamba9'; ggraph "
                                        r"builds " + re.escape(known)):
        model_class("mamba9", "x.gguf")
    llama = ARCHITECTURES.pop("llama")       # the registry is rebuilt from the package
    assert model_class("llama") is llama


def test_capabilities_are_declared_not_sniffed():
    ds, llama = model_class("deepseek2"), model_class("llama")
    assert supports(ds, MLAPlanner) and not supports(llama, MLAPlanner)
    assert architectures_with(MLAPlanner) == ["deepseek2"]
    with pytest.raises(ValueError, match="not a capability"):
        supports(ds, dict)


def test_registration_checks_the_interface():
    class Partial(Architecture):
        def __init__(self, gguf, **overrides):
            pass

        def new_cache(self, ctx, size, type_k="f16", type_v="f16", flash_attn=False, n_ubatch=512):
            return None

    with pytest.raises(TypeError, match="does not implement batch_inputs, build, "
                                        "graph_capacity"):
        register_arch("partial")(Partial)
    with pytest.raises(TypeError, match="not an Architecture subclass"):
        register_arch("plain")(dict)
    with pytest.raises(ValueError, match="registered twice"):
        register_arch("llama")(type("Llama2", (model_class("deepseek2"),), {}))
    assert "partial" not in ARCHITECTURES and "plain" not in ARCHITECTURES
    assert ARCHITECTURES["llama"].__name__ == "LlamaModel"


@pytest.mark.parametrize("arch", ["llama", "deepseek2"])
def test_tensor_names_are_gguf_pys(arch):
    names = model_class(arch).tensors
    want = {TENSOR_NAMES[t] for t in MODEL_TENSORS[getattr(MODEL_ARCH, arch.upper())]}
    assert set(names.templates.values()) == want
    assert names("attn_norm", 7) == "blk.7.attn_norm.weight"
    assert names("token_embd") == "token_embd.weight"
    with pytest.raises(ValueError, match="give its layer"):
        names("attn_norm")
    with pytest.raises(ValueError, match="not a per-layer tensor"):
        names("output", 3)


def test_tensor_names_refuse_what_the_architecture_lacks():
    assert TensorNames.of("deepseek2")("exp_probs_b", 2, "bias") == "blk.2.exp_probs_b.bias"
    with pytest.raises(KeyError, match="'llama' has no tensor 'attn_kv_b'"):
        TensorNames.of("llama")("attn_kv_b", 0)
    with pytest.raises(KeyError, match="knows no architecture 'toy-mlp'"):
        TensorNames.of("toy-mlp")


def test_expect_tensor_marks_use_and_names_file_and_tensor():
    ctx = Context("w")
    t = ctx.new_tensor("f32", (4, 3), name="blk.0.attn_q.weight")
    gguf = GGUFModel("m.gguf", {}, {t.name: t}, ctx, 0, 0)
    names = TensorNames.of("llama")
    assert expect_tensor(gguf, names, "attn_q", (4, 3), 0) is t
    assert gguf.used == {"blk.0.attn_q.weight"}
    assert expect_tensor(gguf, names, "attn_k", (4, 3), 0, optional=True) is None
    with pytest.raises(GGUFError, match=r"m\.gguf: tensor 'blk\.0\.attn_k\.weight' is missing"):
        expect_tensor(gguf, names, "attn_k", (4, 3), 0)
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has ne=\[4, 3\], expected "
                                        r"\[4, 4\]"):
        expect_tensor(gguf, names, "attn_q", (4, 4), 0)


def test_no_module_outside_the_package_names_an_architecture_module():
    """Nothing imports a builder to register it or to borrow its types."""
    pattern = re.compile(r"(graphs\.archs\.\w+|from \.archs import|from \.\.archs import|"
                         r"graphs\.(llama|deepseek2)\b|from \.(llama|deepseek2) import|"
                         r"hasattr\(\w+, \"mla_shape\"\))")
    files = [p for p in (ROOT / "graphs").rglob("*.py") if "archs" not in p.parts]
    files += list((ROOT / "tools").glob("*.py"))
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
            for m in pattern.finditer(p.read_text())]
    assert hits == []


def test_shared_graph_types_come_from_one_module(tmp_path):
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2
    from ggraph.graphs.gguf.gguf_file import load_gguf

    assert engine.ModelGraph is model_graph.ModelGraph
    path = write_tiny_deepseek2(tmp_path / "ds.gguf", TinyDeepSeek2(n_layer=2))
    m = model_class("deepseek2")(load_gguf(path))
    ctx = Context()
    cache = m.new_cache(ctx, 64)
    mg = m.build(ctx, cache, 4, 64, 1)
    assert isinstance(mg, model_graph.ModelGraph) and mg.path == "absorbed"
    assert isinstance(mg.inputs, model_graph.GraphInputs) and mg.inputs.v_idxs is None
    values = m.batch_inputs(mg, cache, np.arange(4), 0, np.array([3]))
    assert list(values[mg.inputs.k_idxs]) == [0, 1, 2, 3] and mg.inputs.pos in values


def test_head_join_copies_each_group_into_its_heads():
    """Three head groups of [hd, nh, T] joined into [hd * H, T] in order, as both attention
    paths use it."""
    rng = np.random.default_rng(0)
    hd, H, T = 4, 6, 3
    ctx = Context()
    like = ctx.new_tensor("f32", (hd, H, T), "like").set_input()
    parts = [(0, 2), (2, 3), (5, 1)]
    srcs = [ctx.new_tensor("f32", (hd, nh, T), f"g{i}").set_input()
            for i, (_, nh) in enumerate(parts)]
    graph = Graph()
    join = HeadJoin.fill(like, il=0)
    for step, ((h0, _), src) in enumerate(zip(parts, srcs)):
        join.put(O.scale(src, 1.0), h0, step, graph)
    out = join.result()
    assert out.name == "kqv_out-0" and tuple(out.ne[:2]) == (hd * H, T)
    graph.build_forward_expand(out)
    vals = {t: rng.standard_normal(tuple(reversed(t.ne[:3]))).astype(np.float32)
            for t in [like] + srcs}
    got = run_reference(graph, vals).read(out).reshape(T, H, hd)
    want = np.concatenate([vals[s] for s in srcs], axis=1)          # (T, H, hd)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    names = [n.name for n in graph.nodes]
    assert "kqv_split-0" in names and "kqv_split-0-s2" in names


def test_head_join_refuses_a_buffer_it_cannot_copy_into():
    ctx = Context()
    with pytest.raises(ValueError, match="contiguous F32"):
        HeadJoin(ctx.new_tensor("f16", (4, 2, 3), "half"), il=1)

