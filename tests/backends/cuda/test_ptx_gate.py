"""The PTX gate (backends/cuda/ptx.py): its parsing and verdicts on known text, and, where
this machine has a CUDA toolkit (libNVVM, libdevice, ptxas; no GPU needed), the gate itself
over every kernel variant the conformance cases and attention graphs launch (`ggraph gpu-check
--ptx`, ~2.5 minutes, in a process of its own, since the PTX-only mode patches numba-cuda's
device queries: tests/conftest.py starts it at collection, after the simulator's processes,
so that it runs beside the CPU tests)."""
from __future__ import annotations

import json
import os

import pytest

from ggraph.backends.cuda import ptx as P

PTX = """
.visible .entry k(
\t.param .f64 k_param_0
)
{
\t.reg .f64 \t%fd<4>;
\t// a comment with .f64
\tld.param.f64 \t%fd1, [k_param_0];
\tcvt.f64.f32 \t%fd2, %f1;
\tadd.f64 \t%fd3, %fd1, %fd2;
\tadd.f32 \t%f2, %f1, %f1;
\tret;
}
"""


def test_f64_count_counts_instructions_only():
    assert P.f64_count(PTX) == 3          # ld.param, cvt and add; not the declarations


def test_judge_finds_spills_registers_shared_and_f64(monkeypatch):
    monkeypatch.setenv("GGRAPH_PTX_CACHE", "0")   # the stand-in figures are not ptxas's
    figures = {"registers": 255, "shared": 64 * 1024, "local": 16, "spill_stores": 8,
               "spill_loads": 4}
    monkeypatch.setattr(P, "assemble", lambda ptxas, ptx, cc: dict(figures))
    row = P.judge("k_x__tag", "(f32,)", 512, PTX, "", "ptxas", (9, 0))
    text = "; ".join(row.problems)
    assert not row.ok and row.f64 == 3 and row.budget == 0
    for part in ("spills 8 B stored, 4 B loaded", "255 registers x 512 threads",
                 "65536 B shared > 49152", "3 float64 instructions > budget 0"):
        assert part in text
    monkeypatch.setitem(P.F64_BUDGET, "k_x", 3)
    figures.update(registers=32, shared=0, spill_stores=0, spill_loads=0)
    assert P.judge("k_x__tag", "(f32,)", 512, PTX, "", "ptxas", (9, 0)).ok
    assert not P.judge("k_y", "()", 1, "", "TypingError: x", "ptxas", (9, 0)).ok


def toolkit_missing() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not os.path.exists(os.path.join(home, "nvvm", "libdevice", "libdevice.10.bc")):
        return f"no CUDA toolkit at {home} (libdevice): the PTX gate needs libNVVM, not a GPU"
    if P.find_ptxas() is None:
        return "no ptxas on PATH or in CUDA_HOME/bin"
    return None


@pytest.mark.skipif(toolkit_missing() is not None, reason=str(toolkit_missing()))
def test_every_kernel_variant_the_checks_launch_passes_the_gate(ptx_run):
    """The gate's process (tests/conftest.py starts it at collection, after the simulator's,
    and moves this test last, where it waits for it)."""
    rc, out = ptx_run.result(timeout=1500)
    rows = json.loads(open(ptx_run.json).read())["ptx"] if os.path.exists(ptx_run.json) else []
    failing = [f"{row['kernel']}: {'; '.join(row['problems'])}" for row in rows if row["problems"]]
    assert rc == 0 and not failing, "\n".join(failing) or out[-4000:]
    assert len(rows) >= 150               # every op and type the conformance cases cover
    assert "ptx: " in out and "kernel variants pass the gate" in out
