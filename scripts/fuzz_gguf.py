#!/usr/bin/env python
"""Fuzz ggraph's GGUF loading: thousands of mutants of tiny models and of SmolLM2, each run in
a worker process (load, tokenizer, chat template, a few tokens), with a table of outcomes.

    python scripts/fuzz_gguf.py --cases 3000 [--seed 0] [--json benchmarks/results/fuzz_gguf.json]

The cases are split over the bases: tiny llama (Q4_1, with a chat template), tiny DeepSeek2,
and SmolLM2-135M (a tenth of the cases; each mutant is a 90 MB file). Exit status 1 when any
case ends in a traceback, a signal or a timeout.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--json", default="benchmarks/results/fuzz_gguf.json")
    args = ap.parse_args()

    from ggraph.graphs.fetch import default_model
    from ggraph.graphs.gguf_fuzz import FuzzReport, fuzz, fuzz_bases

    t0 = time.time()
    report = FuzzReport()
    with tempfile.TemporaryDirectory() as d:
        bases = fuzz_bases(Path(d)) + [("smollm2", str(default_model()), 0.1)]
        rest = args.cases
        for i, (name, path, share) in enumerate(bases):
            n = rest if i == len(bases) - 1 else round(args.cases * share)
            rest -= n
            print(f"{name}: {n} cases", file=sys.stderr, flush=True)
            r = fuzz(path, n, seed=args.seed + i, timeout=args.timeout, progress=True)
            for c in r.results:
                c.mutant = replace(c.mutant, kind=f"{name} {c.mutant.kind}")
            report.results += r.results
    print(report.table())
    for b in report.bad():
        print(f"BAD {b.mutant.kind} {b.mutant.what}: {b.outcome}: {b.detail}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    out = {"cases": len(report.results), "seed": args.seed, "seconds": round(time.time() - t0),
           "cpu": cpu, "table": {k: dict(v) for k, v in report.counts().items()},
           "bad": [{"kind": b.mutant.kind, "what": b.mutant.what, "outcome": b.outcome,
                    "detail": b.detail} for b in report.bad()]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(report.results)} cases in {out['seconds']} s on {cpu}; JSON: {args.json}")
    return 1 if report.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
