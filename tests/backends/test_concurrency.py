"""Threads sharing an Engine or a Session take turns (#13): no crash, no wrong numbers, and a
clear error where sharing cannot be made safe (a read after another thread's run, a generation
whose KV cache another caller changed). Threads run with a join timeout, and faulthandler
ends the process with every thread's stack if a test hangs past its guard."""
from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends import get_backend
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from paths import ROOT, TESTS

N_ENGINE_CALLS = 400     # per thread
N_SESSION_CALLS = 200    # per thread
JOIN_S = 240             # a thread still running after this is a hang


@pytest.fixture(autouse=True)
def hang_guard():
    """A deadlock must fail CI, not stall it: dump every stack and exit past the guard."""
    faulthandler.dump_traceback_later(JOIN_S + 60, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def run_threads(*targets: Callable[[], None]) -> None:
    """Start one thread per target, join them with a timeout, re-raise the first error."""
    errors: list[BaseException] = []

    def wrap(f: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            try:
                f()
            except BaseException as e:  # noqa: BLE001 (reported to the main thread)
                errors.append(e)
        return go

    threads = [threading.Thread(target=wrap(f), daemon=True) for f in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


# -- one Engine, two threads ----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from ggraph.graphs.gguf.fetch import default_model

    return Engine(str(default_model()), EngineConfig(n_ctx=64, n_ubatch=32))


def test_two_threads_share_one_engine(engine):
    """Mostly 1-token prompts (one graph: the threads race on its inputs and arena); every
    25th call a 2-token prompt, so the threads also switch graphs (a new plan while the other
    waits), the case that crashed before calls took turns."""
    prompts = [[[19556], [282], [33], [504, 3575]], [[1206], [504], [4649], [33, 216]]]
    serial = [[engine.eval(p, n_past=0) for p in ps] for ps in prompts]
    done, wrong = [0, 0], [0, 0]

    def worker(i: int) -> Callable[[], None]:
        def go() -> None:
            for k in range(N_ENGINE_CALLS):
                j = 3 if k % 25 == 24 else k % 3
                wrong[i] += not np.array_equal(engine.eval(prompts[i][j], n_past=0),
                                               serial[i][j])
                done[i] += 1
        return go

    run_threads(worker(0), worker(1))
    assert done == [N_ENGINE_CALLS] * 2
    assert wrong == [0, 0], f"results differing from the serial run, per thread: {wrong}"


def test_n_past_truncates_the_sequence(engine):
    engine.reset()
    a = engine.eval([504, 3575, 282], n_past=0)
    engine.eval([19556, 33])                                 # the sequence goes on ...
    assert engine.cache.n_used == 5
    np.testing.assert_array_equal(engine.eval([282], n_past=2), a)  # ... and is cut back
    assert engine.cache.n_used == 3
    with pytest.raises(ValueError, match=r"n_past=4: the sequence holds 3 tokens"):
        engine.eval([1], n_past=4)
    for bad in ([], [1.5], [2 ** 32 + 1]):
        with pytest.raises(ValueError, match="token"):
            engine.eval(bad, n_past=0)


def test_generate_refuses_a_cache_changed_by_another_caller(engine):
    engine.reset()
    gen = engine.generate([504, 3575, 282, 4649, 314], 4, stop_at_eos=False)
    next(gen)
    next(gen)                                                # its own steps are fine
    engine.eval([19556], n_past=0)                          # someone else's sequence
    with pytest.raises(RuntimeError, match=r"generate: the KV cache was changed by another "
                                           r"eval\(\) or reset\(\)"):
        next(gen)
    engine.reset()
    gen = engine.generate([504, 3575], 2, stop_at_eos=False)
    next(gen)
    engine.reset()
    with pytest.raises(RuntimeError, match="KV cache was changed"):
        next(gen)


# -- one Session, two threads -----------------------------------------------------------------

def _attention_graph():
    ctx = Context()
    k = ctx.new_tensor("f32", (16, 32), name="k").set_input()
    q = ctx.new_tensor("f32", (16, 8), name="q").set_input()
    kq = ops.mul_mat(k, q, name="kq")
    out = ops.soft_max(kq, name="out").set_output()
    return k, q, out, build_graph(out)


def test_two_threads_share_one_session():
    k, q, out, g = _attention_graph()
    rng = np.random.default_rng(0)
    inputs = [[{k: rng.standard_normal((32, 16)), q: rng.standard_normal((8, 16))}
               for _ in range(3)] for _ in range(2)]
    s = get_backend("cpu").session()
    serial = [[s.run(g, v).read(out) for v in vs] for vs in inputs]
    wrong = [0, 0]

    def worker(i: int) -> Callable[[], None]:
        def go() -> None:
            for n in range(N_SESSION_CALLS):
                j = n % 3
                with s:                              # run and read as one step
                    got = s.run(g, inputs[i][j]).read(out)
                wrong[i] += not np.array_equal(got, serial[i][j])
        return go

    run_threads(worker(0), worker(1))
    assert wrong == [0, 0]


def test_a_bare_read_after_another_threads_run_is_refused():
    k, q, out, g = _attention_graph()
    s = get_backend("cpu").session()
    s.run(g, {k: np.ones((32, 16)), q: np.ones((8, 16))})
    seen: list[str] = []

    def other() -> None:
        with pytest.raises(RuntimeError) as e:
            s.read(out)
        seen.append(str(e.value))

    run_threads(other)
    assert seen == ["cannot read 'out' f32 ne=[32, 8, 1, 1]: the last run on this Session was "
                    "made by another thread; use one Session per thread or hold `with session:` "
                    "around run and read"]
    np.testing.assert_allclose(s.read(out), 1 / 32, rtol=1e-6)   # the running thread may


# -- separate Sessions at once: numba's threading layer ------------------------------------------

def test_two_sessions_run_at_once():
    """Different Sessions share numba's thread pool; with the `workqueue` layer (the one numba
    always has) concurrent parallel kernels abort the process unless the CPU backend makes
    graphs take turns. A subprocess forces that layer."""
    code = """if True:
        from test_concurrency import _two_sessions
        _two_sessions(60)
        import numba
        assert numba.threading_layer() == "workqueue", numba.threading_layer()
        print("ok")
    """
    # this module and the helpers it imports (tests/paths.py) on the child's path
    path = os.pathsep.join([str(Path(__file__).parent), str(TESTS)])
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=JOIN_S, cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    _two_sessions(60)                                  # and the default layer, in process


def _two_sessions(n: int) -> None:
    """Two threads, a Session each, the same graph: every result equals the serial one. The
    ops are large enough (2**17 elements) for numba's parallel kernels."""
    ctx = Context()
    x = ctx.new_tensor("f32", (512, 256), name="x").set_input()
    out = ops.soft_max(ops.scale(x, 0.5, name="half"), name="out").set_output()
    g = build_graph(out)
    rng = np.random.default_rng(1)
    vals = [{x: rng.standard_normal((256, 512))} for _ in range(2)]
    sessions = [get_backend("cpu").session() for _ in range(2)]
    serial = [s.run(g, v).read(out) for s, v in zip(sessions, vals)]

    def worker(i: int) -> Callable[[], None]:
        def go() -> None:
            for _ in range(n):
                assert np.array_equal(sessions[i].run(g, vals[i]).read(out), serial[i])
        return go

    run_threads(worker(0), worker(1))
