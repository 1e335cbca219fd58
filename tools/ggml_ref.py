"""`ggraph ggml-compare`: ggraph against the real libggml (through cffi, ggraph.check.ggml_ref).

(a) Every conformance case runs on ggraph's CPU backend and on ggml's CPU backend; the two
    outputs are compared by NMSE within the case's tolerance (facts page section 9). Lines read
    `OP(vars): OK`, `FAIL (nmse=..., ggml vs numpy ..., cpu vs numpy ...)` or
    `not supported by ggml (why)`.
(b) ggraph's `ggml` allocator strategy against ggml_gallocr on the same graphs: random DAGs
    (the allocator tests' and benchmark's generators, and one of valid ops), attention blocks
    (plain, flash, split) and SmolLM2 graphs (one layer, whole model, reserve sizes), buffer
    bytes side by side.

libggml comes from $GGRAPH_LIBGGML or the llama-cpp-python package
(benchmarks/compare_ggml.sh installs it). This module also re-exports GGMLReference, which
`ggraph conformance --reference ggml` imports.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ggraph.check.ggml_ref import (GGMLReference, GGMLUnavailable, GGMLUnsupported,  # noqa: F401
                             ggml_gallocr_size, load)

REPO = Path(__file__).resolve().parents[1]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ggml-compare", help="compare ops and allocator sizes with the real "
                       "libggml (llama-cpp-python's build)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--op", default="", help="comma-separated op names for the case part")
    p.add_argument("--no-cases", action="store_true", help="skip the op cases")
    p.add_argument("--no-alloc", action="store_true", help="skip the allocator comparison")
    p.add_argument("--no-model", action="store_true", help="skip the SmolLM2 graphs")
    p.add_argument("-q", "--quiet", action="store_true", help="print failures and summaries")
    p.set_defaults(func=main)


# -- (a) op cases ----------------------------------------------------------------------------

class _Capture:
    """Wraps the ggml reference so the comparison keeps ggml's output too."""

    def __init__(self, ref: GGMLReference) -> None:
        self.ref = ref
        self.last: np.ndarray | None = None

    def run(self, graph: Any, out: Any) -> np.ndarray:
        self.last = self.ref.run(graph, out)
        return self.last


def compare_case(case: Any, backend: Any, ref: GGMLReference) -> dict:
    """One case: ggraph CPU vs ggml; the status and NMSE figures as a dict."""
    from ggraph.check.conformance import compare, run_case
    from ggraph.ir.graph import build_graph
    from ggraph.check.reference import run_reference

    _, out = case.make()
    out.set_output()
    graph = build_graph(out)
    row: dict[str, Any] = {"case": case.label, "op": case.op.name, "tol": case.tol}
    ok, why = ref.supports(graph)
    if not ok:
        return {**row, "status": "not supported by ggml", "detail": why}
    if not all(backend.supports(n) for n in graph.nodes):
        return {**row, "status": "not supported by ggraph cpu", "detail": ""}
    cap = _Capture(ref)
    try:
        r = run_case(case, backend, reference=cap)
    except GGMLUnsupported as e:
        return {**row, "status": "not supported by ggml", "detail": str(e)}
    numpy_out = run_reference(graph).read(out)
    _, vs_numpy, _ = compare(numpy_out, cap.last, case.tol)
    row.update(status=r.status, nmse=r.nmse, detail=r.detail, ggml_vs_numpy=vs_numpy)
    if r.status == "FAIL":  # who is off: the CPU backend or ggml?
        row["cpu_vs_numpy"] = run_case(case, backend).nmse
    return row


def case_line(row: dict) -> str:
    s = f"  {row['case']}: {row['status']}"
    if row["status"] == "FAIL":
        s += (f" (nmse={row['nmse']:.2e} > tol {row['tol']:.0e}; ggml vs numpy "
              f"{row['ggml_vs_numpy']:.2e}, cpu vs numpy {row.get('cpu_vs_numpy', 0):.2e}"
              f"{'; ' + row['detail'] if row['detail'] else ''})")
    elif row["status"].startswith("not supported"):
        s += f" ({row['detail']})" if row["detail"] else ""
    return s


def run_cases(ref: GGMLReference, ops: Any, quiet: bool) -> dict:
    from ggraph.backends import get_backend
    from ggraph.check.conformance import cases_for

    backend = get_backend("cpu")
    rows = []
    for case in cases_for(ops):
        row = compare_case(case, backend, ref)
        rows.append(row)
        if not quiet or row["status"] == "FAIL":
            print(case_line(row), flush=True)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    tested = counts.get("OK", 0) + counts.get("FAIL", 0)
    print(f"  {counts.get('OK', 0)}/{tested} cases agree with ggml; " +
          ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" ({len(rows)} cases)")
    return {"counts": counts, "cases": rows}


