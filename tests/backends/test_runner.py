"""The runner interface (backends/runner.py, #14): a Session (one backend) and a MultiSession
(several, through the scheduler) are driven the same way, and the Engine uses nothing else.

A second CPUBackend stands in for a device, as in tests/core/plan/test_sched.py."""
from __future__ import annotations

import re

import numpy as np
import pytest

import ggraph.graphs.runtime.engine as engine_mod
from ggraph import Context, build_graph, ops
from ggraph.backends.base import Session
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.multi import MultiSession
from ggraph.backends.runner import ComputeBuffer, Runner
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

# what the Engine may touch on its runner: the Protocol's members and nothing else
RUNNER_API = {"names", "placement", "place", "reserve", "plans", "run", "read", "write",
              "synchronize", "memory_figures"}


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models.made(write_tiny_llama,
                            TinyLlama(n_layer=4, n_embd=128, weight_type="q8_0"))


def _chain(n: int):
    """x -> scale -> add 1 (x of n floats); returns (graph, x, out)."""
    ctx = Context()
    x = ctx.new_tensor("f32", (n,), name="x").set_input()
    out = ops.add(ops.scale(x, 2.0), ctx.from_numpy(np.ones(n, np.float32), name="one"))
    out.set_output()
    return build_graph(out), x, out


@pytest.mark.parametrize("make", [lambda: CPUBackend().session(),
                                  lambda: MultiSession([CPUBackend(), CPUBackend()])],
                         ids=["session", "multi"])
def test_both_runners_reserve_run_read_alike(make):
    r = make()
    assert isinstance(r, Runner)
    big, _, _ = _chain(64)
    g, x, out = _chain(16)
    assert r.plans == []
    bufs = r.reserve(big)
    assert all(isinstance(b, ComputeBuffer) for b in bufs)
    assert [b.device for b in bufs] == r.names and r.names[-1] == "CPU"
    assert r.plans == bufs and bufs[-1].size > 0
    xv = np.arange(16, dtype=np.float32)
    with r:
        np.testing.assert_array_equal(r.run(g, {x: xv}).read(out).ravel(), 2 * xv + 1)
    # reserving again after a run: the next run plans at the new offsets, values stay right
    r.reserve(big)
    np.testing.assert_array_equal(r.run(g, {x: xv + 1}).read(out).ravel(),
                                  2 * xv + 3)
    with pytest.raises(ValueError, match="placed on device 7"):
        r.place(x, 7)


def test_session_reserve_is_the_allocators_reservation():
    s = CPUBackend().session()
    big, _, _ = _chain(256)
    (buf,) = s.reserve(big)
    assert buf.plan is s.allocator.reserved and buf.device == "CPU"
    g, x, out = _chain(8)
    s.run(g, {x: np.zeros(8, np.float32)})
    assert s.plan.size == buf.size          # placed into the reserved buffer, not re-planned


class _OnlyTheInterface:
    """Wraps a runner and refuses anything outside the Runner Protocol."""

    def __init__(self, inner: Runner) -> None:
        self._inner = inner
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        if name not in RUNNER_API:
            raise AttributeError(f"the Engine used {name!r}, outside the runner interface")
        self.used.add(name)
        return getattr(self._inner, name)

    def __enter__(self):
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@pytest.mark.parametrize("devices", ["", "cpu"])
def test_engine_uses_only_the_runner_interface(tiny, devices, monkeypatch):
    made = []

    def wrapped(*a, **kw):
        runner, layers = new_runner(*a, **kw)
        made.append(_OnlyTheInterface(runner))
        return made[-1], layers

    new_runner = engine_mod.new_runner
    monkeypatch.setattr(engine_mod, "new_runner", wrapped)
    cfg = dict(n_ctx=128, n_ubatch=8, devices=devices, n_gpu_layers=3 if devices else -1)
    eng = Engine(tiny, EngineConfig(**cfg))
    ref = Engine(tiny, EngineConfig(n_ctx=128, n_ubatch=8))
    toks = [3, 4, 5, 6, 7, 8, 9, 10, 11]               # two ubatches
    np.testing.assert_array_equal(eng.eval(toks, all_logits=True),
                                  ref.eval(toks, all_logits=True))
    assert list(eng.generate([5, 6], 3, stop_at_eos=False)) == \
        list(ref.generate([5, 6], 3, stop_at_eos=False))
    lines = eng.memory_lines()
    assert {"reserve", "run", "read", "memory_figures", "place"} <= made[0].used
    # reserve went through the runner, host last, and reserve_plan is the host's Plan
    assert [b.device for b in eng.reserve_plans] == eng.device_names
    assert eng.reserve_plan is eng.reserve_plans[-1].plan
    assert f"CPU compute buffer size = {eng.reserve_plan.size / 2**20:10.2f} MiB" in \
        "\n".join(lines)


