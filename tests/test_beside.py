"""The CPU modules a whole run moves to the background chain's process (tests/conftest.py:
BESIDE_MODULES, started at collection after the simulator and the PTX gate, so that they use
the core those free while this process still compiles): their summary is checked here and
their output shown on failure. Run on their own, the modules run in this process instead."""
from __future__ import annotations

import pytest


def test_modules_run_beside_pass(beside_run):
    if beside_run is None:
        pytest.skip("no module to run beside: BESIDE_MODULES were deselected or run here")
    rc, out = beside_run.result(timeout=1500)
    tail = out[-4000:]
    assert rc == 0, f"modules run beside failed:\n{tail}"
    assert " passed" in out and " failed" not in out, tail
