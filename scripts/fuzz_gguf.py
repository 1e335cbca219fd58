#!/usr/bin/env python
"""Fuzz ggraph with structured mutants run at several settings: thousands of cases, each in a
worker process (the Python API) or as `ggraph run` (the CLI), with tables of outcomes.

    python scripts/fuzz_gguf.py --cases 5000 [--seed 0] [--jobs 2]
    python scripts/fuzz_gguf.py --seed 0 --mutant 123 [--keep DIR]   # one mutant again

Mutants (graphs/testing/gguf_mutate.py) start from tiny llama, qwen2, qwen3, gemma3 and deepseek2
files and from SmolLM2-135M (2% of them; --no-smollm2 leaves it out); each runs at
--per-mutant settings (graphs/testing/fuzz_cases.py: n_ctx, ubatch, threads, flash attention, mmap,
a short, long, chat or multi-turn prompt). The tables count outcomes per mutation, setting,
base file and way of running; every traceback, signal and timeout is listed with the command
that runs its mutant again, and the exit status is 1 when there is any. The JSON
(--json) also lists every case whose output differed from the unmutated file's.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--per-mutant", type=int, default=3, help="settings each mutant runs at")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--kinds", default="", help="only these mutations (comma-separated)")
    ap.add_argument("--kinds-in-turn", action="store_true",
                    help="each mutation kind in turn (every kind as often), not drawn by weight")
    ap.add_argument("--cli-share", type=float, default=0.04,
                    help="share of mutants whose first setting runs through `ggraph run`")
    ap.add_argument("--no-smollm2", action="store_true", help="tiny models only")
    ap.add_argument("--mutant", type=int, action="append", default=[],
                    help="run only this mutant (repeatable) and show each case")
    ap.add_argument("--keep", metavar="DIR", help="keep each mutant file in DIR")
    ap.add_argument("--json", default="benchmarks/results/fuzz_gguf_structured.json")
    args = ap.parse_args()

    from ggraph.graphs.testing.fuzz_structured import StructuredFuzz, structured_bases

    kinds = tuple(k for k in args.kinds.split(",") if k) or None
    smollm2 = None
    if not args.no_smollm2:
        from ggraph.graphs.gguf.fetch import default_model

        smollm2 = str(default_model())
    repro = "python scripts/fuzz_gguf.py" + (f" --kinds {args.kinds}" if kinds else "") + \
        (" --no-smollm2" if args.no_smollm2 else "") + \
        (f" --per-mutant {args.per_mutant}" if args.per_mutant != 3 else "") + \
        (" --kinds-in-turn" if args.kinds_in_turn else "") + \
        (f" --cli-share {args.cli_share}" if args.cli_share != 0.04 else "")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        bases = structured_bases(Path(d), smollm2)
        fuzz = StructuredFuzz(bases, args.seed, args.per_mutant, args.timeout, kinds,
                              args.cli_share, repro=repro, keep=args.keep,
                              in_turn=args.kinds_in_turn)
        report = fuzz.run(args.cases, args.jobs, args.mutant or None, progress=True)
    seconds = round(time.time() - t0)
    cases = [r for r in report.results if r.mutant.kind != "none"]
    if args.mutant:
        for r in report.results:
            print(f"{r.mutant.kind} #{r.mutant.index} {r.base} [{r.setting}, {r.via}] "
                  f"{r.mutant.what}: {r.outcome} {r.detail}")
        return 1 if report.bad() else 0

    print(report.table())
    print()
    print(report.table(lambda r: r.setting, "setting"))
    print()
    print(report.table(lambda r: r.base, "base"))
    print()
    print(report.table(lambda r: r.via, "via"))
    print(f"\n(`none`: the unmutated files at the settings and inputs the mutants ran with, "
          f"{len(report.results) - len(cases)} cases besides the {len(cases)} mutant cases)")
    for b in report.bad():
        print(f"BAD {b.outcome}: {b.mutant.kind} {b.mutant.what} [{b.base}, {b.setting}, "
              f"{b.via}]: {b.detail}\n    again: {b.repro or '(the unmutated file)'}")
    for r in fuzz.retried:
        print(f"retried after a timeout: {r}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())

    def row(r: object) -> dict:
        return {"kind": r.mutant.kind, "mutant": r.mutant.index, "what": r.mutant.what,
                "base": r.base, "setting": r.setting, "via": r.via, "outcome": r.outcome,
                "detail": r.detail, "repro": r.repro}

    out = {"command": " ".join(sys.argv), "cases": len(cases), "baseline_cases":
           len(report.results) - len(cases), "mutants": -(-args.cases // args.per_mutant),
           "seed": args.seed, "jobs": args.jobs, "seconds": seconds, "cpu": cpu,
           "table": {k: dict(v) for k, v in report.counts().items()},
           "by_setting": {k: dict(v) for k, v in report.counts(lambda r: r.setting).items()},
           "by_base": {k: dict(v) for k, v in report.counts(lambda r: r.base).items()},
           "by_via": {k: dict(v) for k, v in report.counts(lambda r: r.via).items()},
           "bad": [row(b) for b in report.bad()], "retried": fuzz.retried,
           "different": [row(r) for r in cases if r.outcome == "different output"]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(cases)} mutant cases (+{out['baseline_cases']} unmutated) in {seconds} s on "
          f"{cpu}; JSON: {args.json}")
    return 1 if report.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
