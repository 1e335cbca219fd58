"""Runs the CUDA backend's tests under numba's CUDA simulator in their own process.

The simulator must be switched on (NUMBA_ENABLE_CUDASIM=1) before numba is first imported, and
this pytest process has long imported numba for the CPU backend, so the CUDA tests run in a
child process, started at collection beside the CPU tests (tests/conftest.py); its summary is
checked here and its output shown on failure."""
from __future__ import annotations

import os

import pytest


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="already inside the simulator process")
def test_cuda_backend_under_simulator(cudasim_run):
    """The suite's process (tests/conftest.py starts it at collection, this test runs last)."""
    rc, out = cudasim_run.result(timeout=1500)
    tail = out[-4000:]
    assert rc == 0, f"CUDA simulator tests failed:\n{tail}"
    assert " passed" in out, tail
