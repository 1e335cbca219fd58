"""GPU check of the CUDA backend: every conformance case and the attention graphs on CUDA vs
the numpy reference (OK/FAIL lines and a summary), then perf figures, to run on a machine with
an NVIDIA GPU:

    python tools/gpu_check.py --json gpu_check.json

- conformance: every case of ggraph.conformance (all ops, all accepted types, strided
  sources), judged by NMSE with the facts page's tolerances, canaries around every output;
- graphs: llama-style attention (mul_mat -> soft_max -> mul_mat, in place softmax), split
  attention over head groups (-amb) and flash attention, with quantized K/V caches, planned
  by the real graph allocator;
- perf: GFLOPS of F32 and Q4_1 mul_mat at 4096x4096x512 and mat-vec (with GB/s), flash
  attention at n_kv 32768, 32 heads x 128 dims, T=1 and T=512 (F16 K/V).

`--tiny` shrinks everything so the check also runs under numba's simulator
(NUMBA_ENABLE_CUDASIM=1; a subset of cases, tiny perf shapes). `--ptx` needs no GPU: it
compiles every kernel variant the cases and graphs launch to PTX with libNVVM (CUDA_HOME),
assembles each with ptxas -v and judges it (backends/cuda/ptx.py): no spills, registers x
threads within 64K, static shared memory within 48 KB, float64 instructions within the
kernel's budget; a table, and exit status 1 when any fails. The same as `ggraph gpu-check`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggraph import Context, GGMLType as T, build_graph, ops as O
from ggraph.conformance import Summary, cases_for, compare, run_case
from ggraph.graphs.attention import AttentionShape, build_attention
from ggraph.opkind import OpKind
from ggraph.reference import run_reference
from ggraph.tensor import Tensor

GraphCase = tuple[str, Callable[[Context, np.random.Generator], tuple[Tensor, dict]], float]


# -- graphs -----------------------------------------------------------------------------------

def attention_cases(tiny: bool = True) -> list[GraphCase]:
    """Attention graphs of graphs/attention.py: plain (V transposed), split over head groups
    (amb) with ALiBi, and flash; K/V caches of several types."""
    hd, H, Hkv, T_, nkv = (32, 4, 2, 3, 48) if tiny else (128, 32, 8, 7, 1024)
    sh = AttentionShape(hd, H, Hkv, T_, nkv)

    def make(kvt: T, flash: bool, amb: int, max_bias: float):
        def build(ctx: Context, rng: np.random.Generator):
            q = ctx.new_tensor(T.F32, (hd, H, T_), "q").set_input()
            kc = ctx.new_tensor(kvt, (hd * Hkv, nkv), "k_cache").set_data(
                rng.uniform(-1, 1, (nkv, hd * Hkv)))
            if flash:
                vc = ctx.new_tensor(kvt, (hd * Hkv, nkv), "v_cache").set_data(
                    rng.uniform(-1, 1, (nkv, hd * Hkv)))
            else:  # V stored transposed: one row per channel, so a float type
                vc = ctx.new_tensor(T.F16, (nkv, hd * Hkv), "v_cache").set_data(
                    rng.uniform(-1, 1, (hd * Hkv, nkv)))
            mask = ctx.new_tensor(T.F16, (nkv, T_), "mask").set_input()
            m = np.zeros((T_, nkv))
            m[:, nkv - 5:] = -np.inf
            m[0, 2] = -np.inf
            out = build_attention(q, kc, vc, mask, shape=sh, kq_scale=hd ** -0.5,
                                  max_bias=max_bias, flash=flash, amb_mib=amb)
            return out, {q: rng.uniform(-1, 1, q.shape), mask: m}
        return build

    kq = nkv * T_ * H * 4  # K*Q bytes; run_graph_case makes amb count bytes
    out: list[GraphCase] = []
    for kvt in (T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.BF16, T.F32):
        out.append((f"attention(kv={kvt},flash)", make(kvt, True, 0, 0.0), 5e-4))
    for kvt in (T.F16, T.Q8_0, T.Q4_0):
        out.append((f"attention(k={kvt},v=f16,plain)", make(kvt, False, 0, 0.0), 5e-4))
    # split: amb of a quarter of K*Q (in units of A.MIB) -> several head groups, ALiBi on
    out.append(("attention(k=f16,split,alibi)", make(T.F16, False, -(-kq // 4), 8.0), 5e-4))
    out.append(("attention(k=q8_0,split)", make(T.Q8_0, False, -(-kq // 2), 0.0), 5e-4))
    return out


TINY_GRAPHS = ("attention(kv=q4_0,flash)", "attention(k=q8_0,v=f16,plain)",
               "attention(k=f16,split,alibi)")


@dataclass
class GraphResult:
    ok: bool
    nmse: float
    detail: str
    session: Any = None
    graph: Any = None


def run_graph_case(case: GraphCase, backend: Any, seed: int = 0) -> GraphResult:
    """Build, run on `backend` with the real graph allocator and on the reference; compare."""
    import ggraph.graphs.attention as A

    name, build, tol = case
    old = A.MIB
    A.MIB = 1  # amb counts bytes here, so tiny graphs split over head groups too
    try:
        out, inputs = build(Context(name), np.random.default_rng(seed))
    finally:
        A.MIB = old
    out.set_output()
    graph = build_graph(out)
    ref = run_reference(graph, inputs).read(out)
    session = backend.session()
    session.run(graph, inputs)
    ok, err, why = compare(ref, session.read(out), tol)
    groups = sum(1 for n in graph.nodes if n.op == OpKind.SOFT_MAX)
    return GraphResult(ok, err, why + (f"({groups} head groups)" if groups > 1 else ""),
                       session, graph)


# -- perf -------------------------------------------------------------------------------------

def perf_cases(tiny: bool) -> list[tuple[str, Callable[[Context, np.random.Generator], Tensor],
                                         Callable[[Tensor], float], Callable[[Tensor], float]]]:
    """(name, build, flops(out), bytes(out)) per perf case."""
    mm = (32, 32, 16) if tiny else (4096, 4096, 512)                  # M, K, N
    fa = (32, 2, 32, (1, 2)) if tiny else (128, 32, 32768, (1, 512))  # D, H, n_kv, T's

    def mul_mat(t: T, n: int):
        def build(ctx, rng):
            m, k, _ = mm
            w = ctx.new_tensor(t, (k, m), "w").set_data(rng.uniform(-1, 1, (m, k)))
            x = ctx.new_tensor(T.F32, (k, n), "x").set_data(rng.uniform(-1, 1, (n, k)))
            return O.mul_mat(w, x)
        return build

    def flash(tq: int):
        def build(ctx, rng):
            d, h, nkv, _ = fa
            q = ctx.new_tensor(T.F32, (d, tq, h), "q").set_data(rng.uniform(-1, 1, (h, tq, d)))
            k = ctx.new_tensor(T.F16, (d, nkv, h), "k").set_data(
                rng.uniform(-1, 1, (h, nkv, d)).astype(np.float32))
            v = ctx.new_tensor(T.F16, (d, nkv, h), "v").set_data(
                rng.uniform(-1, 1, (h, nkv, d)).astype(np.float32))
            mask = ctx.new_tensor(T.F16, (nkv, tq), "mask").set_data(np.zeros((tq, nkv)))
            return O.flash_attn_ext(q, k, v, mask, d ** -0.5)
        return build

    def mm_flops(o: Tensor) -> float:
        return 2.0 * o.src[0].ne[0] * o.nelements

    def mm_bytes(o: Tensor) -> float:
        return float(o.src[0].nbytes + o.src[1].nbytes + o.nbytes)

    def fa_flops(o: Tensor) -> float:
        q, k, v, _ = o.src
        return 2.0 * q.ne[1] * q.ne[2] * k.ne[1] * (q.ne[0] + v.ne[0])

    def fa_bytes(o: Tensor) -> float:
        return float(sum(s.nbytes for s in o.src if s is not None) + o.nbytes)

    m, k, n = mm
    cases = []
    for t in (T.F32, T.Q4_1):
        cases.append((f"mul_mat(type={t},m={m},k={k},n={n})", mul_mat(t, n), mm_flops, mm_bytes))
        cases.append((f"mul_mat(type={t},m={m},k={k},n=1)", mul_mat(t, 1), mm_flops, mm_bytes))
    for tq in fa[3]:
        cases.append((f"flash_attn_ext(kv=f16,d={fa[0]},h={fa[1]},n_kv={fa[2]},T={tq})",
                      flash(tq), fa_flops, fa_bytes))
    return cases


def time_node(backend: Any, out: Tensor, min_seconds: float, max_runs: int) -> float:
    """Seconds per run of the graph (planned and bound once; the first run compiles). Later
    runs replay the bound launches, so this is kernel time plus numba's dispatch per launch."""
    graph = build_graph(out)
    session = backend.session()
    session.run(graph)
    session.synchronize()
    n, t0 = 0, time.perf_counter()
    while True:  # batches of queued launches, synchronized, until min_seconds have passed
        for _ in range(max(1, min(10, max_runs - n))):
            session.run(graph)
            n += 1
        session.synchronize()
        dt = time.perf_counter() - t0
        if dt >= min_seconds or n >= max_runs:
            return dt / n