# -- (b) allocator graphs ----------------------------------------------------------------------

@dataclass
class AllocGraph:
    name: str
    kind: str
    mode: str                      # "ops" (ggml's constructors) or "raw" (fields written)
    build: Callable[[], Any]


def _import_file(path: Path, name: str) -> Any:
    """A module of the source tree (tests/, benchmarks/) or None when absent or broken."""
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod
    except Exception:  # noqa: BLE001 - a missing test dependency (hypothesis): fall back
        return None


def valid_random_graph(seed: int, n_nodes: int = 60) -> Any:
    """A random DAG of real ops (shape rules hold, so ggml's constructors accept it): element-
    wise and in-place ops, mat-muls with weights, norms, softmax, views, reshapes, transposed
    copies, concats, row gathers, writes through cpy, inputs and outputs."""
    from ggraph import ops as O
    from ggraph.ir.graph import Graph
    from ggraph.ir.tensor import Context

    rnd = random.Random(seed)
    ctx = Context("valid-random")
    dims = [32, 64, 96]
    pool = [ctx.new_tensor("f32", (rnd.choice(dims), rnd.choice([1, 4, 8])),
                           name=f"in{i}").set_input() for i in range(3)]
    g = Graph(capacity=4 * n_nodes + 64)

    def pick() -> Any:
        return pool[-1 - min(int(rnd.expovariate(0.4)), len(pool) - 1)]

    def weight(*ne: int) -> Any:
        w = ctx.new_tensor(rnd.choice(["f32", "f16", "q8_0"]) if ne[0] % 32 == 0 else "f32", ne)
        w.buffer = "model"
        return w

    while g.n_nodes < n_nodes:
        a = pick()
        r = rnd.random()
        same = [t for t in pool if t.ne == a.ne]
        try:
            if r < 0.25:
                t = rnd.choice([O.add, O.mul])(a, rnd.choice(same))
            elif r < 0.4:
                t = rnd.choice([O.silu, O.gelu, lambda x: O.scale(x, 0.5), O.soft_max,
                                lambda x: O.rms_norm(x, 1e-6), lambda x: O.norm(x)])(a)
            elif r < 0.55:
                t = O.mul_mat(weight(a.ne[0], rnd.choice(dims)), a)
            elif r < 0.62:
                t = O.swiglu(a, rnd.choice(same))
            elif r < 0.7:
                t = O.reshape(a, a.nelements)
            elif r < 0.76 and a.ne[1] > 1:
                t = O.view_2d(a, a.ne[0], a.ne[1] // 2, a.nb[1], a.nb[1] * (a.ne[1] // 2))
            elif r < 0.82:
                t = O.cont(O.transpose(a))
            elif r < 0.87:
                t = O.concat(a, rnd.choice(same), 1)
            elif r < 0.92 and a.ne[1] > 1:
                t = O.get_rows(a, ctx.new_tensor("i32", (rnd.randint(1, 4),)).set_input())
            elif r < 0.96:
                dst = ctx.new_tensor("f16", a.ne)
                dst.buffer = "cache"
                t = O.cpy(a, dst)     # a write into a cache: not reused (F16)
            else:
                t = O.sum_rows(a)
        except ValueError:            # a shape rule refused the draw (e.g. a strided view)
            continue
        if rnd.random() < 0.06:
            t.set_output()
        g.build_forward_expand(t)
        if t.type.name == "F32":
            pool.append(t)
    pool[-1].set_output()
    return g


def attention_graph(flash: bool = False, amb: int = 0, max_bias: float = 0.0, T: int = 32,
                    n_kv: int = 256, hd: int = 64, H: int = 8, Hkv: int = 2) -> Any:
    """One attention block (graphs/models/attention.py) over a pre-allocated F16 cache."""
    from ggraph.ir.graph import Graph
    from ggraph.graphs.models.attention import AttentionShape, build_attention
    from ggraph.ir.tensor import Context

    ctx = Context("attention")
    q = ctx.new_tensor("f32", (hd, H, T), name="q").set_input()
    kc = ctx.new_tensor("f16", (hd * Hkv, n_kv), name="cache_k")
    vc = ctx.new_tensor("f16", (hd * Hkv, n_kv) if flash else (n_kv, hd * Hkv), name="cache_v")
    kc.buffer = vc.buffer = "kv_cache"
    mask = ctx.new_tensor("f16" if flash else "f32", (n_kv, T), name="kq_mask").set_input()
    g = Graph(capacity=4096)
    out = build_attention(q, kc, vc, mask, shape=AttentionShape(hd, H, Hkv, T, n_kv),
                          kq_scale=hd ** -0.5, max_bias=max_bias, flash=flash, amb_mib=amb,
                          graph=g)
    return g.build_forward_expand(out.set_output())


def clamp_probe() -> Any:
    """x -> mul -> clamp -> add: ggml-alloc may run CLAMP in place (ggml_op_can_inplace)."""
    from ggraph import ops as O
    from ggraph.ir.graph import build_graph
    from ggraph.ir.tensor import Context

    ctx = Context("clamp")
    x = ctx.new_tensor("f32", (256, 64), name="x").set_input()
    y = O.clamp(O.mul(x, x), -0.5, 0.5)
    return build_graph(O.add(O.scale(y, 2.0), x).set_output())


_MODEL: dict[str, Any] = {}


def _model_graph(n_tokens: int, n_kv: int, n_out: int, flash: bool = False, amb: int = 0,
                 n_layer: int | None = None, type_k: str = "f16", type_v: str = "f16") -> Any:
    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.gguf.fetch import default_model
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.ir.tensor import Context

    gguf = _MODEL.get("gguf")
    if gguf is None:  # the header only: planning needs no weights
        gguf = _MODEL["gguf"] = load_gguf(default_model(quiet=True), with_data=False)
    over = {"n_layer": n_layer} if n_layer else {}
    model = model_class(gguf.arch, gguf.path)(gguf, **over)
    ctx = Context("smollm2")
    cache = model.new_cache(ctx, n_kv, type_k, type_v, flash_attn=flash)
    return model.build(ctx, cache, n_tokens, n_kv, n_out, flash, amb).graph


def _tiny_deepseek2_graph(n_tokens: int, n_kv: int, flash: bool) -> Any:
    import tempfile

    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.gguf.gguf_file import load_gguf
    from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2
    from ggraph.ir.tensor import Context

    with tempfile.TemporaryDirectory() as d:
        gguf = load_gguf(write_tiny_deepseek2(Path(d) / "ds2.gguf"), with_data=False)
        model = model_class(gguf.arch, gguf.path)(gguf)
        ctx = Context("tiny-deepseek2")
        cache = model.new_cache(ctx, n_kv, flash_attn=flash)
        return model.build(ctx, cache, n_tokens, n_kv, n_tokens, flash).graph


def alloc_graphs(model: bool = True) -> Iterator[AllocGraph]:
    """The graphs of part (b): at least 20 without the model, 30 with it."""
    tests = _import_file(REPO / "tests" / "plan_cases.py", "_ggraph_plan_cases")
    if tests is not None:
        for seed in range(8):
            yield AllocGraph(f"random-props-{seed}", "random (tests' generator)", "raw",
                             lambda s=seed: tests.random_graph(random.Random(s), 40)[0])
    bench = _import_file(REPO / "benchmarks" / "bench_alloc.py", "_ggraph_bench_alloc")
    if bench is not None:
        for n, seed in ((300, 1), (2000, 2)):
            yield AllocGraph(f"random-dag-{n}", "random (benchmark's generator)", "raw",
                             lambda n=n, s=seed: bench.random_dag(n, s))
        yield AllocGraph("decoder-4-layers", "benchmark decoder (q8_0, cpy into caches)", "ops",
                         lambda: bench.decoder_graph(160, n_embd=512, n_head=8, n_head_kv=2,
                                                     n_tokens=64, n_kv=512, n_ff=1024))
    n_valid = 6 if tests is not None and bench is not None else 14
    for seed in range(n_valid):
        yield AllocGraph(f"random-valid-{seed}", "random (valid ops)", "ops",
                         lambda s=seed: valid_random_graph(s, 40 + 20 * s))
    yield AllocGraph("attention", "attention T=32 n_kv=256 H=8/2", "ops", attention_graph)
    yield AllocGraph("attention-flash", "flash attention", "ops",
                     lambda: attention_graph(flash=True))
    yield AllocGraph("attention-split", "split attention (amb 2 MiB)", "ops",
                     lambda: attention_graph(amb=2, T=64, n_kv=4096))
    yield AllocGraph("attention-split-alibi", "split attention with ALiBi", "ops",
                     lambda: attention_graph(amb=2, T=64, n_kv=4096, max_bias=8.0))
    yield AllocGraph("clamp-probe", "clamp between in-place ops", "ops", clamp_probe)
    yield AllocGraph("tiny-deepseek2", "tiny DeepSeek2 (MLA, MoE)", "ops",
                     lambda: _tiny_deepseek2_graph(8, 64, False))
    if model:
        for name, kw in (("smollm2-1-layer", dict(n_tokens=32, n_kv=256, n_out=32, n_layer=1)),
                         ("smollm2-decode", dict(n_tokens=1, n_kv=256, n_out=1)),
                         ("smollm2-batch32", dict(n_tokens=32, n_kv=512, n_out=32)),
                         ("smollm2-reserve", dict(n_tokens=512, n_kv=4096, n_out=512)),
                         ("smollm2-reserve-last", dict(n_tokens=512, n_kv=4096, n_out=1)),
                         ("smollm2-flash", dict(n_tokens=32, n_kv=512, n_out=32, flash=True)),
                         ("smollm2-flash-q8_0", dict(n_tokens=32, n_kv=512, n_out=32,
                                                     flash=True, type_k="q8_0",
                                                     type_v="q8_0")),
                         ("smollm2-split", dict(n_tokens=512, n_kv=4096, n_out=512, amb=32))):
            yield AllocGraph(name, "SmolLM2-135M Q4_1", "ops", lambda kw=kw: _model_graph(**kw))


def compare_alloc(g: AllocGraph, alignment: int) -> dict:
    from ggraph.plan.alloc import plan_graph

    row: dict[str, Any] = {"graph": g.name, "kind": g.kind}
    try:
        graph = g.build()
    except Exception as e:  # noqa: BLE001 - e.g. the model cannot be fetched offline
        return {**row, "status": "skipped", "detail": f"{type(e).__name__}: {e}"}
    row.update(nodes=graph.n_nodes, leafs=graph.n_leafs)
    row["ggraph_ggml"] = plan_graph(graph, alignment, strategy="ggml").size
    row["ggraph_default"] = plan_graph(graph, alignment, strategy="default").size
    mode, detail = g.mode, ""
    try:
        size = ggml_gallocr_size(graph, alignment, mode=mode)
    except GGMLUnsupported as e:
        if mode != "ops":
            return {**row, "status": "not supported by ggml", "detail": str(e)}
        mode, detail = "raw", f"ops mode: {e}"
        size = ggml_gallocr_size(graph, alignment, mode="raw")
    row.update(mode=mode, ggml_gallocr=size, detail=detail,
               status="same" if size == row["ggraph_ggml"] else "DIFFERENT")
    return row


def alloc_line(r: dict) -> str:
    if r["status"] in ("skipped", "not supported by ggml"):
        return f"  {r['graph']:<24} {r['status']}: {r['detail']}"
    d = r["ggraph_ggml"] - r["ggml_gallocr"]
    return (f"  {r['graph']:<24} {r['nodes']:>5} {r['mode']:<4} {r['ggraph_ggml']:>12} "
            f"{r['ggml_gallocr']:>12} {r['status']:<9} {'' if not d else f'{d:+d} B':>9} "
            f"{r['ggraph_default']:>12}" + (f"  ({r['detail']})" if r["detail"] else ""))


def run_alloc(alignment: int, model: bool) -> dict:
    print(f"  {'graph':<24} {'nodes':>5} {'mode':<4} {'ggraph-ggml':>12} {'ggml_gallocr':>12} "
          f"{'':<9} {'diff':>9} {'ggraph-dflt':>12}   (bytes)")
    rows = []
    for g in alloc_graphs(model):
        r = compare_alloc(g, alignment)
        rows.append(r)
        print(alloc_line(r), flush=True)
    same = sum(r["status"] == "same" for r in rows)
    compared = sum(r["status"] in ("same", "DIFFERENT") for r in rows)
    print(f"  {same}/{compared} graphs: ggraph's ggml strategy plans exactly ggml_gallocr's "
          f"buffer size" + (f" ({len(rows) - compared} skipped)" if compared < len(rows) else ""))
    return {"same": same, "compared": compared, "graphs": rows}


# -- entry point ---------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    from ggraph.check.conformance import parse_ops

    try:
        lib = load()
    except GGMLUnavailable as e:
        print(f"ggraph ggml-compare: {e}", file=sys.stderr)
        return 2
    print(f"Reference: {lib.describe()}")
    report: dict[str, Any] = {"library": {"dir": str(lib.dir), "version": lib.version,
                                          "commit": lib.commit, "alignment": lib.alignment}}
    t0 = time.perf_counter()
    if not args.no_cases:
        print("Op cases (ggraph CPU backend vs ggml CPU backend):")
        report["cases"] = run_cases(GGMLReference(), parse_ops(args.op), args.quiet)
    if not args.no_alloc:
        print(f"Allocator: ggraph strategy 'ggml' vs ggml_gallocr (CPU buffer type, alignment "
              f"{lib.alignment}):")
        report["alloc"] = run_alloc(lib.alignment, not args.no_model)
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    failed = report.get("cases", {}).get("counts", {}).get("FAIL", 0)
    differ = sum(r["status"] == "DIFFERENT" for r in report.get("alloc", {}).get("graphs", []))
    return 1 if failed or differ else 0
