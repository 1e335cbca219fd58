"""Speed sections of `ggraph gpu-check` (tools/gpu_check.py): ggraph's perf cases timed with
CUDA events and wall clock side by side, torch's matmul (F32, TF32, BF16) and
scaled_dot_product_attention at the same shapes in the same process, and the cost of one
kernel launch.

Events time the GPU from the first queued launch to the last; wall clock adds the host's
dispatch (numba's argument marshalling per launch, the Session's run), so the two side by side
show how much of a run is Python. The simulator has the event API but records no time
(elapsed_time answers -1.0): there `event_us` is None and the wall clock stands alone.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import numpy as np

from ggraph import Context, GGMLType as T, build_graph, ops as O
from ggraph.ir.tensor import Tensor

PerfCase = tuple[str, Callable[[Context, np.random.Generator], Tensor],
                 Callable[[Tensor], float], Callable[[Tensor], float]]


def shapes(tiny: bool) -> tuple[tuple[int, int, int], tuple[int, int, int, tuple[int, ...]]]:
    """((M, K, N) of mul_mat, (D, H, n_kv, T's) of flash attention) for the perf cases."""
    mm = (32, 32, 16) if tiny else (4096, 4096, 512)
    fa = (32, 2, 32, (1, 2)) if tiny else (128, 32, 32768, (1, 512))
    return mm, fa


def perf_cases(tiny: bool) -> list[PerfCase]:
    """(name, build, flops(out), bytes(out)) per perf case: F32 and Q4_1 mul_mat at M x K x N
    and mat-vec, flash attention with F16 K/V at T=1 and a prompt-sized T."""
    mm, fa = shapes(tiny)

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
    cases: list[PerfCase] = []
    for t in (T.F32, T.Q4_1):
        cases.append((f"mul_mat(type={t},m={m},k={k},n={n})", mul_mat(t, n), mm_flops, mm_bytes))
        cases.append((f"mul_mat(type={t},m={m},k={k},n=1)", mul_mat(t, 1), mm_flops, mm_bytes))
    for tq in fa[3]:
        cases.append((f"flash_attn_ext(kv=f16,d={fa[0]},h={fa[1]},n_kv={fa[2]},T={tq})",
                      flash(tq), fa_flops, fa_bytes))
    return cases


# -- timing -------------------------------------------------------------------------------------

def on_device(backend: Any) -> Any:
    """The backend's GPU made current (its stream, its memory) for work done outside its own
    methods; nothing for a backend without one."""
    dev = getattr(backend, "device", None)
    return dev.active() if hasattr(dev, "active") else contextlib.nullcontext()


def backend_stream(backend: Any) -> Any:
    """The stream the backend's launches queue on (0: the default stream)."""
    return getattr(getattr(backend, "device", None), "stream", None) or 0


class CudaEvent:
    """A numba CUDA event recorded on one stream (the backend's, so it lands right after its
    launches). The simulator's `cuda.event` is a class taking no arguments, and its
    elapsed_time always answers -1.0."""

    def __init__(self, stream: Any = 0) -> None:
        from numba import cuda

        try:
            self.e = cuda.event(timing=True)
        except TypeError:
            self.e = cuda.event()
        self.stream = stream

    def record(self) -> None:
        self.e.record(self.stream)

    def synchronize(self) -> None:
        self.e.synchronize()

    def elapsed_time(self, other: "CudaEvent") -> float:
        return self.e.elapsed_time(other.e)


class NoEvent:
    """An event that records nothing (timing on the CPU): elapsed_time answers -1.0, as the
    simulator's does, so the wall clock stands alone."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "NoEvent") -> float:
        return -1.0


def time_calls(run: Callable[[], None], sync: Callable[[], None], min_seconds: float,
               max_runs: int, event: Callable[[], Any] = CudaEvent) -> dict[str, Any]:
    """us per call of `run` by wall clock and by events (`event()` makes one; numba's on the
    default stream unless told) over one uninterrupted batch: nothing synchronizes inside it,
    so the GPU never idles while the host notices that it is done. A short calibration run
    sizes the batch to about min_seconds (at most max_runs)."""
    run()
    sync()  # the first call compiles and binds
    n_cal, t0 = 0, time.perf_counter()
    while n_cal < max_runs:
        run()
        n_cal += 1
        if time.perf_counter() - t0 >= min_seconds / 10:
            break
    sync()
    per = (time.perf_counter() - t0) / n_cal
    n = int(max(1, min(max_runs, min_seconds / max(per, 1e-7))))
    e0, e1 = event(), event()
    t0 = time.perf_counter()
    e0.record()
    for _ in range(n):
        run()
    e1.record()
    sync()
    wall = (time.perf_counter() - t0) / n
    e1.synchronize()
    ms = e0.elapsed_time(e1)
    return {"runs": n, "wall_us": wall * 1e6,
            "event_us": ms * 1e3 / n if ms is not None and ms >= 0 else None}


def time_node(backend: Any, out: Tensor, min_seconds: float, max_runs: int) -> float:
    """Seconds per run of out's graph by wall clock (kept for callers of the older script)."""
    graph = build_graph(out)
    session = backend.session()
    r = time_calls(lambda: session.run(graph), session.synchronize, min_seconds, max_runs,
                   lambda: CudaEvent(backend_stream(backend)))
    return r["wall_us"] / 1e6


def ggraph_perf(backend: Any, tiny: bool, min_seconds: float) -> list[dict[str, Any]]:
    """Every perf case: us per run by events and wall clock, GFLOPS and GB/s (from the events
    where they carry time), and the kernel launches one run makes."""
    rows = []
    for name, build, flops, nbytes in perf_cases(tiny):
        try:
            out = build(Context(name), np.random.default_rng(0))
            graph = build_graph(out)
            session = backend.session()
            r = time_calls(lambda: session.run(graph), session.synchronize,
                           0.0 if tiny else min_seconds, 1 if tiny else 2000,
                           lambda: CudaEvent(backend_stream(backend)))
            us = r["event_us"] if r["event_us"] is not None else r["wall_us"]
            row = {"case": name, "us": us, **r, "launches": len(session.bound_calls or ()),
                   "gflops": flops(out) / us / 1e3, "gbs": nbytes(out) / us / 1e3}
        except Exception as e:  # report and go on: one broken case must not hide the rest
            row = {"case": name, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
    return rows


# -- torch beside it ----------------------------------------------------------------------------

def torch_unavailable(mode: str) -> str | None:
    """Why torch cannot be timed beside ggraph here, in one line; None when it can."""
    if mode != "device":
        return f"not on a GPU (mode {mode})"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA"
    return None


def torch_peers(tiny: bool, min_seconds: float, device: str = "cuda") -> list[dict[str, Any]]:
    """torch at the perf cases' shapes: W (M x K) @ X (K x N) in F32, TF32 and BF16 for N and
    1, and scaled_dot_product_attention (F16, no mask: ggraph's case has an all-zero mask)
    with (1, H, T, D) queries over n_kv keys. CUDA events on a GPU; wall clock on the CPU
    (`device="cpu"`, for testing the shapes without one)."""
    import torch
    import torch.nn.functional as F

    mm, fa = shapes(tiny)
    m, k, n = mm
    d, h, nkv, ts = fa
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = device != "cpu"

    def rand(*shape: int, dtype: Any) -> Any:
        return torch.rand(*shape, generator=gen, device=device, dtype=torch.float32) \
            .mul_(2).sub_(1).to(dtype)

    class TorchEvent(NoEvent):  # torch's CUDA events in time_calls' shape
        def __init__(self) -> None:
            self.e = torch.cuda.Event(enable_timing=True)

        def record(self) -> None:
            self.e.record()

        def synchronize(self) -> None:
            self.e.synchronize()

        def elapsed_time(self, other: Any) -> float:
            return self.e.elapsed_time(other.e)

    def timed(fn: Callable[[], Any]) -> float:
        r = time_calls(fn, torch.cuda.synchronize if cuda else (lambda: None), min_seconds,
                       5000, TorchEvent if cuda else NoEvent)
        return r["event_us"] if r["event_us"] is not None else r["wall_us"]

    rows = []
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for cols in (n, 1):
            for label, dtype, tf32 in (("f32", torch.float32, False),
                                       ("tf32", torch.float32, True),
                                       ("bf16", torch.bfloat16, False)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                w, x = rand(m, k, dtype=dtype), rand(k, cols, dtype=dtype)
                us = timed(lambda: torch.matmul(w, x))
                rows.append({"peer": f"torch.matmul {label}", "shape": f"m={m},k={k},n={cols}",
                             "us": us, "gflops": 2.0 * m * k * cols / us / 1e3})
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
        for tq in ts:
            q, kk, vv = (rand(1, h, n_, d, dtype=torch.float16) for n_ in (tq, nkv, nkv))
            us = timed(lambda: F.scaled_dot_product_attention(q, kk, vv, scale=d ** -0.5))
            rows.append({"peer": "torch sdpa f16", "shape": f"d={d},h={h},n_kv={nkv},T={tq}",
                         "us": us, "gflops": 2.0 * tq * h * nkv * 2 * d / us / 1e3})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
        if cuda:
            torch.cuda.empty_cache()
    return rows


def peer_table(perf: list[dict[str, Any]], peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (ggraph case, torch peer at its shape): F32 mul_mat against torch's F32,
    TF32 and BF16; Q4_1 against BF16 (torch has no 4-bit matmul: the nearest dense peer);
    flash attention against SDPA. ratio = ggraph us / torch us (above 1: torch is faster)."""
    want = {"f32": ("f32", "tf32", "bf16"), "q4_1": ("bf16",)}
    rows = []
    for r in perf:
        if "error" in r:
            continue
        case = r["case"]
        if case.startswith("mul_mat"):
            t = case.split("type=")[1].split(",")[0]
            shape = case[case.index("m="):-1]
            match = [p for p in peers if p["shape"] == shape and
                     p["peer"].rsplit(" ", 1)[1] in want.get(t, ())]
        else:
            shape = case[case.index("d="):-1]
            match = [p for p in peers if p["shape"] == shape]
        for p in match:
            rows.append({"case": case, "ggraph_us": r["us"], "peer": p["peer"],
                         "torch_us": p["us"], "ratio": r["us"] / p["us"]})
    return rows


def perf_section(backend: Any, mode: str, tiny: bool, min_seconds: float) -> dict[str, Any]:
    """{"perf": ggraph's rows, "torch": its peers and the table beside ggraph, or why they
    were skipped}, each printed as it is done."""
    print("perf (CUDA events, and wall clock beside them: the difference is the host's "
          "dispatch):", flush=True)
    rows = ggraph_perf(backend, tiny, min_seconds)
    print("\n".join(perf_lines(rows)), flush=True)
    out: dict[str, Any] = {"perf": rows}
    why = torch_unavailable(mode)
    if why is None:
        import torch

        try:
            peers = torch_peers(tiny, min(min_seconds, 0.5))
            table = peer_table(rows, peers)
            print("torch beside ggraph (the same shapes in this process; ratio = ggraph us / "
                  "torch us):", flush=True)
            print("\n".join(peer_lines(table)), flush=True)
            out["torch"] = {"version": torch.__version__, "peers": peers, "table": table}
        except Exception as e:  # torch's trouble is not ggraph's failure: say it, go on
            why = f"{type(e).__name__}: {e}"[:300]
    if why is not None:
        out["torch"] = {"skipped": why}
        print(f"torch: skipped ({why})", flush=True)
    return out


# -- launch overhead ----------------------------------------------------------------------------

def _k_empty(a):  # noqa: ANN001 - a CUDA kernel: its body is the point (nothing)
    pass


def launch_overhead(backend: Any, tiny: bool) -> dict[str, Any]:
    """us per launch of an empty kernel: through numba's dispatcher (kernel[grid, block,
    stream](...): typing and marshalling every call), and replayed through the backend's bound
    launch (runtime.bound: what a Session replays per node, with the dispatcher's work kept
    after the first call on a GPU, backends/cuda/replay.py); then a whole Session.run of a
    one-node graph (its per-run cost on top; replayed as a CUDA graph from its third run where
    the backend does that). Wall clock is the host's cost; events the GPU's launch throughput
    while the host keeps it fed."""
    import importlib

    from ggraph.backends.cuda import runtime as R

    kernel = R.kernel_decorator()(_k_empty)
    n, secs = (20, 0.05) if tiny else (20000, 1.0)
    stream = backend_stream(backend)
    event = lambda: CudaEvent(stream)  # noqa: E731
    with on_device(backend):  # bound while the backend's GPU is current: its stream
        buf = R.alloc_bytes(256)
        plain = time_calls(lambda: kernel[1, 32, stream](buf), R.synchronize, secs, n, event)
        r = time_calls(R.bound(kernel, 1, 32, buf), R.synchronize, secs, n, event)
    ctx = Context("launch")
    x = ctx.new_tensor(T.F32, (32,), "x").set_data(np.ones(32, np.float32))
    graph = build_graph(O.scale(x, 2.0).set_output())
    session = backend.session()
    s = time_calls(lambda: session.run(graph), session.synchronize, secs, n // 4, event)
    try:
        rp = importlib.import_module("ggraph.backends.cuda.replay")
        modes = {"fast_launch": rp.FAST_LAUNCH, "cuda_graphs": rp.GRAPHS}
    except (ImportError, AttributeError):
        modes = {}
    return {"dispatcher": plain, "bound_launch": r, "session_run_1_node": s,
            "replay": {"mode": R.MODE, **modes}}


def launch_lines(d: dict[str, Any]) -> list[str]:
    """The launch section as printed."""
    out = []
    for key, what in (("dispatcher", "empty kernel, numba's dispatcher"),
                      ("bound_launch", "empty kernel, runtime.bound replay"),
                      ("session_run_1_node", "Session.run of a 1-node graph (scale)")):
        r = d[key]
        ev = (f"{r['event_us']:.1f} us by events" if r["event_us"] is not None
              else "no event timing (simulator)")
        out.append(f"  {what}: {r['wall_us']:.1f} us host (wall clock), {ev}, {r['runs']} runs")
    return out


# -- printing -----------------------------------------------------------------------------------

def perf_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The perf table: us by events and by wall clock, GFLOPS and GB/s, launches per run."""
    out = [f"  {'case':50s} {'events us':>10s} {'wall us':>10s} {'GFLOPS':>9s} {'GB/s':>8s} "
           f"{'launches':>8s}"]
    for r in rows:
        if "error" in r:
            out.append(f"  {r['case']}: ERROR {r['error']}")
            continue
        ev = f"{r['event_us']:10.1f}" if r["event_us"] is not None else f"{'-':>10s}"
        out.append(f"  {r['case']:50s} {ev} {r['wall_us']:10.1f} {r['gflops']:9.1f} "
                   f"{r['gbs']:8.1f} {r['launches']:8d}")
    if any(r.get("event_us", 0) is None for r in rows):
        out.append("  (events carry no time in the simulator: GFLOPS and GB/s by wall clock)")
    return out


def peer_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The table of ggraph beside torch: case, ggraph us, torch us, ratio."""
    out = [f"  {'case':50s} {'ggraph us':>10s}  {'torch peer':18s} {'torch us':>10s} "
           f"{'ratio':>7s}"]
    out += [f"  {r['case']:50s} {r['ggraph_us']:10.1f}  {r['peer']:18s} {r['torch_us']:10.1f} "
            f"{r['ratio']:7.2f}" for r in rows]
    return out
