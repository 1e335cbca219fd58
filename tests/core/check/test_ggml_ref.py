"""ggraph against the real libggml (ggraph.check.ggml_ref, through cffi).

Skipped, saying why, where libggml is not installed (`pip install llama-cpp-python` builds it;
benchmarks/compare_ggml.sh installs it and runs the full comparison). Otherwise: the library
loads and its layout and enums check out, a representative subset of op cases agrees between
ggml and ggraph (numpy reference and CPU backend), what ggml cannot express is refused with a
reason, and ggraph's `ggml` allocator strategy plans exactly ggml_gallocr's buffer size on a
few graphs.
"""
from __future__ import annotations

import importlib.util
import random
import sys

import numpy as np
import pytest

from ggraph.check import ggml_ref
from ggraph.plan.alloc import plan_graph
from ggraph.check.conformance import cases_for, compare, run_case
from ggraph.ir.graph import build_graph
from ggraph.ir.opkind import OpKind
from ggraph.check.reference import run_reference
from paths import TESTS

try:
    LIB = ggml_ref.load()
    WHY = ""
except ggml_ref.GGMLUnavailable as e:
    LIB, WHY = None, str(e)

needs_ggml = pytest.mark.skipif(LIB is None, reason=f"libggml not available: {WHY}")


def test_missing_library_error_names_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.delenv(ggml_ref.ENV_VAR, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ggml_ref.GGMLUnavailable) as e:
        ggml_ref.find_libggml()
    msg = str(e.value)
    assert "$GGRAPH_LIBGGML (not set)" in msg and "llama_cpp package (not installed)" in msg
    assert "pip install llama-cpp-python" in msg


def test_a_wrong_env_directory_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv(ggml_ref.ENV_VAR, str(tmp_path))
    with pytest.raises(ggml_ref.GGMLUnavailable, match="holds no libggml-base"):
        ggml_ref.find_libggml()


def _cases():
    """The first case of every op, plus the quantized, strided and tricky ones."""
    seen: set[OpKind] = set()
    picked = []
    want = ("type=q4_1", "type=q8_0,m=16,n=9", "type_kv=q8_0", "sinks=True", "max_bias=8.0,s",
            "freq_factors", "ext_factor=1.0", "type_dst=q4_0", "type=bf16,type_idx=i32",
            "TOP_K(ne=[64,5,3]", "src=permuted")
    for c in cases_for(None):
        if c.op not in seen or any(w in c.label for w in want):
            seen.add(c.op)
            picked.append(c)
    return picked


CASES = _cases()


@needs_ggml
def test_library_checks():
    assert LIB.alignment == 32  # ggml's CPU TENSOR_ALIGNMENT, what ggraph's CPU plans use
    assert LIB.op_names[LIB.op[OpKind.MUL_MAT]] == "MUL_MAT"
    assert not LIB.missing, LIB.missing


@needs_ggml
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_case_agrees_with_ggml(case):
    ref = ggml_ref.GGMLReference()
    _, out = case.make()
    out.set_output()
    graph = build_graph(out)
    ok, why = ref.supports(graph)
    if not ok:
        assert why
        return
    got = ref.run(graph, out)
    good, err, detail = compare(run_reference(graph).read(out), got, case.tol)
    assert good, f"ggml vs numpy reference: nmse={err:.3e} > {case.tol} {detail}"


@needs_ggml
def test_cpu_backend_against_ggml():
    from ggraph.backends import get_backend

    backend = get_backend("cpu")
    ref = ggml_ref.GGMLReference()
    labels = ("MUL_MAT(type=q4_0,m=16,n=9", "SOFT_MAX(mask=f16,scale=0.5",
              "ROPE(type=f32,mode=2,n_dims=64,freq_scale=0.25,ext", "RMS_NORM(ne=[64,5,3])")
    cases = [c for c in cases_for(None) if c.label.startswith(labels)]
    assert len(cases) == len(labels)
    for c in cases:
        r = run_case(c, backend, reference=ref)
        assert r.status == "OK", r.line()


@needs_ggml
def test_unsupported_params_are_refused_with_a_reason():
    case = next(c for c in cases_for([OpKind.SOFT_MAX]) if "head_offset=2" in c.label)
    _, out = case.make()
    ok, why = ggml_ref.GGMLReference().supports(build_graph(out))
    assert not ok and "head offset" in why
    strided = next(c for c in cases_for([OpKind.ADD]) if "strided" in c.label)
    _, out = strided.make()
    ok, why = ggml_ref.GGMLReference().supports(build_graph(out))
    assert not ok and "packed rows" in why


@needs_ggml
def test_ggml_abort_becomes_an_exception():
    def boom() -> None:  # a reshape that changes the element count: GGML_ASSERT aborts
        lib = ggml_ref.load()
        ctx = lib.base.ggml_init({"mem_size": 1 << 16, "mem_buffer": lib.ffi.NULL,
                                  "no_alloc": True})
        t = lib.base.ggml_new_tensor_4d(ctx, 0, 4, 4, 1, 1)
        lib.base.ggml_reshape_4d(ctx, t, 5, 4, 1, 1)
    with pytest.raises(ggml_ref.GGMLAborted, match="GGML_ASSERT"):
        ggml_ref.isolated(boom)


def _alloc_graphs():
    sys.path.insert(0, str(TESTS))
    from plan_cases import random_graph

    from ggraph.tools.ggml_ref import attention_graph, valid_random_graph

    yield "random-props", "raw", [random_graph(random.Random(s), 40)[0] for s in range(10)]
    yield "valid-random", "ops", [valid_random_graph(s, 50) for s in range(3)]
    yield "attention", "ops", [attention_graph(), attention_graph(flash=True),
                               attention_graph(amb=2, T=64, n_kv=4096)]


@needs_ggml
@pytest.mark.parametrize("name,mode,graphs", list(_alloc_graphs()), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_allocator_matches_ggml_gallocr(name, mode, graphs):
    for g in graphs:
        assert plan_graph(g, 32, strategy="ggml").size == \
            ggml_ref.ggml_gallocr_size(g, 32, mode=mode)


@needs_ggml
def test_tiny_llama_graph_matches_ggml_gallocr(tmp_path):
    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama
    from ggraph.ir.tensor import Context

    gguf = load_gguf(write_tiny_llama(tmp_path / "t.gguf", TinyLlama(weight_type="q8_0")))
    model = model_class(gguf.arch, gguf.path)(gguf)
    for flash in (False, True):
        ctx = Context()
        cache = model.new_cache(ctx, 256, flash_attn=flash)
        g = model.build(ctx, cache, 16, 256, 16, flash).graph
        assert plan_graph(g, 32, strategy="ggml").size == ggml_ref.ggml_gallocr_size(g, 32)


@needs_ggml
def test_alignment_other_than_the_cpu_buffer_type_is_refused():
    with pytest.raises(ValueError, match="aligns to 32"):
        ggml_ref.ggml_gallocr_size(build_graph(np_leaf_graph()), 128)


def np_leaf_graph():
    from ggraph import ops as O
    from ggraph.ir.tensor import Context

    x = Context().from_numpy(np.ones((2, 32), np.float32))
    return O.silu(x)
