"""The guard a CUDA-simulator test module starts with: numba's simulator replaces numba.cuda
only when NUMBA_ENABLE_CUDASIM=1 is set before numba is first imported, so these modules run in
a process of their own (tests/conftest.py, tests/run_cudasim.sh) and skip anywhere else."""
from __future__ import annotations

import os

import pytest


def require_simulator() -> None:
    """Skip the calling module unless numba.cuda is the simulator."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("run with NUMBA_ENABLE_CUDASIM=1 (tests/run_cudasim.sh) — the simulator must "
                    "be enabled before numba is imported", allow_module_level=True)
    from ggraph.backends.cuda import runtime as R

    if not R.SIM:
        pytest.skip("numba.cuda was imported before NUMBA_ENABLE_CUDASIM=1 took effect: run this "
                    "module in its own process (tests/run_cudasim.sh)", allow_module_level=True)
