"""Wall time and memory of `ggraph plan` on the full-size DeepSeek presets (no weights).

Planning the full-size model must take seconds and allocate no tensor memory: one 7-head K*Q
group of DeepSeek-V3 at ctx 163000 and ubatch 512 alone would be 2.2 GB. Each case runs in a
fresh Python process (imports done before the clock starts) so that its RSS growth is its own;
cases with a budget are marked "over" when they exceed it and the script exits 1. Prints a
table and writes JSON (-o/--json, default benchmarks/results/plan.json). tests/tools/test_plan.py
checks the numbers the plans produce; timings and memory belong here, where a busy shared
machine does not fail the test suite.

    python benchmarks/bench_plan.py [--repeat 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import platform
import subprocess
import sys
import time

from ggraph.ir.types import MIB

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, header_lines, out_option, repeat_option, results_path, row_line,
                    write_results)

# name -> (`ggraph plan` arguments, seconds budget, RSS growth budget in MiB); None: no budget
CASES: dict[str, tuple[list[str], float | None, float | None]] = {
    "v3-ub512-amb2048": (["--preset", "deepseek-v3", "-c", "163000", "-ub", "512", "--amb",
                          "2048"], 30.0, 400.0),
    "r1-ub1-amb2048": (["--preset", "deepseek-r1", "-c", "163000", "-ub", "1", "--amb",
                        "2048"], None, None),
    "v3-ub1-q8_0-fa": (["--preset", "deepseek-v3", "-c", "163840", "-ub", "1", "-ctk", "q8_0",
                        "--fa"], None, None),
}


def run_one(name: str) -> dict:
    """Plan one case in this process: seconds, RSS growth, and the planned buffer size."""
    import psutil

    from ggraph.cli import main

    argv, _, _ = CASES[name]
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", *argv, "--json"])
    seconds = time.perf_counter() - t0
    grown = proc.memory_info().rss - rss0
    if rc != 0:
        raise SystemExit(f"ggraph plan {' '.join(argv)} exited {rc}")
    r = json.loads(out.getvalue())
    return {"case": name, "argv": argv, "seconds": seconds, "rss_growth_mib": grown / MIB,
            "n_nodes": r["n_nodes"], "compute_buffer_bytes": r["compute_buffer_bytes"]}


COLUMNS = [Column("case", width=18, align="<"), Column("n_nodes", "nodes", width=6),
           Column("seconds", fmt="{:.2f}", width=8),
           Column("budget_seconds", "budget", "{:.0f}", 7),
           Column("rss_growth_mib", "RSS MiB", "{:.0f}", 8),
           Column("budget_rss_mib", "budget", "{:.0f}", 7),
           Column(lambda r: r["compute_buffer_bytes"] / MIB, "buffer MiB", "{:.2f}", 11),
           Column(lambda r: "ok" if r["within_budget"] else "over", "status", align="<",
                  gap="  ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[
        repeat_option(1, help="runs per case (best time kept)"),
        out_option(results_path("plan.json"))])
    ap.add_argument("--one", help=argparse.SUPPRESS)   # child process: run one case
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return 0
    rows, over = [], False
    print("\n".join(header_lines(COLUMNS)))
    for name, (_, max_s, max_mib) in CASES.items():
        runs = [json.loads(subprocess.run([sys.executable, __file__, "--one", name],
                                          check=True, capture_output=True, text=True
                                          ).stdout.strip().splitlines()[-1])
                for _ in range(max(args.repeat, 1))]
        r = min(runs, key=lambda x: x["seconds"])
        r["rss_growth_mib"] = max(x["rss_growth_mib"] for x in runs)
        r["budget_seconds"], r["budget_rss_mib"] = max_s, max_mib
        r["within_budget"] = (max_s is None or r["seconds"] < max_s) and \
            (max_mib is None or r["rss_growth_mib"] < max_mib)
        over |= not r["within_budget"]
        rows.append(r)
        print(row_line(r, COLUMNS))
    write_results(args.out, rows, args=args, rows_key="results",
                  extra={"python": platform.python_version(), "machine": platform.machine(),
                         "repeat": args.repeat})
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
