"""`ggraph gpu-check`: the first script to run on a lent GPU (`python -m
ggraph.tools.gpu_check --json gpu_check.json`, under 8 minutes on an H200). It checks the CUDA
backend against the numpy reference and measures it, in sections, each printed as it ends and
all written to --json:

- header: the device, and the kernel geometry the backend launches with (threads per block
  and tiles of backends/cuda/templates.py and templates_mm.py: the GPU's sizes on a device,
  small ones in the simulator unless GGRAPH_CUDASIM_GEOMETRY=gpu);
- conformance: every case of ggraph.check.conformance (all ops, all accepted types, strided
  sources) judged by NMSE with canaries around every output; on a GPU split over `--jobs`
  processes, which compile kernels in parallel (tools/gpu/gpu_child.py);
- graphs: llama-style attention, split attention over head groups (-amb) and flash attention
  with quantized K/V caches, planned by the real graph allocator;
- inputs: every leaf uploaded for the cases above read back from the device and compared byte
  for byte with its host array (conformance compares results only: a corrupted upload, or a
  kernel writing into its source on the device, is seen here alone);
- perf: F32 and Q4_1 mul_mat at 4096x4096x512 and mat-vec, flash attention at n_kv 32768, 32
  heads x 128, T=1 and 512, timed by CUDA events and wall clock side by side, and torch's
  matmul (F32, TF32, BF16) and SDPA at the same shapes in the same process (tools/gpu/gpu_perf.py);
- launch: the host's cost of one kernel launch through the Session's bound-launch replay;
- decode: tokens/s of a SmolLM2-135M-shaped llama with random Q8_0 (or Q4_1) weights made on
  the device, at several context lengths, and the launches per token (tools/gpu/gpu_decode.py);
- sanitizer: this script re-run on a case subset under compute-sanitizer's memcheck and
  racecheck, their error summaries (tools/gpu/gpu_child.py).

Sections that need a real GPU (torch, sanitizer) skip with a one-line reason elsewhere; on a GPU
a time budget (--budget) leaves each later section its share. `--tiny` shrinks everything so
the whole check runs under numba's simulator (NUMBA_ENABLE_CUDASIM=1) in seconds. `--ptx` needs
no GPU: it compiles every kernel variant the cases and graphs launch to PTX with libNVVM
(CUDA_HOME), assembles each with ptxas -v and judges it (backends/cuda/ptx.py): no spills,
registers x threads within 64K, static shared memory within 48 KB, float64 instructions within
the kernel's budget; a table, and exit status 1 when any fails. Exit status 1 when any check
fails.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggraph import Context, GGMLType as T, build_graph
from ggraph.check.conformance import Result, Summary, cases_for, compare, run_case
from ggraph.graphs.models.attention import AttentionShape, build_attention
from ggraph.ir.opkind import OpKind
from ggraph.check.reference import run_reference
from ggraph.ir.tensor import Tensor

from ggraph.tools.gpu import gpu_perf as _perf  # what this module offered before perf moved to gpu_perf.py, for scripts that import it here
perf_cases, time_node = _perf.perf_cases, _perf.time_node

GraphCase = tuple[str, Callable[[Context, np.random.Generator], tuple[Tensor, dict]], float]
SECTIONS = ("conformance", "graphs", "perf", "launch", "decode", "sanitizer")
# about how long each section after conformance takes on an H200 (kernels compiled by the
# conformance shards come from numba's disk cache): what the budget keeps for them
NEEDS = {"graphs": 30.0, "perf": 60.0, "launch": 10.0, "decode": 45.0, "sanitizer": 150.0}


# -- graphs -----------------------------------------------------------------------------------

def attention_cases(tiny: bool = True) -> list[GraphCase]:
    """Attention graphs of graphs/models/attention.py: plain (V transposed), split over head groups
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
    import ggraph.graphs.models.attention as A

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


# -- device-side inputs -------------------------------------------------------------------------

def track_uploads(backend: Any) -> list[Tensor]:
    """Keep every tensor `backend` uploads alive (in the returned list) until the check: the
    backend caches device copies weakly by tensor, and a conformance case's leafs are gone
    once the case returns, their copies with them."""
    kept: list[Tensor] = []
    backend.buffers.upload_observers.append(kept.append)
    return kept


