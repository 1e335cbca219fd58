"""A native run made by a team of threads in one region (backends/cpu/team.py): the same
bytes as the run without it, shares taken by whichever thread asks (none waits on a thread
that never comes), a failing share raised as its call raises it, and runs a team may not make
(a kernel that forks threads of its own) left to the plain driver."""
from __future__ import annotations

from functools import partial

import numba
import numpy as np
import pytest

from ggraph.backends.cpu import compile as C, native_loop as NL, team as T


@numba.njit(cache=False)
def _scale(x, f):
    for i in range(x.size):
        x[i] *= f


@numba.njit(cache=False)
def _share(x, y, wk, workers):
    """y[i] = x[i] + i over share wk's stretch; a negative x fails the share holding it."""
    n = x.size
    for i in range(wk * n // workers, (wk + 1) * n // workers):
        if x[i] < 0:
            raise ValueError("a negative value")
        y[i] = x[i] + i


@numba.njit(cache=False)
def _whole(x, y):
    _share(x, y, 0, 1)


@numba.njit(parallel=True, cache=False)
def _forks(x):
    for i in numba.prange(x.size):
        x[i] += 1


def _team_call(x, y):
    call = C.direct(partial(_whole, x, y))
    call.team = T.TeamForm(lambda n: [T.Part(_share, (x, y), True)])
    return call


@pytest.fixture
def two_threads():
    was = numba.get_num_threads()
    numba.set_num_threads(2)
    yield
    numba.set_num_threads(was)


def test_a_team_run_gives_the_plain_runs_bytes(two_threads):
    x = np.arange(1000, dtype=np.float64)
    ya, yb = np.zeros(1000), np.zeros(1000)
    xa, xb = x.copy(), x.copy()
    plain = NL.lay_out([C.direct(partial(_scale, xa, 2.0)), _team_call(xa, ya)], team=False)
    team = NL.lay_out([C.direct(partial(_scale, xb, 2.0)), _team_call(xb, yb)], team=True)
    assert len(team) == 1 and team[0].threads == 2 and plain[0].threads == 0
    for _ in range(3):
        plain[0]()
        team[0]()
        np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(yb, x * 8 + np.arange(1000))


def test_shares_need_no_second_thread(two_threads):
    """A team region of more threads than numba runs it on (4 on 2, 2 on 1): whoever asks
    takes the shares, so the run ends with every share made, however few threads came."""
    x = np.arange(100, dtype=np.float64)
    y = np.zeros(100)
    run = NL.lay_out([_team_call(x, y)], team=True)[0]
    for threads in (1, 2):
        numba.set_num_threads(threads)
        y[:] = 0
        run.counters.fill(0)
        T.TEAM(T.driver_address(), run.at, 0, len(run.table), run.state, 2 * threads)
        assert run.state[T.RESULT] == 0
        np.testing.assert_array_equal(y, x + np.arange(100))


def test_a_failing_share_raises_as_its_call_does(two_threads):
    x = np.arange(100, dtype=np.float64)
    x[80] = -1
    y, before = np.zeros(100), np.zeros(3)
    run = NL.lay_out([C.direct(partial(_scale, before, 0.0)), _team_call(x, y),
                      C.direct(partial(_scale, x, 0.0))], team=True)
    assert len(run) == 1 and run[0].threads == 2
    with pytest.raises(ValueError, match="a negative value"):
        run[0]()
    assert x[80] == -1 and x[0] == 0 + 0 and x[1] == 1   # the step after did not run


def test_a_run_with_a_kernel_that_forks_goes_without_a_team(two_threads):
    x, y = np.arange(10, dtype=np.float64), np.zeros(10)
    run = NL.lay_out([C.direct(partial(_forks, x)), _team_call(x, y)], team=True)
    assert run[0].threads == 0
    run[0]()
    np.testing.assert_array_equal(y, np.arange(10) + 1 + np.arange(10))


def test_the_work_memory_a_team_form_makes_lives_as_long_as_the_run(two_threads):
    """Memory a form's parts make for the run's threads (share counters, attention's
    partial sums) is addressed by the table: it lives as long as the run, not the call that
    made it."""
    import gc
    import weakref
    x = np.arange(64, dtype=np.float64)
    y = np.zeros(64)
    made = []

    def parts(n):
        tmp = x * 3                     # made here, referenced only by the part
        made.append(weakref.ref(tmp))
        return [T.Part(_share, (tmp, y), True)]

    call = C.direct(partial(_whole, x * 3, y))
    call.team = T.TeamForm(parts)
    run = NL.lay_out([call], team=True)[0]
    gc.collect()
    assert made[0]() is not None
    run()
    np.testing.assert_array_equal(y, x * 3 + np.arange(64))
    del run
    gc.collect()
    assert made[0]() is None


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
def test_a_models_decode_steps_are_bit_equal_with_and_without_a_team(tmp_path, weights,
                                                                     two_threads, monkeypatch):
    """Decode steps whose packed products and flash attention a team makes (after the
    first run of each graph, native runs): the logits of a team-less engine, bit for bit,
    at 2 threads; a prompt after them too."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny

    path = write_tiny(tmp_path / "m.gguf", TinyDense(n_embd=128, n_ff=256, n_head=4,
                                                     n_head_kv=2, weight_type=weights))
    made = []
    real = NL.Native.__post_init__

    def counted(self):
        real(self)
        made.append(self.threads)

    monkeypatch.setattr(NL.Native, "__post_init__", counted)
    out = {}
    for team in (False, True):
        monkeypatch.setattr(NL, "TEAM", team)
        eng = Engine(path, EngineConfig(n_ctx=512, n_ubatch=16, n_threads=2, flash_attn=True,
                                        adaptive_threads=False))
        got = [eng.eval(list(range(1, 12)))]
        got += [eng.eval([t]) for t in (5, 9, 2, 7, 3)]
        got.append(eng.eval(list(range(20, 40))))
        out[team] = got
    assert 2 in made   # some native run had a team of 2
    for a, b in zip(out[False], out[True]):
        np.testing.assert_array_equal(a, b)


def test_compile_ahead_lists_the_team_forms_kernels():
    """compile.dispatcher_calls with `teams`: a call's team form's kernel calls too (a
    shared part with a share and the shares after its arguments), so compile_ahead.py's
    helpers compile them before the run that lays a team out; not once the form's kernel
    has compiled."""
    x, y = np.arange(8, dtype=np.float64), np.zeros(8)
    call = partial(_whole, x, y)
    call.team = T.TeamForm(lambda n: [T.Part(_scale, (x, 2.0)), T.Part(_share, (x, y), True)])
    assert C.dispatcher_calls([call]) == [call]
    got = C.dispatcher_calls([call], teams=True)
    assert [(c.func, len(c.args)) for c in got] == [(_whole, 2), (_scale, 2), (_share, 4)]
    assert got[2].args[2:] == (0, 2)
    # a form whose one kernel has compiled is not listed again (no work memory made for it)
    _scale(x.copy(), 2.0)
    call.team = T.TeamForm(lambda n: [T.Part(_scale, (x, 2.0))], _scale)
    assert C.dispatcher_calls([call], teams=True) == [call]
