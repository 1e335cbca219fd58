"""Runs the CUDA backend's tests under numba's CUDA simulator in their own process.

The simulator must be switched on (NUMBA_ENABLE_CUDASIM=1) before numba is first imported, and
this pytest process has long imported numba for the CPU backend, so the CUDA tests run in a
child process; its summary is checked here and its output shown on failure."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
                    reason="already inside the simulator process")
def test_cuda_backend_under_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-m", "cudasim", str(HERE / "test_cuda_sim.py")],
                       env=env, capture_output=True, text=True, timeout=1500)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, f"CUDA simulator tests failed:\n{tail}"
    assert " passed" in r.stdout, tail