def check_device_inputs(backend: Any, tensors: list[Tensor]) -> dict[str, Any]:
    """Read back the device copy of each uploaded tensor (CUDABufferType.uploaded: tensor ->
    (host array, device array)) and compare its bytes with the host array it was made from."""
    seen: set[int] = set()
    checked = nbytes = 0
    bad: list[dict[str, Any]] = []
    for t in tensors:
        hit = backend.buffers.uploaded(t)
        if hit is None or id(hit[1]) in seen:
            continue
        seen.add(id(hit[1]))
        host, dev = hit
        want = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
        got = np.asarray(backend.buffers.to_host(dev)).reshape(-1)[:want.size]
        checked += 1
        nbytes += want.size
        diff = np.flatnonzero(got != want) if got.size == want.size else np.arange(want.size)
        if diff.size:
            i = int(diff[0])
            bad.append({"tensor": t.describe(), "bytes_differ": int(diff.size),
                        "first_offset": i, "host": int(want[i]),
                        "device": int(got[i]) if i < got.size else None})
    return {"status": "FAIL" if bad else "OK", "checked": checked, "bytes": nbytes,
            "mismatches": bad}


def inputs_lines(d: dict[str, Any]) -> list[str]:
    head = (f"inputs: {d['checked']} uploaded leafs ({d['bytes'] / 2**20:.2f} MiB) read back "
            f"from the device")
    if not d["mismatches"]:
        return [f"{head}: all equal their host arrays"]
    lines = [f"{head}: FAIL, {len(d['mismatches'])} differ"]
    for m in d["mismatches"][:20]:
        dev = "past its end" if m["device"] is None else f"{m['device']:#04x}"
        lines.append(f"  {m['tensor']}: {m['bytes_differ']} bytes differ, the first at offset "
                     f"{m['first_offset']} (host {m['host']:#04x}, device {dev})")
    return lines


# -- header ---------------------------------------------------------------------------------------

GEOMETRY_MODULES = ("templates", "templates_mm", "templates_attn")


def geometry() -> dict[str, Any]:
    """The launch geometry the kernels run with: every integer (or tuple) constant of the
    kernel template modules (threads per block, tiles, caps), by module, read rather than
    listed so that a constant added there shows up here."""
    import importlib

    from ggraph.backends.cuda import runtime as R

    out: dict[str, Any] = {"kind": "small (simulator)" if R.SMALL else "gpu",
                           "MAX_BLOCKS": R.MAX_BLOCKS}
    for name in GEOMETRY_MODULES:
        try:
            mod = importlib.import_module(f"ggraph.backends.cuda.{name}")
        except ImportError:
            continue
        out[name] = {k: v for k, v in vars(mod).items()
                     if k.isupper() and isinstance(v, (int, tuple)) and not isinstance(v, bool)}
    return out


def geometry_line(g: dict[str, Any]) -> str:
    def c(key: str) -> Any:
        for name in GEOMETRY_MODULES:
            if key in g.get(name, {}):
                return g[name][key]
        return "?"

    hint = " (GGRAPH_CUDASIM_GEOMETRY=gpu: the GPU's)" if g["kind"].startswith("small") else ""
    return (f"geometry {g['kind']}{hint}: element-wise {c('EW_NT')} threads/block, rows "
            f"{c('ROW_NT')}, sort {c('SORT_NT')} (rows <= {c('SORT_MAX')}), mul_mat tiles "
            f"{c('MM_TM')}x{c('MM_TN')}x{c('MM_TK')} of {c('MM_RM')}x{c('MM_RN')} per thread "
            f"({c('MM_NT')} threads), mat-vec {c('MV_LANES')} lanes x {c('MV_WARPS')} rows, "
            f"flash attention {c('FA_NT')} threads, grids up to {g['MAX_BLOCKS']} blocks")


# -- time budget ----------------------------------------------------------------------------------

class Clock:
    """The run's time budget (0: none): conformance stops starting cases when only what the
    later sections need is left, and a later section skips when less than its need is."""

    def __init__(self, budget: float, later: list[str]) -> None:
        self.t0 = time.perf_counter()
        self.budget = budget
        self.reserve = sum(NEEDS.get(s, 0.0) for s in later)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0) if self.budget else float("inf")

    def conformance_deadline(self) -> float | None:
        if not self.budget:
            return None
        return self.t0 + max(self.budget * 0.25, self.budget - self.reserve)

    def skip_reason(self, section: str) -> str | None:
        need = NEEDS.get(section, 0.0)
        left = self.left()
        if left < need:
            return f"time budget: {max(left, 0):.0f} s of {self.budget:.0f} s left, the " \
                   f"section needs about {need:.0f} s"
        return None