# -- PTX-only ---------------------------------------------------------------------------------

def ptx_rows(cc: tuple[int, int]) -> list[Any]:
    """The PTX gate's verdict (backends/cuda/ptx.py) on every kernel variant compiled so far."""
    from ggraph.backends.cuda import ptx as P, runtime as R

    ptxas = P.find_ptxas()
    return [P.judge(v.kernel, str(v.signature), v.threads, v.ptx, v.error, ptxas, cc)
            for v in sorted(R.ptx_results(), key=lambda v: (v.kernel, str(v.signature)))]


# -- main -------------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-check", help="check the CUDA backend on a GPU, or compile every "
                       "kernel to PTX and judge it without one (--ptx)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--tiny", action="store_true", help="simulator-sized: case subset, tiny perf")
    ap.add_argument("--ops", default="", help="comma-separated ops to check (default: all)")
    ap.add_argument("--no-perf", action="store_true", help="skip the perf figures")
    ap.add_argument("--no-graphs", action="store_true", help="skip the attention graphs")
    ap.add_argument("--ptx", action="store_true", help="no GPU: compile every kernel to PTX")
    ap.add_argument("--cc", default="90", help="compute capability for --ptx (default 90)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="time per perf case")


def run(args: argparse.Namespace) -> int:

    from ggraph.backends.cuda import runtime as R
    cc = (int(args.cc[:-1]), int(args.cc[-1]))
    if args.ptx:
        R.enable_ptx_check(cc)
    if R.SIM:
        sys.setswitchinterval(5e-4)  # simulated threads wait on each other; switch sooner
    from ggraph.backends.cuda import CUDABackend

    backend = CUDABackend()
    report: dict[str, Any] = {"device": backend.device_name, "mode": R.MODE}
    print(f"GPU: {backend.device_name} (mode {R.MODE})", flush=True)
    ops = [OpKind[o.strip().upper()] for o in args.ops.split(",") if o.strip()] or None

    summary = Summary("cuda")
    seen: set[OpKind] = set()
    t0 = time.perf_counter()
    for case in cases_for(ops):
        if args.tiny and case.op in seen and ops is None:
            continue  # --tiny: the first case of each op
        seen.add(case.op)
        try:
            r = run_case(case, backend)
        except Exception as e:  # report and go on: one broken kernel must not hide the rest
            from ggraph.conformance import Result
            r = Result(case, "FAIL", float("nan"), f"{type(e).__name__}: {e}"[:300])
        summary.results.append(r)
        if not args.ptx:
            print(r.line(), flush=True)
    report["conformance"] = summary.to_json()
    if not args.ptx:
        print(f"conformance: {summary.passed}/{summary.tested} tests passed "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)

    graph_rows = []
    if not args.no_graphs:
        for gc in attention_cases(tiny=args.tiny or args.ptx):
            if args.tiny and gc[0] not in TINY_GRAPHS:
                continue
            try:
                res = run_graph_case(gc, backend)
                ok, err, why = res.ok, res.nmse, res.detail
            except Exception as e:
                ok, err, why = False, float("nan"), f"{type(e).__name__}: {e}"[:300]
            graph_rows.append({"graph": gc[0], "status": "OK" if ok else "FAIL", "nmse": err,
                               "detail": why})
            if not args.ptx:
                print(f"  {gc[0]}: {'OK' if ok else 'FAIL'} (nmse={err:.2e}) {why}", flush=True)
        report["graphs"] = graph_rows

    perf_rows = []
    if not args.no_perf and not args.ptx:
        print("perf:", flush=True)
        for name, build, flops, nbytes in perf_cases(args.tiny):
            try:
                out = build(Context(name), np.random.default_rng(0))
                per = time_node(backend, out, 0.0 if args.tiny else args.min_seconds,
                                1 if args.tiny else 1000)
                row = {"case": name, "us": per * 1e6, "gflops": flops(out) / per / 1e9,
                       "gbs": nbytes(out) / per / 1e9}
                print(f"  {name}: {row['us']:.0f} us, {row['gflops']:.1f} GFLOPS, "
                      f"{row['gbs']:.1f} GB/s", flush=True)
            except Exception as e:
                row = {"case": name, "error": f"{type(e).__name__}: {e}"[:300]}
                print(f"  {name}: ERROR {row['error']}", flush=True)
            perf_rows.append(row)
        report["perf"] = perf_rows

    failed = summary.failed + sum(r["status"] != "OK" for r in graph_rows)
    if args.ptx:
        from ggraph.backends.cuda.ptx import table

        rows = ptx_rows(cc)
        print("\n".join(table(rows)))
        bad = [r for r in rows if not r.ok]
        print(f"ptx: {len(rows) - len(bad)}/{len(rows)} kernel variants pass the gate for "
              f"sm_{args.cc} (no spills, registers x threads <= 64K, shared <= 48 KB, float64 "
              f"within budget)")
        report["ptx"] = [dataclasses.asdict(r) for r in rows]
        failed = len(bad)
    else:
        n_tests = summary.tested + len(graph_rows)
        print(f"summary: {n_tests - failed}/{n_tests} checks passed on {backend.device_name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
