"""Child processes of `ggraph gpu-check` (tools/gpu_check.py): the conformance cases split
over several processes (`--jobs`), and compute-sanitizer runs of a case subset.

Both run this same script again (`python -m ggraph.tools.gpu_check ... --json PART`) and read
back its JSON, so a child checks exactly what the parent would. Shards exist because numba
compiles each kernel variant single-threaded (about a second each, some 170 of them): N
processes on an N-core host compile N at a time, and what they compile lands in numba's
on-disk cache, where the parent's later sections find it. The sanitizer runs wrap the child in
`compute-sanitizer --tool memcheck` (or racecheck) and parse its summary line.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

# the case subsets the sanitizers run: memcheck one case or a few of every kernel family that
# indexes memory in its own way; racecheck the kernels that share memory between threads
# (tiled mul_mat: n > 8, softmax and flash attention reductions, the shared-memory sort)
MEMCHECK_OPS = ("add,mul,scale,silu,swiglu,rms_norm,soft_max,rope,get_rows,set_rows,cpy,cont,"
                "concat,sum_rows,argsort,mul_mat,mul_mat_id,flash_attn_ext")
MEMCHECK_PER_OP = 3
RACECHECK_OPS = "mul_mat,soft_max,flash_attn_ext,argsort"
RACECHECK_MATCH = r"n=(9|17),|mask=f16|type_kv=f16|ne=\[64"
# the longest each tool's child may take (memcheck runs several times as many cases)
SANITIZER_TIMEOUT = {"memcheck": 100.0, "racecheck": 60.0}


@dataclass
class ChildRun:
    """One child's outcome: exit status, its JSON report (None when it wrote none), the
    tail of its output, and whether it ran past its timeout."""
    argv: list[str]
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    output: str = ""
    report: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, tail: int = 2000) -> dict[str, Any]:
        return {"argv": self.argv, "rc": self.rc, "seconds": round(self.seconds, 2),
                "timed_out": self.timed_out, "output_tail": self.output[-tail:], **self.extra}


def child_argv(args: list[str], json_path: str) -> list[str]:
    """This script run again with `args`, its report written to json_path."""
    return [sys.executable, "-m", "ggraph.tools.gpu_check", *args, "--json", json_path]


def start(argv: list[str]) -> tuple[subprocess.Popen, Any]:
    """Start argv with its output (stdout and stderr together) in a temporary file."""
    out = tempfile.TemporaryFile(mode="w+")
    # a session of its own: on a timeout its whole process group goes (compute-sanitizer's
    # target is a grandchild, which killing the sanitizer alone would leave on the GPU)
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    return proc, out


def finish(proc: subprocess.Popen, out: Any, run: ChildRun, json_path: str, t0: float,
           deadline: float) -> ChildRun:
    """Wait for a started child until `deadline` (time.perf_counter()), killing it after;
    fill in run from its exit status, output and JSON file."""
    import json

    try:
        run.rc = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        try:  # the group start() made for this child, by its id: nothing else
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        run.rc = proc.wait()
        run.timed_out = True
    run.seconds = time.perf_counter() - t0
    out.seek(0)
    run.output = out.read()
    out.close()
    try:
        with open(json_path) as f:
            run.report = json.load(f)
    except (OSError, ValueError):
        run.report = None
    return run


def run_child(args: list[str], timeout: float, wrap: list[str] | None = None) -> ChildRun:
    """Run this script with `args` (under the `wrap` command, e.g. compute-sanitizer) and
    wait up to `timeout` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        argv = (wrap or []) + child_argv(args, path)
        t0 = time.perf_counter()
        proc, out = start(argv)
        return finish(proc, out, ChildRun(argv), path, t0, t0 + timeout)


def run_shards(n: int, args: list[str], timeout: float) -> list[ChildRun]:
    """`args` run in n processes at once, child i with `--shard i/n`, each up to timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        started = []
        t0 = time.perf_counter()
        for i in range(n):
            path = os.path.join(tmp, f"shard{i}.json")
            argv = child_argv([*args, "--shard", f"{i}/{n}"], path)
            proc, out = start(argv)
            started.append((proc, out, ChildRun(argv), path))
        return [finish(p, o, r, path, t0, t0 + timeout) for p, o, r, path in started]


def merge_shards(runs: list[ChildRun]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the conformance summary, the device-side input check, the case lines) of all shards
    together; a shard that crashed, timed out or wrote no report is one failing case."""
    cases: list[dict[str, Any]] = []
    inputs: dict[str, Any] = {"checked": 0, "bytes": 0, "mismatches": []}
    lines: list[str] = []
    not_run = 0
    for i, run in enumerate(runs):
        rep = run.report or {}
        conf = rep.get("conformance")
        lines += [ln for ln in run.output.splitlines() if ln.startswith("  ")]
        if conf is None or run.timed_out:
            why = "timed out" if run.timed_out else f"exit status {run.rc}, no report"
            tail = " | ".join(run.output.strip().splitlines()[-3:])[-300:]
            cases.append({"case": f"shard {i}/{len(runs)}", "op": "", "status": "FAIL",
                          "nmse": float("nan"), "detail": f"{why}: {tail}", "seconds": 0.0,
                          "perf": ""})
            lines.append(f"  shard {i}/{len(runs)}: FAIL ({why})")
        if conf is not None:
            cases += conf["cases"]
            not_run += conf.get("not_run", 0)
        part = rep.get("inputs") or {}
        for k in ("checked", "bytes"):
            inputs[k] += part.get(k, 0)
        inputs["mismatches"] += part.get("mismatches", [])
    inputs["status"] = "FAIL" if inputs["mismatches"] else "OK"
    conf = {"backend": "cuda", "jobs": len(runs),
            "passed": sum(c["status"] == "OK" for c in cases),
            "tested": sum(c["status"] not in ("not supported", "skipped") for c in cases),
            "skipped": sum(c["status"] == "skipped" for c in cases),
            "failed": sum(c["status"] == "FAIL" for c in cases),
            "not_run": not_run, "cases": cases}
    return conf, inputs, lines


