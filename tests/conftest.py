"""Test-suite settings: every Engine scans its weights for inf/NaN at load (llama.cpp's
--check-tensors), so a corrupted model file fails loudly in any test that loads one.

The CUDA simulator's suite runs in a process of its own (tests/test_cudasim_suite.py). It is
started as soon as collection finds its test, so it runs on one core beside the CPU tests
(which spend most of their time compiling, single-threaded), and its test is moved last,
where it waits for the process: the two halves overlap instead of adding up."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("GGRAPH_CHECK_TENSORS", "1")

CUDASIM_TEST = "test_cudasim_suite.py::test_cuda_backend_under_simulator"


class CudasimRun:
    """The simulator suite's process, its output in a temporary file."""

    def __init__(self) -> None:
        self.out = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cudasim",
             str(Path(__file__).parent / "test_cuda_sim.py")],
            env=env, stdout=self.out, stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float) -> tuple[int, str]:
        """(exit status, output) once the process ends; killed after `timeout` seconds."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.out.seek(0)
        return rc, self.out.read()


_RUN = pytest.StashKey[CudasimRun]()


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    sim = [it for it in items if it.nodeid.endswith(CUDASIM_TEST)]
    if sim:
        items.remove(sim[0])
        items.append(sim[0])
        config.stash[_RUN] = CudasimRun()


@pytest.fixture
def cudasim_run(request) -> CudasimRun:
    """The simulator suite's process started at collection (a fresh one if it was not)."""
    return request.config.stash.get(_RUN, None) or CudasimRun()


def pytest_unconfigure(config):
    run = config.stash.get(_RUN, None)
    if run is not None and run.proc.poll() is None:  # the run ended early: no orphan
        run.proc.kill()
        run.proc.wait()
