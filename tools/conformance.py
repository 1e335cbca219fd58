"""`ggraph conformance`: run every op case on backends against the reference executor.

Modes: test (OK/FAIL per case, a summary per backend, exit status 1 on any failure), perf
(GFLOPS or GB/s per perf case), support (the op x type coverage table per backend), grad
(every backward rule's gradient, run on the backend, against central finite differences of
the float64 reference, as test-backend-ops -m grad; backend `reference` runs the backward
graph in float64 too, which checks the rules' math alone).
--inplace (test mode): every case of the ops ggml-alloc may run in place, with the result in
its source's memory under the real planner (a plan that does not reuse the source fails).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from ggraph.check.conformance import (Summary, cases_for, cases_inplace, parse_ops, perf_case,
                                      run_case, run_case_inplace)
from ggraph.check.grad_check import grad_cases, run_grad_case
from ggraph.ir.opkind import OpKind
from ggraph.ir.types import TYPE_RECORDS

TYPE_COLUMNS = tuple(str(t) for t in TYPE_RECORDS)  # every registered type, in record order


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conformance", help="check backends op by op against the reference",
                       description=__doc__)
    p.add_argument("--backend", default="cpu", help="comma-separated backends (cpu,cuda)")
    p.add_argument("--op", default="", help="comma-separated op names (mul_mat,soft_max,...)")
    p.add_argument("--mode", choices=("test", "perf", "support", "grad"), default="test")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--reference", choices=("numpy", "ggml"), default="numpy",
                   help="oracle: ggraph's numpy reference or the real libggml through cffi")
    p.add_argument("--inplace", action="store_true",
                   help="run the in-place ops (OpDef.inplace) with the result in its source's "
                        "memory, planned by the real allocator (test mode)")
    p.add_argument("-q", "--quiet", action="store_true", help="print failures only")
    p.set_defaults(func=main)


def _case_type(case) -> str:
    v = dict(case.vars)
    for key in ("type", "type_kv", "type_dst"):
        if key in v:
            return str(v[key])
    return "f32"


def main(args: argparse.Namespace) -> int:
    from ggraph.backends import get_backend

    ops = parse_ops(args.op)
    inplace = getattr(args, "inplace", False)
    if inplace and args.mode != "test":
        raise ValueError(f"--inplace runs in --mode test only, not --mode {args.mode}")
    runs = list(cases_inplace(ops)) if inplace else None   # names ops that never run in place
    reference = None
    if args.reference == "ggml":
        from ggraph.tools.ggml_ref import GGMLReference  # raises a clear error without libggml

        reference = GGMLReference()
    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not names:
        raise ValueError(f"--backend {args.backend!r} names no backend; give cpu, cuda or "
                         f"cpu,cuda")
    if args.mode == "grad" and (inplace or args.reference != "numpy"):
        raise ValueError("--mode grad checks against finite differences of the numpy "
                         "reference: no --inplace or --reference ggml")
    # all before any test: one-line errors (grad mode also takes `reference`: the float64
    # executor runs the backward graph, which checks the rules alone)
    backends = [None if args.mode == "grad" and name == "reference" else get_backend(name)
                for name in names]
    report = []
    failed = False
    for name, backend in zip(names, backends):
        print(f"Backend {name}:")
        if args.mode == "support":
            report.append(_support(backend, ops))
            continue
        summary = Summary(name)
        per_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        if inplace:
            results = (run_case_inplace(case, backend, reference, src) for case, src in runs)
        elif args.mode == "grad":
            results = (run_grad_case(case, backend) for case in grad_cases(ops))
        elif args.mode == "perf":
            results = (perf_case(case, backend) for case in cases_for(ops, perf=True))
        else:
            results = (run_case(case, backend, reference) for case in cases_for(ops))
        for r in results:
            summary.results.append(r)
            per_op[r.case.op.name][0] += r.status == "OK"
            per_op[r.case.op.name][1] += r.status not in ("not supported", "skipped")
            if not args.quiet or r.status == "FAIL":
                print(r.line(), flush=True)
        if args.mode in ("test", "grad"):
            print("  cases per op: " + ", ".join(f"{k} {ok}/{n}" for k, (ok, n) in
                                                 per_op.items()))
        skipped = (f", {summary.skipped} skipped (no source can hold the result: ggml-alloc "
                   f"never runs them in place)" if summary.skipped else "")
        print(f"  {summary.passed}/{summary.tested} tests passed"
              f"{' in place' if inplace else ''}{skipped}")
        failed |= summary.failed > 0
        out = summary.to_json()
        if inplace:
            out["mode"] = "inplace"
        report.append(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


def _support(backend, ops) -> dict:
    """op x type table: 'yes', 'no: <reason>' or 'n/a' (the op's shape rule refuses it)."""
    table: dict[str, dict[str, str]] = {}
    for case in cases_for(ops):
        _, out = case.make()
        from ggraph.ir.graph import build_graph

        node = next(n for n in build_graph(out).nodes if n.op == case.op)
        row = table.setdefault(case.op.value, {})
        t = _case_type(case)
        if backend.supports(node):
            row.setdefault(t, "yes")
        else:
            k = backend.kernels.get(node.op)
            row[t] = "no: " + (k.why_not if k and k.why_not else "no kernel")
    width = max(len(k) for k in table) + 2
    print(" " * width + "".join(f"{c:>7}" for c in TYPE_COLUMNS))
    views = {k.value for k in OpKind if k.is_view}
    for op, row in table.items():
        if op in views:
            print(f"{op:<{width}}  (a view computes nothing: every type; checked through cont)")
            continue
        cells = "".join(f"{'ok' if row.get(c) == 'yes' else ('NO' if c in row else '-'):>7}"
                        for c in TYPE_COLUMNS)
        print(f"{op:<{width}}{cells}")
    print("  ok: supported and checked; NO: refused by the backend (reason below); -: the op's "
          "shape rule refuses this type (e.g. norms, softmax and sorting take f32 rows, element-"
          "wise ops f32/f16, blocks cannot be concatenated or repeated)")
    reasons = {f"{op}/{t}": v for op, row in table.items() for t, v in row.items()
               if v != "yes"}
    for k, v in reasons.items():
        print(f"  {k}: {v}")
    return {"backend": backend.name, "support": table}
