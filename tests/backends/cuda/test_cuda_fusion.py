"""CUDA's fusion pass (backends/cuda/fusion.py) under numba's CUDA simulator: norm chains and
mat-vec + residual add run as one launch each, with the numpy reference's values; groups are
refused when an intermediate is read later or memory overlaps.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()


from ggraph import Context, GGMLType as T, build_graph, ops as O  # noqa: E402
from ggraph.backends.cuda import CUDABackend  # noqa: E402
from ggraph.check.conformance import compare  # noqa: E402
from ggraph.ir.opkind import OpKind  # noqa: E402
from ggraph.check.reference import run_reference  # noqa: E402

pytestmark = pytest.mark.cudasim
sys.setswitchinterval(5e-4)
BACKEND = CUDABackend()


def _layer(wt: T, n: int, keep_norm: bool = False, keep_mm: bool = False):
    """x -> rms_norm * w + bias -> W @ . + x (a transformer block's two fusable groups)."""
    rng = np.random.default_rng(0)
    ctx = Context("fuse")
    k = 64
    x = ctx.new_tensor(T.F32, (k, n), "x").set_input()
    w = ctx.new_tensor(T.F32, (k,), "w").set_data(rng.uniform(0.5, 1.5, k))
    bias = ctx.new_tensor(T.F32, (k,), "bias").set_data(rng.uniform(-1, 1, k))
    W = ctx.new_tensor(wt, (k, k), "W").set_data(rng.uniform(-1, 1, (k, k)))
    nrm = O.rms_norm(x, 1e-6)
    h = O.add(O.mul(nrm, w), bias)
    mm = O.mul_mat(W, h)
    out = O.add(mm, x)
    out.set_output()
    if keep_norm:
        nrm.set_output()
    if keep_mm:
        mm.set_output()
    return build_graph(out), {x: rng.uniform(-1, 1, (n, k))}, (nrm, mm, out)


def _run(graph, inputs):
    s = BACKEND.session()
    s.run(graph, inputs)
    return s


@pytest.mark.parametrize("wt", [T.F32, T.Q4_1, T.Q8_0])
def test_norm_chain_and_mat_vec_add_fuse(wt):
    graph, inputs, (nrm, mm, out) = _layer(wt, 2)
    s = _run(graph, inputs)
    fused = [g for g in s._groups if len(g) > 1]
    assert [[n.op for n in g] for g in fused] == [
        [OpKind.RMS_NORM, OpKind.MUL, OpKind.ADD], [OpKind.MUL_MAT, OpKind.ADD]]
    ref = run_reference(graph, inputs)
    ok, err, why = compare(ref.read(out), s.read(out), 1e-6)
    assert ok, f"nmse={err:.2e} {why}"


def test_intermediates_read_later_are_written():
    """The norm and the product are outputs too: the norm chain writes the norm's values;
    the product, which the add would leave unwritten, is not fused."""
    graph, inputs, (nrm, mm, out) = _layer(T.F32, 1, keep_norm=True, keep_mm=True)
    s = _run(graph, inputs)
    ops = [[n.op for n in g] for g in s._groups if len(g) > 1]
    assert ops == [[OpKind.RMS_NORM, OpKind.MUL, OpKind.ADD]]
    ref = run_reference(graph, inputs)
    for t in (nrm, mm, out):
        ok, err, why = compare(ref.read(t), s.read(t), 1e-6)
        assert ok, f"{t.label}: nmse={err:.2e} {why}"


def test_many_columns_take_the_tiled_kernel_unfused():
    graph, inputs, (_, _, out) = _layer(T.F32, 12)
    s = _run(graph, inputs)
    assert [[n.op for n in g] for g in s._groups if len(g) > 1] == [
        [OpKind.RMS_NORM, OpKind.MUL, OpKind.ADD]]
    ok, err, why = compare(run_reference(graph, inputs).read(out), s.read(out), 1e-6)
    assert ok, why


@pytest.mark.parametrize("wt", [T.F16, T.Q4_1])
def test_gate_up_and_swiglu_fuse(wt):
    """The FFN's gate and up mat-vecs and their GLU, one launch; down + residual another."""
    rng = np.random.default_rng(1)
    ctx = Context("glu")
    k, f = 64, 96
    x = ctx.new_tensor(T.F32, (k, 2), "x").set_input()
    g, u = (ctx.new_tensor(wt, (k, f), n).set_data(rng.uniform(-1, 1, (f, k)))
            for n in ("gate.weight", "up.weight"))
    down = ctx.new_tensor(wt, (f, k), "down.weight").set_data(rng.uniform(-1, 1, (k, f)))
    out = O.add(O.mul_mat(down, O.swiglu(O.mul_mat(g, x), O.mul_mat(u, x))), x)
    out.set_output()
    graph, inputs = build_graph(out), {x: rng.uniform(-1, 1, (2, k))}
    s = _run(graph, inputs)
    assert [[n.op for n in grp] for grp in s._groups if len(grp) > 1] == [
        [OpKind.MUL_MAT, OpKind.MUL_MAT, OpKind.SWIGLU], [OpKind.MUL_MAT, OpKind.ADD]]
    ok, err, why = compare(run_reference(graph, inputs).read(out), s.read(out), 1e-6)
    assert ok, f"nmse={err:.2e} {why}"


def test_tiny_llama_decodes_fused_as_the_cpu(tmp_path):
    """A whole model's decode steps on CUDA with every group the pass finds (the GLU over x's
    freed memory falls back to the gate/up pair): the CPU's logits and greedy tokens."""
    from ggraph.check.conformance import nmse
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    p = write_tiny_llama(tmp_path / "t.gguf", TinyLlama(n_layer=1, n_embd=32, n_head=2,
                                                        n_head_kv=1, n_ff=48))
    cfg = dict(n_ctx=16, n_ubatch=4, reserve_outputs="last")
    cpu, gpu = Engine(str(p), EngineConfig(**cfg)), Engine(str(p), EngineConfig(backend="cuda",
                                                                                 **cfg))
    a, b = cpu.eval([3, 1]), gpu.eval([3, 1])
    for _ in range(2):
        assert nmse(a, b) < 1e-6
        tok = int(np.argmax(a))
        assert tok == int(np.argmax(b))
        a, b = cpu.eval([tok]), gpu.eval([tok])
    kinds = {tuple(n.op for n in g) for g in gpu.session._groups if len(g) > 1}
    assert (OpKind.MUL_MAT, OpKind.ADD) in kinds
    assert {(OpKind.MUL_MAT, OpKind.MUL_MAT), (OpKind.MUL_MAT, OpKind.MUL_MAT,
                                               OpKind.SWIGLU)} & kinds
    assert any(k[0] == OpKind.RMS_NORM for k in kinds)


def test_fusion_off_gives_the_same_values(monkeypatch):
    from ggraph.backends.cuda import fusion

    graph, inputs, (_, _, out) = _layer(T.Q4_1, 1)
    fused = _run(graph, inputs).read(out)
    monkeypatch.setattr(fusion, "ENABLED", False)
    s = _run(graph, inputs)
    assert all(len(g) == 1 for g in s._groups)
    np.testing.assert_array_equal(s.read(out), fused)  # same float32 operations, same order
