"""The PTX gate: every CUDA kernel variant the runtime's PTX-only mode compiled (runtime.py:
each launch compiles its kernel to PTX with libNVVM instead of running it, no GPU needed) is
assembled by `ptxas -v` and judged against what a real GPU allows:

- no register spills (spill stores or loads; SPILL_BUDGET, 0 by default);
- registers x threads per block within an SM's register file (64K 32-bit registers);
- static shared memory within 48 KB (more needs an opt-in launch attribute);
- float64 instructions within the kernel's budget (F64_BUDGET, 0 by default): FP64 runs at
  1/64 of FP32's rate on consumer GPUs, and Python floats, `0.0` accumulators and float64
  shared math slip it in unseen.

`judge` gives one row per kernel variant; `table` prints them. tools/gpu_check.py --ptx
(`ggraph gpu-check --ptx`) runs the conformance cases and attention graphs in the PTX-only
mode, then this. A second gate over kernels that did not change reads their PTX and ptxas's
figures from its disk cache (ptx_cache.py).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from . import ptx_cache

REGISTER_FILE = 65536        # 32-bit registers per SM (sm_80, sm_90)
SHARED_LIMIT = 48 * 1024     # static shared memory per block without the opt-in attribute

# Float64 instructions a kernel template may hold (by template name: the part of a variant's
# name before "__"), the largest over its variants, counted on sm_90: every other kernel has a
# budget of 0 (on 2026-11-30 softmax had 747, flash attention 569, rope 317, the Q8_0 encoder
# 256, norm 135, bf16 conversions 41, until they went float32 and bit operations).
F64_BUDGET: dict[str, int] = {
    "k_rope": 6,            # libdevice's own cosf/sinf: float64 in their huge-argument reduction
}
# Spilled bytes (stores + loads) a template may have, the same kind of ratchet (flash attention
# over Q5_0/Q5_1 caches spilled 24 bytes at 255 registers while its online softmax was float64).
SPILL_BUDGET: dict[str, int] = {}


@dataclass(frozen=True)
class PtxRow:
    """One kernel variant as ptxas sees it, and what the gate found wrong with it."""
    kernel: str
    signature: str
    threads: int                 # the largest block it was launched with
    registers: int = 0
    shared: int = 0              # static shared memory, bytes
    local: int = 0               # stack frame, bytes
    spill_stores: int = 0
    spill_loads: int = 0
    f64: int = 0
    budget: int = 0
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def find_ptxas() -> str | None:
    """ptxas from PATH, else CUDA_HOME (or /usr/local/cuda)."""
    found = shutil.which("ptxas")
    if found:
        return found
    path = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    return path if os.path.exists(path) else None


_F64 = re.compile(r"\.f64\b")


def f64_count(ptx: str) -> int:
    """Instructions that read, write or compute float64 (declarations and comments aside)."""
    n = 0
    for line in ptx.splitlines():
        s = line.strip()
        if s and not s.startswith(("//", ".reg", ".param", ".local", ".shared", ".global")) \
                and _F64.search(s):
            n += 1
    return n


def _ints(pattern: str, text: str) -> list[int]:
    return [int(x) for x in re.findall(pattern, text)]


def assemble(ptxas: str, ptx: str, cc: tuple[int, int]) -> dict[str, int] | str:
    """ptxas -v's figures for the PTX (registers, shared, local, spills), or its error."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        p = subprocess.run([ptxas, f"-arch=sm_{cc[0]}{cc[1]}", "-v", f.name, "-o", os.devnull],
                           capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or ["(no output)"]
        return f"ptxas failed: {lines[-1][:300]}"
    out = p.stderr
    return {"registers": max(_ints(r"Used (\d+) registers", out), default=0),
            "shared": max(_ints(r"(\d+) bytes smem", out), default=0),
            "local": max(_ints(r"(\d+) bytes stack frame", out), default=0),
            "spill_stores": sum(_ints(r"(\d+) bytes spill stores", out)),
            "spill_loads": sum(_ints(r"(\d+) bytes spill loads", out))}


def assembled(ptxas: str, ptx: str, cc: tuple[int, int]) -> dict[str, int] | str:
    """assemble's figures, from the gate's cache where this ptxas assembled the same PTX
    before (backends/cuda/ptx_cache.py); its errors are not kept."""
    name = ptx_cache.figures_name(ptxas, ptx, cc)
    got = ptx_cache.load_figures(name)
    if got is None:
        got = assemble(ptxas, ptx, cc)
        if isinstance(got, dict):
            ptx_cache.save_figures(name, got)
    return got


def budget_for(kernel: str) -> int:
    return F64_BUDGET.get(kernel.split("__", 1)[0], 0)


def spill_budget_for(kernel: str) -> int:
    return SPILL_BUDGET.get(kernel.split("__", 1)[0], 0)


def judge(kernel: str, signature: str, threads: int, ptx: str, error: str,
          ptxas: str | None, cc: tuple[int, int]) -> PtxRow:
    """The gate's verdict on one kernel variant (compiled to `ptx`, or failed with `error`)."""
    budget = budget_for(kernel)
    if error:
        return PtxRow(kernel, signature, threads, budget=budget,
                      problems=(f"does not compile: {error}",))
    f64 = f64_count(ptx)
    if ptxas is None:
        return PtxRow(kernel, signature, threads, f64=f64, budget=budget,
                      problems=("no ptxas (CUDA_HOME/bin or PATH)",))
    got = assembled(ptxas, ptx, cc)
    if isinstance(got, str):
        return PtxRow(kernel, signature, threads, f64=f64, budget=budget, problems=(got,))
    problems = []
    if got["spill_stores"] + got["spill_loads"] > spill_budget_for(kernel):
        problems.append(f"spills {got['spill_stores']} B stored, {got['spill_loads']} B loaded")
    if got["registers"] * threads > REGISTER_FILE:
        problems.append(f"{got['registers']} registers x {threads} threads > {REGISTER_FILE}")
    if got["shared"] > SHARED_LIMIT:
        problems.append(f"{got['shared']} B shared > {SHARED_LIMIT}")
    if f64 > budget:
        problems.append(f"{f64} float64 instructions > budget {budget}")
    return PtxRow(kernel, signature, threads, f64=f64, budget=budget, problems=tuple(problems),
                  **got)


def table(rows: list[PtxRow]) -> list[str]:
    """One line per kernel variant: registers, threads, shared, local, spills, f64/budget."""
    head = (f"{'kernel':<44} {'regs':>5} {'thr':>5} {'shared':>7} {'local':>6} "
            f"{'spill':>6} {'f64':>5} {'budget':>6}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kernel[:44]:<44} {r.registers:>5} {r.threads:>5} {r.shared:>7} "
                     f"{r.local:>6} {r.spill_stores + r.spill_loads:>6} {r.f64:>5} "
                     f"{r.budget:>6}  {'OK' if r.ok else 'FAIL: ' + '; '.join(r.problems)}")
    return lines