# -- compute-sanitizer ---------------------------------------------------------------------------

def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, under $CUDA_HOME/bin or /usr/local/cuda/bin."""
    hit = shutil.which("compute-sanitizer")
    if hit:
        return hit
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            p = os.path.join(home, "bin", "compute-sanitizer")
            if os.access(p, os.X_OK):
                return p
    return None


_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error")
_RACES = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards? displayed\s*\((\d+)\s+errors?,"
                    r"\s*(\d+)\s+warnings?\)")


def parse_summary(text: str) -> dict[str, int | None]:
    """compute-sanitizer's totals: `ERROR SUMMARY: N errors` and, from racecheck, `RACECHECK
    SUMMARY: H hazards displayed (E errors, W warnings)`; errors None where neither line is
    there (the tool never got to print one). CUDA 13's racecheck prints only its own line
    (seen on the H200), so its E errors stand for the total there."""
    m = _ERRORS.findall(text)
    r = _RACES.findall(text)
    out: dict[str, int | None] = {"errors": int(m[-1]) if m else None}
    if r:
        out.update(hazards=int(r[-1][0]), race_errors=int(r[-1][1]),
                   race_warnings=int(r[-1][2]))
        if out["errors"] is None:
            out["errors"] = out["race_errors"]
    return out


def sanitizer_args(tool: str, base: list[str]) -> list[str]:
    """The child's arguments for one tool: its case subset, conformance only (`base` last,
    so its options win: argparse keeps an option's last value)."""
    if tool == "memcheck":
        sub = ["--ops", MEMCHECK_OPS, "--per-op", str(MEMCHECK_PER_OP)]
    else:
        sub = ["--ops", RACECHECK_OPS, "--match", RACECHECK_MATCH, "--per-op", "1"]
    return [*sub, "--sections", "conformance", "--jobs", "1", *base]


def run_sanitizer(exe: str, tool: str, timeout: float, base: list[str] | None = None
                  ) -> dict[str, Any]:
    """This script's conformance on the tool's case subset under `exe --tool tool`; its
    summary, the child's own verdict (cases it had no time for count as not run), and status
    OK / FAIL (errors found) / INCOMPLETE (no summary line: timed out or crashed before the
    sanitizer could print one)."""
    wrap = [exe, "--tool", tool, "--print-limit", "20"]
    # the child stops starting cases well before the timeout and exits on its own: the
    # sanitizer prints its summary only when its target ends, never for a killed one
    stop = ["--budget", f"{max(10.0, timeout * 0.6):.0f}"]
    run = run_child(sanitizer_args(tool, stop + (base or [])), timeout, wrap)
    summary = parse_summary(run.output)
    conf = (run.report or {}).get("conformance") or {}
    errors = summary["errors"]
    status = ("INCOMPLETE" if errors is None or run.timed_out
              else "FAIL" if errors or summary.get("race_errors") else "OK")
    return {"tool": tool, "status": status, **summary, "cases_passed": conf.get("passed"),
            "cases_tested": conf.get("tested"), "cases_not_run": conf.get("not_run"),
            **run.to_json()}


def sanitizer_runs(exe: str, left: Callable[[], float], base: list[str]
                   ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(tool, its run_sanitizer result) for memcheck, then racecheck, each with the smaller
    of its own timeout and what `left()` seconds of the run's budget allow (skipped, with the
    reason, below 20 s)."""
    for tool, limit in SANITIZER_TIMEOUT.items():
        timeout = min(limit, left() - 15)
        if timeout < 20:
            yield tool, {"skipped": f"time budget: {max(left(), 0):.0f} s left"}
            continue
        yield tool, run_sanitizer(exe, tool, timeout, base)


def sanitizer_line(tool: str, r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"sanitizer {tool}: skipped ({r['skipped']})"
    errs = "no summary line" if r["errors"] is None else f"{r['errors']} errors"
    races = f", {r['hazards']} hazards" if "hazards" in r else ""
    cases = (f", {r['cases_passed']}/{r['cases_tested']} cases passed"
             if r["cases_tested"] is not None else "")
    if r.get("cases_not_run"):
        cases += f" ({r['cases_not_run']} not run: time)"
    return (f"sanitizer {tool}: {r['status']}, {errs}{races}{cases} ({r['seconds']:.0f} s"
            f"{', timed out' if r['timed_out'] else ''})")
