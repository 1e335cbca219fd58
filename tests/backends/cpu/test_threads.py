"""The CPU backend's threads (backends/cpu/threads.py): bounded OpenMP spinning by default,
`-t` honoured in every thread that runs, and a governor that uses all threads on a quiet
machine and fewer when runs get faster so."""
from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.cpu.threads import OPENMP_DEFAULTS, ThreadGovernor, arms, configure_openmp


def test_openmp_defaults_leave_the_callers_choice():
    env: dict[str, str] = {}
    assert configure_openmp(env) == OPENMP_DEFAULTS and env == OPENMP_DEFAULTS
    env = {"GOMP_SPINCOUNT": "5"}
    configure_openmp(env)
    assert env["GOMP_SPINCOUNT"] == "5" and env["KMP_BLOCKTIME"] == OPENMP_DEFAULTS[
        "KMP_BLOCKTIME"]
    env = {"OMP_WAIT_POLICY": "passive"}
    assert configure_openmp(env) == {} and env == {"OMP_WAIT_POLICY": "passive"}


def test_arms():
    assert arms(1) == (1,) and arms(2) == (2, 1) and arms(8) == (8, 4, 1)


def _drive(gov: ThreadGovernor, cost: dict[int, float], runs: int, key: str = "g"
           ) -> list[int]:
    used = []
    for _ in range(runs):
        n = gov.choose(key)
        gov.record(key, n, cost[n])
        used.append(n)
    return used


QUIET = {2: 0.020, 1: 0.031}
NO_ROOM = lambda: None  # noqa: E731  (no load signal: trials alone decide)
BUSY = {2: 0.080, 1: 0.050}


def test_quiet_machine_uses_every_thread():
    gov = ThreadGovernor(2, room=NO_ROOM)
    used = _drive(gov, QUIET, 300)
    assert used[0] == 2                      # the first (compiling) run: all threads
    assert used[-200:].count(2) >= 196       # trials of one thread get rarer as they lose
    assert gov.best("g") == 2


def test_busy_machine_falls_back_and_recovers():
    gov = ThreadGovernor(2, room=NO_ROOM)
    _drive(gov, QUIET, 100)
    busy = _drive(gov, BUSY, 200)
    assert busy[:4].count(1) >= 2            # switches within a couple of runs
    assert busy[-100:].count(1) >= 90        # trials of two threads every 16 runs at most
    quiet = _drive(gov, QUIET, 200)
    first_two = quiet.index(2)
    assert first_two <= gov.near_gap + 1     # the next trial of all threads takes over
    assert quiet[first_two:].count(2) >= len(quiet[first_two:]) - 15


def test_costly_trials_back_off_further():
    """Where two threads collapse (a trial 5x slower), they are tried every 64 runs."""
    gov = ThreadGovernor(2, room=NO_ROOM)
    _drive(gov, QUIET, 20)
    used = _drive(gov, {2: 0.250, 1: 0.050}, 400)
    assert used[-300:].count(2) <= 300 // gov.max_gap + 1


def test_free_cores_bring_every_thread_back_at_once():
    free = [0]
    gov = ThreadGovernor(2, room=lambda: free[0])
    _drive(gov, QUIET, 20)
    _drive(gov, {2: 0.250, 1: 0.050}, 100)    # collapsed: trials of two threads back off
    assert gov.best("g") == 1
    free[0] = 2                               # the competing work ended
    quiet = _drive(gov, QUIET, 10)
    assert quiet.index(2) <= gov.first_gap and quiet[-5:] == [2] * 5


def test_graphs_are_governed_apart():
    gov = ThreadGovernor(2, room=NO_ROOM)
    _drive(gov, QUIET, 50, key="decode")
    _drive(gov, BUSY, 50, key="prompt")
    assert gov.best("decode") == 2 and gov.best("prompt") == 1


def test_one_thread_is_never_governed():
    gov = ThreadGovernor(1, room=NO_ROOM)
    assert set(_drive(gov, {1: 0.01}, 20)) == {1}


def _graph():
    ctx = Context()
    x = ctx.new_tensor("f32", (256, 300), name="x").set_input()
    y = ops.scale(x, 2.0).set_output()        # large enough for a parallel kernel
    return build_graph(y), x, y


def test_thread_count_is_set_in_the_running_thread():
    """numba's thread count is per thread: a run from another thread still uses -t."""
    g, x, y = _graph()
    sess = CPUBackend(n_threads=1).session()
    seen = []

    def work():
        sess.run(g, {x: np.ones((300, 256), np.float32)})
        seen.append(numba.get_num_threads())
        np.testing.assert_array_equal(sess.read(y), 2.0)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [1]


def test_thread_counts_out_of_range_are_refused():
    with pytest.raises(ValueError, match="n_threads=0"):
        CPUBackend(n_threads=0)
    with pytest.raises(ValueError, match="NUMBA_NUM_THREADS"):
        CPUBackend(n_threads=numba.config.NUMBA_NUM_THREADS + 1)


def test_results_do_not_depend_on_the_governor():
    g, x, y = _graph()
    v = np.random.default_rng(0).standard_normal((300, 256)).astype(np.float32)
    outs = []
    for adaptive in (False, True):
        sess = CPUBackend(adaptive=adaptive).session()
        with sess:
            for _ in range(6):               # the governor tries each count
                sess.run(g, {x: v})
            outs.append(sess.read(y))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_blas_keeps_to_its_own_threads_while_a_graph_runs():
    """From a run's first BLAS call to its end BLAS has the executor's blas_threads; a run
    that calls no BLAS leaves its setting alone; after a run, what it had before."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from ggraph.backends.cpu.blas import run_units
    from ggraph.backends.cpu.executor import CPUExecutor

    def blas() -> list[int]:
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    if not blas():
        pytest.skip("numpy has no BLAS library that threadpoolctl can set")
    ex = CPUExecutor(n_threads=1, governor=None, blas_threads=1, fusion=False)
    seen: list[list[int]] = []
    with threadpool_limits(limits=2, user_api="blas"):
        outside = blas()
        with ex.run_context():
            before_any_call = blas()
            run_units(lambda: seen.append(blas()), [(), ()])
            inside = blas()
        assert blas() == outside
        with ex.run_context():           # no BLAS call: nothing set, nothing to give back
            untouched = blas()
        assert blas() == outside
    assert before_any_call == outside == untouched and outside != inside
    assert inside == [1] * len(outside) and seen == [inside, inside]