def test_engine_memory_lines_one_device_and_two(tiny):
    one = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=64, amb_mib=1))
    assert isinstance(one.runner, Session) and one.device_names == ["CPU"]
    lines = one.memory_lines()
    assert re.fullmatch(r"CPU_Mapped model buffer size = +[\d.]+ MiB", lines[0])
    # the packed copies of the quantized weights, as llama.cpp prints its repack buffer
    packed = one.runner.backend.packs.nbytes
    assert packed > 0
    assert lines.pop(1) == f"CPU_REPACK model buffer size = {packed / 2**20:10.2f} MiB"
    assert lines[1].startswith("llama_kv_cache: size =")
    assert re.fullmatch(r"CPU compute buffer size = +[\d.]+ MiB \(ggml-alloc's plan: [\d.]+ "
                        r"MiB\)", lines[2])
    assert lines[3] == f"graph nodes  = {one.worst_case.graph.n_nodes}" and len(lines) == 4
    two = Engine(tiny, EngineConfig(n_ctx=256, n_ubatch=4, devices="cpu", n_gpu_layers=3))
    assert isinstance(two.runner, MultiSession) and two.device_names == ["CPU1", "CPU"]
    lines = two.memory_lines()
    assert lines[0].startswith("load_tensors: offloaded 3/4 repeating layers")
    assert [ln.split(" compute")[0] for ln in lines if " compute buffer" in ln] == \
        ["CPU1", "CPU"]
    assert "(ggml-alloc's plan" not in "\n".join(lines)
    assert lines[-2:] == [f"graph nodes  = {two.worst_case.graph.n_nodes}", "graph splits = 3"]
    # one device places every weight and cache tensor on device 0, through the same call
    assert one.runner.placement and set(one.runner.placement.values()) == {0}
    assert one.runner.placement[one.cache.k[0]] == 0


def test_a_session_keeps_the_last_graphs_bound():
    """Alternating between graphs (ubatch widths, a draft and its check) binds each once;
    a graph whose arena was replaced (a bigger graph ran) is planned and bound again."""
    s = CPUBackend(n_threads=1).session()
    (ga, xa, oa), (gb, xb, ob) = _chain(8), _chain(16)
    calls = {}
    for rep in range(3):
        for g, x, o, n in ((ga, xa, oa, 8), (gb, xb, ob, 16)):
            v = np.arange(n, dtype=np.float32) + rep
            assert np.array_equal(s.run(g, {x: v}).read(o).reshape(-1), 2 * v + 1)
            if rep <= 1:   # (the second graph outgrew the first arena: both bound again once)
                calls[n] = s.bound_calls
            assert s.bound_calls is calls[n]        # the same bound calls, not bound again
    gc, xc, oc = _chain(1 << 16)                    # outgrows the arena: a new one
    s.run(gc, {xc: np.zeros(1 << 16, np.float32)})
    v = np.ones(8, np.float32)
    assert np.array_equal(s.run(ga, {xa: v}).read(oa).reshape(-1), 2 * v + 1)
    assert s.bound_calls is not calls[8]
