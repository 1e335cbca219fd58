"""Observed runs on CUDA (backends/observe.py) under numba's CUDA simulator, on a small decode
layer whose three CUDA fusion groups (norm chain, mat-vec + residual add, gate/up + swiglu:
backends/cuda/fusion.py) all fuse when nobody watches: asked for every node, each group
writes or unfuses its intermediates, every value equals the one the node has when the
planner keeps it alive, and the output is bitwise the unobserved run's. The same on a CUDA
device beside the CPU host (MultiSession)."""
from __future__ import annotations

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

from ggraph import Context, GGMLType as T, build_graph, ops as O  # noqa: E402
from ggraph.backends.base import Recorder  # noqa: E402
from ggraph.backends.cpu import CPUBackend  # noqa: E402
from ggraph.backends.cuda import CUDABackend  # noqa: E402
from ggraph.backends.multi import MultiSession  # noqa: E402

pytestmark = pytest.mark.cudasim
BACKEND = CUDABackend()
K, F = 64, 96


def _layer(all_outputs: bool = False):
    """x -> rms_norm * w + bias -> Wo @ . + x -> swiglu(Wg @ ., Wu @ .) -> Wd @ . + residual:
    the graph, its inputs, its weights and its output (one column: the mat-vec path)."""
    rng = np.random.default_rng(3)
    ctx = Context("observe")
    x = ctx.new_tensor(T.F32, (K, 1), "x").set_input()

    def weight(name, ne, lo=-1.0, hi=1.0, t=T.F32):
        return ctx.new_tensor(t, ne, name).set_data(rng.uniform(lo, hi, ne[::-1]))

    w, bias = weight("w", (K,), 0.5, 1.5), weight("bias", (K,))
    wo, wg = weight("wo", (K, K), t=T.Q8_0), weight("wg", (K, F), t=T.Q8_0)
    wu, wd = weight("wu", (K, F), t=T.Q8_0), weight("wd", (F, K), t=T.Q8_0)
    h = O.add(O.mul(O.rms_norm(x, 1e-6).set_name("norm"), w).set_name("normw"),
              bias).set_name("attn_norm")
    res = O.add(O.mul_mat(wo, h).set_name("attn_out"), x).set_name("ffn_inp")
    glu = O.swiglu(O.mul_mat(wg, res).set_name("gate"),
                         O.mul_mat(wu, res).set_name("up")).set_name("glu")
    out = O.add(O.mul_mat(wd, glu).set_name("down"), res).set_name("out").set_output()
    g = build_graph(out)
    if all_outputs:
        for n in g.nodes:
            n.set_output()
    inputs = {x: rng.uniform(-1, 1, (1, K)).astype(np.float32)}
    return g, inputs, (wo, wg, wu, wd), out


def _runner(multi: bool, weights):
    if not multi:
        return BACKEND.session()
    # the down projection's weight on the host: the layer's end runs on the CPU
    return MultiSession([BACKEND, CPUBackend()],
                        placement={t: int(t.name == "wd") for t in weights})


@pytest.mark.parametrize("multi", [False, True], ids=["cuda", "cuda_and_cpu"])
def test_every_node_observed_on_cuda(multi):
    g, inputs, weights, out = _layer()
    plain = _runner(multi, weights)
    plain.run(g, inputs)
    want_out = plain.read(out)
    if not multi:   # unobserved, the three groups fuse
        assert [len(grp) for grp in plain.bind_calls(plain.plan.order, fuse=True)[1]
                if len(grp) > 1] == [3, 2, 3, 2]
    rec = Recorder()
    observed = _runner(multi, weights)
    observed.run(g, inputs, observe=rec.observer)
    if multi:       # split over both devices
        assert {s.device for s in observed.schedule(g).splits} == {0, 1}
    np.testing.assert_array_equal(observed.read(out), want_out)
    assert sorted(n.name for n in rec.order) == sorted(n.name for n in g.nodes)
    kept, kept_inputs, kept_weights, _ = _layer(all_outputs=True)
    ref = _runner(multi, kept_weights)
    ref.run(kept, kept_inputs)
    for a, b in zip(g.nodes, kept.nodes):
        np.testing.assert_array_equal(rec.values[a], ref.read(b), err_msg=a.name)
