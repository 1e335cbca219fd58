"""The replay of a bound graph on a GPU (backends/cuda/replay.py) against a fake driver: when
it captures a CUDA graph, that later runs are one cuGraphLaunch, and that a capture that fails
falls back to launch-by-launch without losing the step. (On a real GPU `ggraph gpu-check`
checks the same through decode tokens/s and the conformance of a replayed graph.)"""
from __future__ import annotations

import os
import types

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/run_cudasim.sh): the CUDA modules are "
                "imported in the simulator's process only", allow_module_level=True)

from ggraph.backends.cuda import replay  # noqa: E402

pytestmark = pytest.mark.cudasim


class FakeDriver:
    """The few cuda.bindings.driver calls replay.py makes, recorded."""

    class CUstreamCaptureMode:
        CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 2

    def __init__(self, fail_begin: bool = False) -> None:
        self.log: list[str] = []
        self.fail_begin = fail_begin
        self.capturing = False

    def cuStreamBeginCapture(self, handle, mode):
        self.log.append("begin")
        if self.fail_begin:
            return (801,)  # CUDA_ERROR_NOT_SUPPORTED
        self.capturing = True
        return (0,)

    def cuStreamEndCapture(self, handle):
        self.log.append("end")
        self.capturing = False
        return (0, "graph")

    def cuGraphInstantiate(self, graph, flags):
        self.log.append("instantiate")
        return (0, "exec")

    def cuGraphLaunch(self, exec_, handle):
        self.log.append("graph")
        return (0,)

    def cuGraphExecDestroy(self, exec_):
        return (0,)


def _calls(log, driver, raise_in_capture=False):
    def launch(i):
        def call():
            if raise_in_capture and driver.capturing:
                raise RuntimeError("operation not permitted when stream is capturing")
            log.append(f"k{i}" + ("(captured)" if driver.capturing else ""))
        return call
    return replay.CallList([launch(0), launch(1)], types.SimpleNamespace(handle=7), True)


def test_third_run_captures_and_later_runs_launch_the_graph(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(replay, "_driver", lambda: drv)
    log: list[str] = []
    calls = _calls(log, drv)
    for _ in range(5):
        replay.run_calls(calls)
        log.append("|")
    log += drv.log
    assert log[:10] == ["k0", "k1", "|", "k0", "k1", "|", "k0(captured)", "k1(captured)", "|",
                        "|"]
    assert drv.log == ["begin", "end", "instantiate", "graph", "graph", "graph"]
    assert calls.exec == "exec" and calls.capture


def test_a_failed_capture_runs_the_step_and_falls_back(monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(replay, "_driver", lambda: drv)
    log: list[str] = []
    calls = _calls(log, drv, raise_in_capture=True)
    for _ in range(4):
        replay.run_calls(calls)
    assert not calls.capture and "not permitted" in calls.why_not
    assert drv.log == ["begin", "end"]  # no graph launched, ever
    assert log == ["k0", "k1", "k0", "k1", "k0", "k1", "k0", "k1"]  # every step ran


def test_a_driver_without_capture_falls_back(monkeypatch):
    drv = FakeDriver(fail_begin=True)
    monkeypatch.setattr(replay, "_driver", lambda: drv)
    log: list[str] = []
    calls = _calls(log, drv)
    for _ in range(3):
        replay.run_calls(calls)
    assert not calls.capture and "cuStreamBeginCapture" in calls.why_not
    assert log == ["k0", "k1"] * 3


def test_prepared_launch_keeps_the_dispatcher_where_it_cannot_prepare():
    """In the simulator numba has no compiled overloads to reuse: every call dispatches."""
    ran = []

    class Kernel:
        def __getitem__(self, cfg):
            return lambda *a: ran.append(a)

    p = replay.PreparedLaunch(Kernel(), 1, 32, object(), (1, 2))
    for _ in range(3):
        p()
    assert ran == [(1, 2)] * 3 and p.fast is None and p.calls == -1