# -- conformance ----------------------------------------------------------------------------------

def select_cases(ops: list[OpKind] | None, per_op: int = 0, match: str = "",
                 shard: tuple[int, int] | None = None) -> list[Any]:
    """The conformance cases to run: of `ops` (all when None), those whose label `match`
    finds (a regular expression), the first per_op of each op (0: all), and of those every
    n-th from the i-th for shard (i, n): strided, so each shard gets its share of heavy ops."""
    rx = re.compile(match) if match else None
    count: collections.Counter = collections.Counter()
    out = []
    for c in cases_for(ops):
        if rx is not None and not rx.search(c.label):
            continue
        if per_op and count[c.op] >= per_op:
            continue
        count[c.op] += 1
        out.append(c)
    if shard is not None:
        out = out[shard[0]::shard[1]]
    return out


def run_conformance(backend: Any, cases: list[Any], deadline: float | None, quiet: bool
                    ) -> dict[str, Any]:
    """Each case on `backend` (a line per case unless quiet); cases left when `deadline`
    (time.perf_counter()) passes are counted as not run."""
    summary = Summary("cuda")
    not_run = 0
    for case in cases:
        if deadline is not None and time.perf_counter() > deadline:
            not_run += 1
            continue
        try:
            r = run_case(case, backend)
        except Exception as e:  # report and go on: one broken kernel must not hide the rest
            r = Result(case, "FAIL", float("nan"), f"{type(e).__name__}: {e}"[:300])
        summary.results.append(r)
        if not quiet:
            print(r.line(), flush=True)
    return {**summary.to_json(), "failed": summary.failed, "not_run": not_run}


def conformance_line(c: dict[str, Any], seconds: float) -> str:
    more = f", {c['not_run']} cases not run (time budget)" if c.get("not_run") else ""
    jobs = f" in {c['jobs']} processes" if c.get("jobs", 1) > 1 else ""
    return (f"conformance: {c['passed']}/{c['tested']} tests passed ({seconds:.1f}s{jobs})"
            f"{more}")


# -- PTX-only -------------------------------------------------------------------------------------

def ptx_rows(cc: tuple[int, int]) -> list[Any]:
    """The PTX gate's verdict (backends/cuda/ptx.py) on every kernel variant compiled so far."""
    from ggraph.backends.cuda import ptx as P, runtime as R

    ptxas = P.find_ptxas()
    return [P.judge(v.kernel, str(v.signature), v.threads, v.ptx, v.error, ptxas, cc)
            for v in sorted(R.ptx_results(), key=lambda v: (v.kernel, str(v.signature)))]


# -- main -----------------------------------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu-check", help="check and measure the CUDA backend on a GPU, or "
                       "compile every kernel to PTX and judge it without one (--ptx)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        _sections(args)
    except ValueError as e:
        ap.error(str(e))
    from ggraph.backends import BackendUnavailableError

    try:
        return run(args)
    except BackendUnavailableError as e:  # no GPU or driver: one line, as `ggraph` says it
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON (after every "
                    "section, so a run cut short keeps what it did)")
    ap.add_argument("--tiny", action="store_true", help="simulator-sized: the first case of "
                    "each op, tiny perf shapes, a 1-layer decode model")
    ap.add_argument("--ops", default="", help="comma-separated ops to check (default: all)")
    ap.add_argument("--per-op", type=int, default=None, metavar="N", help="the first N cases "
                    "of each op (default all; 1 with --tiny and no --ops)")
    ap.add_argument("--match", default="", metavar="REGEX",
                    help="only the cases whose label this regular expression finds")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"sections to run (default all: {','.join(SECTIONS)})")
    for s in ("perf", "graphs", "decode", "sanitizer"):
        ap.add_argument(f"--no-{s}", action="store_true", help=f"skip the {s} section")
    ap.add_argument("--jobs", type=int, default=None, help="conformance processes (default: "
                    "on a GPU half the CPU cores, at most 8; 1 elsewhere)")
    ap.add_argument("--shard", default="", help=argparse.SUPPRESS)  # "i/n": a --jobs child
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="time for the whole run on a GPU (default 450; 0: no limit); no "
                    "limit in the simulator")
    ap.add_argument("--decode-type", default="q8_0", choices=("q8_0", "q4_1"),
                    help="weight type of the decode model (default q8_0)")
    ap.add_argument("--ptx", action="store_true", help="no GPU: compile every kernel to PTX")
    ap.add_argument("--cc", default="90", help="compute capability for --ptx (default 90)")
    ap.add_argument("--min-seconds", type=float, default=1.0, help="time per perf case")


