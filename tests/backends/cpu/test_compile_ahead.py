"""Compiling a graph's missing kernels in helper processes (backends/cpu/compile_ahead.py):
what a helper compiles reaches this process through numba's disk cache and is counted as
compiled; a kernel a helper fails on is reported and compiles here as before; the shares are
balanced and a helper is only started for work worth its start."""
from __future__ import annotations

import os
import pickle
from functools import partial

import numpy as np
import pytest

from ggraph.backends.compiles import counting
from ggraph.backends.cpu import compile as C
from ggraph.backends.cpu import compile_ahead as CA
from ggraph.backends.cpu import templates as K

needs_two_cores = pytest.mark.skipif(CA.cores() < 2,
                                     reason="a helper process needs a second core")


def _fresh(tag: str):
    """k_first_bad_index bound under its own name, with its disk cache emptied (so every run
    of the test finds it missing, as on a first run)."""
    f = C.TARGET.bind(K.k_first_bad_index, C.SERIAL, f"ahead_test_{tag}")
    path = f._cache._cache_file._index_path
    if os.path.exists(path):
        os.remove(path)
    return f


def _calls(f):
    a32 = np.array([[[[0, 1, 5]]]], np.int32)
    a64 = np.array([[[[0, 7, 1]]]], np.int64)
    return [partial(f, a32, 3), partial(C.in_turn, partial(f, a64, 3), [])], a32, a64


@pytest.fixture
def ahead_on(monkeypatch):
    """Compiling ahead on, for work of any size (the kernels here are small)."""
    monkeypatch.setattr(CA, "MIN_SHARE", 0)
    monkeypatch.setattr(CA, "ENABLED", True)


@needs_two_cores
def test_a_helper_compiles_into_the_disk_cache_this_process_loads(ahead_on):
    f = _fresh("ok")
    calls, a32, a64 = _calls(f)
    # the pair inside in_turn is found too
    assert len(CA.missing(calls)) == 2
    with counting() as seen:
        done = CA.prepare(calls)
    assert (done.here, done.helped, done.failed) == (1, 1, [])
    assert seen.kernels == 2 and len(seen.each) == 2
    # whichever signature the helper took is on disk now; compile() loads it
    assert CA.missing(calls) == []
    direct = [C.direct(c) for c in calls]
    assert sum(f.stats.cache_hits.values()) == 1
    assert f(a32, 3) == 2 and f(a64, 3) == 1
    direct[0]()


@needs_two_cores
def test_a_kernel_the_helper_cannot_compile_is_reported_and_compiles_here(ahead_on):
    f = _fresh("bad")
    calls, a32, _ = _calls(f)
    jobs = CA.missing(calls)
    bad = CA.Job(f, jobs[0].sig[:1], pickle.dumps((f, jobs[0].sig[:1])))  # one argument short
    proc = CA._start([bad, jobs[1]])
    res = CA._finish(proc, 2)
    assert res[0][0] is False and "Signature mismatch" in res[0][2]
    assert res[1][0] is True
    # a helper that never ran: each of its jobs failed, none raised
    assert CA._finish(None, 2) == [(False, 0.0, "no helper process")] * 2
    assert f(a32, 3) == 2


def test_shares_balance_and_small_ones_stay_here(monkeypatch):
    def job(n):
        return CA.Job(None, (n,), b"x" * n)

    monkeypatch.setattr(CA, "MIN_SHARE", 10_000)
    big = [job(50_000), job(47_000), job(17_000), job(9_000), job(7_000)]
    here, helper = CA.split(big, 1)
    assert [len(j.blob) for j in here] == [50_000, 9_000, 7_000]
    assert [len(j.blob) for j in helper] == [47_000, 17_000]
    # a helper share worth less than a process start goes back to this process
    here, helper = CA.split([job(20_000), job(5_000)], 1)
    assert len(here) == 2 and helper == []


def test_off_or_nothing_missing_starts_no_helper(monkeypatch):
    started = []
    monkeypatch.setattr(CA, "_start", lambda share: started.append(share))
    monkeypatch.setattr(CA, "ENABLED", False)
    f = _fresh("off")
    calls, _, _ = _calls(f)
    assert CA.prepare(calls) == CA.Ahead()
    monkeypatch.setattr(CA, "ENABLED", True)
    for c in calls:
        C.direct(c)   # compiled here: nothing left to hand out
    assert CA.prepare(calls) == CA.Ahead() and started == []


@needs_two_cores
def test_a_kernel_that_cannot_compile_fails_when_it_runs_not_when_bound(ahead_on, monkeypatch):
    f = _fresh("untypable")
    a32 = np.array([[[[0, 1, 5]]]], np.int32)
    bad, good = partial(f, "not an array", 3), partial(f, a32, 3)
    # the untypable one in this process's share, the other in the helper's
    monkeypatch.setattr(CA, "split", lambda jobs, n: [
        [j for j in jobs if j.sig[0] != C.arg_type(f, a32)],
        [j for j in jobs if j.sig[0] == C.arg_type(f, a32)]])
    done = CA.prepare([bad, good])   # nothing raises here, as compile.direct does not
    assert (done.here, done.helped, done.failed) == (0, 1, [])
    assert C.direct(good)() == 2
    with pytest.raises(Exception, match="(?i)typing"):
        C.direct(bad)()