def _sections(args: argparse.Namespace) -> list[str]:
    want = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in want if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown section {bad[0]!r}; sections: {', '.join(SECTIONS)}")
    drop = {s for s in SECTIONS if getattr(args, f"no_{s}", False)}
    if args.ptx:  # compiling only: nothing runs, so nothing to time or sanitize
        drop |= {"perf", "launch", "decode", "sanitizer"}
    return [s for s in SECTIONS if s in want and s not in drop]


def _child_args(args: argparse.Namespace) -> list[str]:
    """The options a conformance child shares with this run."""
    out = ["--sections", "conformance", "--jobs", "1"]
    if args.tiny:
        out.append("--tiny")
    for flag, v in (("--ops", args.ops), ("--match", args.match),
                    ("--per-op", "" if args.per_op is None else str(args.per_op))):
        if v:
            out += [flag, v]
    return out


def run(args: argparse.Namespace) -> int:
    from ggraph.backends.cuda import runtime as R
    cc = (int(args.cc[:-1]), int(args.cc[-1]))
    if args.ptx:
        R.enable_ptx_check(cc)
    if R.SIM:
        sys.setswitchinterval(5e-4)  # simulated threads wait on each other; switch sooner
    from ggraph.backends.cuda import CUDABackend
    from ggraph.tools.gpu import gpu_child as C, gpu_decode as D, gpu_perf as P
    t_start = time.perf_counter()
    sections = _sections(args)
    on_gpu = R.MODE == "device"
    shard = tuple(int(x) for x in args.shard.split("/")) if args.shard else None
    budget = args.budget if args.budget is not None else 450.0 if on_gpu else 0.0
    clock = Clock(budget, [s for s in sections if s != "conformance"])
    backend = CUDABackend()
    report: dict[str, Any] = {"device": backend.device_name, "mode": R.MODE,
                              "geometry": geometry(), "sections": sections, "budget_s": budget,
                              "skipped": {}, "seconds": {}}
    print(f"GPU: {backend.device_name} (mode {R.MODE})", flush=True)
    from ggraph.backends.cuda import tc_gemm, templates_mm as KM

    torch_ = tc_gemm.torch_cuda()
    report["prompt_gemm"] = (f"torch {torch_.__version__} (cuBLAS, tensor cores; "
                             f"backends/cuda/tc_gemm.py)" if torch_ is not None
                             else "tiled kernel (torch with CUDA not in use)")
    if shard is None:
        print(geometry_line(report["geometry"]), flush=True)
        print(f"products of more than {KM.MV_NMAX} columns: {report['prompt_gemm']}", flush=True)
    checks = failed = 0

    def save() -> None:
        if args.json:
            report["checks"], report["failed"] = checks, failed
            report["seconds"]["total"] = time.perf_counter() - t_start
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    def skip(name: str, why: str) -> None:
        report["skipped"][name] = why
        report[name] = {"skipped": why}
        print(f"{name}: skipped ({why})", flush=True)

    ops = [OpKind[o.strip().upper()] for o in args.ops.split(",") if o.strip()] or None
    per_op = args.per_op if args.per_op is not None else 1 if args.tiny and ops is None else 0
    kept = track_uploads(backend)
    child_inputs: dict[str, Any] | None = None
    if "conformance" in sections:
        t0 = time.perf_counter()
        jobs = args.jobs if args.jobs is not None else \
            max(1, min(8, (os.cpu_count() or 2) // 2)) if on_gpu else 1
        if jobs > 1 and shard is None and not args.ptx:
            # kernels compile in every child at once and land in numba's disk cache
            deadline = clock.conformance_deadline()
            left = max(1.0, deadline - time.perf_counter()) if deadline is not None else 0.0
            print(f"conformance: in {jobs} processes (their lines come when all end)",
                  flush=True)
            # each child stops starting cases when its budget is spent (0: never); the
            # timeout is for a child that hangs
            runs = C.run_shards(jobs, _child_args(args) + ["--budget", f"{left:.0f}"],
                                left + 90 if deadline is not None else 7200)
            conf, child_inputs, lines = C.merge_shards(runs)
            print("\n".join(lines), flush=True)
        else:
            conf = run_conformance(backend, select_cases(ops, per_op, args.match, shard),
                                   clock.conformance_deadline(), quiet=args.ptx)
        report["conformance"] = conf
        report["seconds"]["conformance"] = time.perf_counter() - t0
        checks += conf["tested"]
        failed += conf["failed"]
        if not args.ptx:
            print(conformance_line(conf, report["seconds"]["conformance"]), flush=True)
        save()

    graph_rows = []
    if "graphs" in sections:
        why = clock.skip_reason("graphs")
        if why:
            skip("graphs", why)
        else:
            t0 = time.perf_counter()
            for gc in attention_cases(tiny=args.tiny or args.ptx):
                if args.tiny and gc[0] not in TINY_GRAPHS:
                    continue
                try:
                    res = run_graph_case(gc, backend)
                    ok, err, why = res.ok, res.nmse, res.detail
                except Exception as e:
                    ok, err, why = False, float("nan"), f"{type(e).__name__}: {e}"[:300]
                graph_rows.append({"graph": gc[0], "status": "OK" if ok else "FAIL",
                                   "nmse": err, "detail": why})
                if not args.ptx:
                    print(f"  {gc[0]}: {'OK' if ok else 'FAIL'} (nmse={err:.2e}) {why}",
                          flush=True)
            report["graphs"] = graph_rows
            report["seconds"]["graphs"] = time.perf_counter() - t0
            checks += len(graph_rows)
            failed += sum(r["status"] != "OK" for r in graph_rows)

    # stop keeping uploads alive: perf's are large
    backend.buffers.upload_observers.remove(kept.append)
    if not args.ptx and ("conformance" in sections or "graphs" in sections):
        inputs = check_device_inputs(backend, kept)
        if child_inputs is not None:
            for k in ("checked", "bytes"):
                inputs[k] += child_inputs[k]
            inputs["mismatches"] += child_inputs["mismatches"]
            inputs["status"] = "FAIL" if inputs["mismatches"] else "OK"
        kept.clear()
        report["inputs"] = inputs
        print("\n".join(inputs_lines(inputs)), flush=True)
        checks += 1
        failed += inputs["status"] != "OK"
    save()

    if "perf" in sections:
        why = clock.skip_reason("perf")
        if why:
            skip("perf", why)
        else:
            t0 = time.perf_counter()
            d = P.perf_section(backend, R.MODE, args.tiny, args.min_seconds)
            report.update(d)
            if "skipped" in d["torch"]:
                report["skipped"]["torch"] = d["torch"]["skipped"]
            checks += len(d["perf"])
            failed += sum("error" in r for r in d["perf"])
            report["seconds"]["perf"] = time.perf_counter() - t0
        save()

    for name, fn, lines in (
            ("launch", lambda: P.launch_overhead(backend, args.tiny), P.launch_lines),
            ("decode", lambda: D.decode_speed(backend, args.tiny, args.decode_type),
             D.decode_lines)):
        if name not in sections:
            continue
        why = clock.skip_reason(name)
        if why:
            skip(name, why)
            continue
        t0 = time.perf_counter()
        try:
            d = fn()
            print(f"{name}:\n" + "\n".join(lines(d)), flush=True)
            bad = [r for r in d.get("rows", []) if "error" in r or not r.get("logits_finite")]
            checks += max(1, len(d.get("rows", [])))
            failed += len(bad)
        except Exception as e:  # report and go on to the next section
            d = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name}: ERROR {d['error']}", flush=True)
            checks += 1
            failed += 1
        report[name] = d
        report["seconds"][name] = time.perf_counter() - t0
        save()

    if "sanitizer" in sections:
        exe = C.find_sanitizer()
        why = (f"not on a GPU (mode {R.MODE})" if not on_gpu else
               "compute-sanitizer not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin"
               if exe is None else clock.skip_reason("sanitizer"))
        if why:
            skip("sanitizer", why)
        else:
            t0 = time.perf_counter()
            report["sanitizer"] = {"exe": exe}
            for tool, r in C.sanitizer_runs(exe, clock.left, ["--tiny"] if args.tiny else []):
                report["sanitizer"][tool] = r
                print(C.sanitizer_line(tool, r), flush=True)
                checks += "status" in r
                failed += r.get("status") == "FAIL"
            report["seconds"]["sanitizer"] = time.perf_counter() - t0

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
        skipped = f"; skipped: {', '.join(report['skipped'])}" if report["skipped"] else ""
        print(f"summary: {checks - failed}/{checks} checks passed on {backend.device_name} "
              f"({time.perf_counter() - t_start:.0f} s{skipped})", flush=True)
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
