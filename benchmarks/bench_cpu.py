"""CPU backend benchmark: every figure beside its peer, measured in the same run.

- machine peak (an FMA loop in numba) and memory-copy bandwidth (numpy copy);
- F32 mul_mat 2048^3 through a ggraph graph against numpy's matmul on the same arrays;
- quantized mat-vec (GB/s of weights read, against the copy bandwidth) and 512-column mat-mat
  (GFLOPS, against dequantize-then-BLAS) for SmolLM2's shapes, Q4_1 and Q8_0;
- attention at n_kv 4096, 9 heads of 64, 512 and 1 tokens: flash_attn_ext and
  mul_mat + soft_max + mul_mat against torch's scaled_dot_product_attention (CPU);
- per-node dispatch overhead of a 1,000-node graph of tiny ops;
- first-run compile time of all kernels (cold numba cache) and the cached second run.

    python benchmarks/bench_cpu.py [--threads 2] [--json benchmarks/results/cpu.json] [--quick]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numba
import numpy as np

from ggraph import Context, build_graph, ops as O

from ggraph.codecs import quants
from ggraph.backends import get_backend
from ggraph.ir.types import GGMLType as T

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import Column, out_option, print_table, results_path, threads_option, write_results


def best_of(fn, min_s: float = 0.4, max_reps: int = 200) -> float:
    fn()  # warm-up (compiles)
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@numba.njit(fastmath=True, parallel=True, cache=True)
def _fma_loop(x, reps):
    n_threads = x.shape[0]
    for t in numba.prange(n_threads):
        acc = x[t]
        for _ in range(reps):
            for j in range(acc.shape[0]):
                acc[j] = acc[j] * np.float32(0.999999) + np.float32(1e-7)
    return x


def peak_gflops(threads: int) -> float:
    x = np.ones((threads, 128), np.float32)
    reps = 200_000
    dt = best_of(lambda: _fma_loop(x, reps), 0.5, 5)
    return 2.0 * x.size * reps / dt / 1e9


def copy_gbs() -> float:
    a = np.ones(1 << 28, np.uint8)
    b = np.empty_like(a)
    dt = best_of(lambda: np.copyto(b, a), 0.5, 10)
    return a.nbytes / dt / 1e9  # bytes read per second (as much again is written)


class GraphRun:
    """One graph on the CPU backend; call it to run (inputs already in place)."""

    def __init__(self, out, inputs):
        self.g = build_graph(out)
        self.s = get_backend("cpu").session()
        self.s.run(self.g, inputs)
        self.out = out

    def __call__(self):
        for c in self.s.bound_calls:
            c()


def bench_f32_matmul(rows: list, n: int = 2048) -> None:
    rng = np.random.default_rng(0)
    ctx = Context()
    a = ctx.new_tensor(T.F32, (n, n), "a").set_data(rng.standard_normal((n, n)))
    b = ctx.new_tensor(T.F32, (n, n), "b").set_input()
    bv = rng.standard_normal((n, n)).astype(np.float32)
    run = GraphRun(O.mul_mat(a, b), {b: bv})
    A = a.data.view(np.float32).reshape(n, n)
    out = np.empty((n, n), np.float32)
    flops = 2.0 * n ** 3
    g = flops / best_of(run) / 1e9
    ref = flops / best_of(lambda: np.matmul(bv, A.T, out=out)) / 1e9
    rows.append(dict(bench="mul_mat f32", shape=f"{n}x{n}x{n}", ggraph=f"{g:.1f} GFLOPS",
                     peer=f"{ref:.1f} GFLOPS (numpy BLAS)", ratio=g / ref, target=">= 0.8"))


def bench_quant(rows: list, copy_bw: float, quick: bool) -> None:
    rng = np.random.default_rng(1)
    shapes = [(576, 1536), (1536, 576), (576, 49152)]
    for t in (T.Q4_1, T.Q8_0):
        for k, m in shapes:
            ctx = Context()
            w = ctx.new_tensor(t, (k, m), "w").set_data(rng.uniform(-1, 1, (m, k)))
            for n in (1, 512):
                if quick and n == 512 and m == 49152:
                    continue
                x = ctx.new_tensor(T.F32, (k, n), "x").set_input()
                xv = rng.uniform(-1, 1, (n, k)).astype(np.float32)
                run = GraphRun(O.mul_mat(w, x), {x: xv})
                dt = best_of(run)
                if n == 1:
                    gbs = w.nbytes / dt / 1e9
                    rows.append(dict(bench=f"mat-vec {t}", shape=f"{k}x{m}",
                                     ggraph=f"{gbs:.2f} GB/s ({dt * 1e3:.2f} ms)",
                                     peer=f"{copy_bw:.2f} GB/s (memory copy)",
                                     ratio=gbs / copy_bw, target=">= 0.5"))
                else:
                    raw = w.data.reshape(m, -1)
                    out = np.empty((n, m), np.float32)

                    def deq_blas():
                        np.matmul(xv, quants.dequantize(t, raw, k).T, out=out)

                    flops = 2.0 * k * m * n
                    g, ref = flops / dt / 1e9, flops / best_of(deq_blas) / 1e9
                    rows.append(dict(bench=f"mat-mat {t}", shape=f"{k}x{m}x{n}",
                                     ggraph=f"{g:.1f} GFLOPS",
                                     peer=f"{ref:.1f} GFLOPS (dequantize + BLAS)",
                                     ratio=g / ref, target=">= 0.7"))


def bench_attention(rows: list, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    rng = np.random.default_rng(2)
    hd, H, nkv = 64, 9, 4096
    for T_ in (512, 1):
        ctx = Context()
        q = ctx.new_tensor(T.F32, (hd, T_, H), "q").set_input()
        k = ctx.new_tensor(T.F16, (hd, nkv, H), "k").set_input()
        v = ctx.new_tensor(T.F16, (hd, nkv, H), "v").set_input()
        vt = ctx.new_tensor(T.F16, (nkv, hd, H), "vt").set_input()
        mask = ctx.new_tensor(T.F16, (nkv, T_), "mask").set_input()
        qv = rng.uniform(-1, 1, q.shape).astype(np.float32)
        kv = rng.uniform(-1, 1, k.shape).astype(np.float16)
        vv = rng.uniform(-1, 1, v.shape).astype(np.float16)
        # causal: token t sees the nkv - T_ cached cells and itself
        mv = np.where(np.arange(nkv)[None, :] > nkv - T_ + np.arange(T_)[:, None], -np.inf, 0)
        ins = {q: qv, k: kv, v: vv, vt: np.swapaxes(vv, 1, 2), mask: mv}
        scale = hd ** -0.5
        fa = GraphRun(O.flash_attn_ext(q, k, v, mask, scale), ins)
        kq = O.soft_max_ext(O.mul_mat(k, q), mask, scale)
        mm = GraphRun(O.mul_mat(vt, kq), ins)
        Q = torch.from_numpy(qv)
        K = torch.from_numpy(kv.astype(np.float32))
        V = torch.from_numpy(vv.astype(np.float32))
        M = torch.from_numpy(mv.astype(np.float32))
        sdpa = best_of(lambda: torch.nn.functional.scaled_dot_product_attention(
            Q, K, V, attn_mask=M, scale=scale))
        for name, run in (("flash_attn_ext", fa), ("mul_mat+soft_max+mul_mat", mm)):
            dt = best_of(run)
            rows.append(dict(bench=f"attention {name}", shape=f"n_kv {nkv}, {H}x{hd}, T={T_}",
                             ggraph=f"{dt * 1e3:.2f} ms", peer=f"{sdpa * 1e3:.2f} ms (torch sdpa)",
                             ratio=sdpa / dt, target="(speed vs torch)"))


def bench_dispatch(rows: list, n_nodes: int = 1000) -> None:
    ctx = Context()
    x = ctx.new_tensor(T.F32, (32,), "x").set_input()
    cur = x
    for i in range(n_nodes):
        cur = O.scale(cur, 1.0001) if i % 2 else O.add(cur, x)
    run = GraphRun(cur, {x: np.ones(32, np.float32)})
    dt = best_of(run)
    rows.append(dict(bench="dispatch", shape=f"{n_nodes} tiny nodes",
                     ggraph=f"{dt / n_nodes * 1e6:.2f} us/node", peer="-", ratio=None,
                     target="(lower is better)"))


def bench_compile(rows: list) -> None:
    code = ("import time; t=time.time(); from ggraph.check.conformance import cases_for, run_case; "
            "from ggraph.backends.cpu import CPUBackend; b=CPUBackend(); "
            "[run_case(c, b) for c in cases_for()]; print(time.time()-t)")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        cold = float(subprocess.check_output([sys.executable, "-c", code], env=env))
        warm = float(subprocess.check_output([sys.executable, "-c", code], env=env))
    rows.append(dict(bench="compile all kernels", shape="every conformance case",
                     ggraph=f"{cold:.1f} s cold", peer=f"{warm:.1f} s with the cache",
                     ratio=None, target="(second run uses the cache)"))


COLUMNS = [Column("bench", align="<"), Column("shape", align="<"), Column("ggraph", align="<"),
           Column("peer", align="<"), Column("ratio", fmt="{:.2f}x", width=6, missing=""),
           Column("target", align="<")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        threads_option(os.cpu_count()), out_option(results_path("cpu.json"))])
    ap.add_argument("--quick", action="store_true", help="skip the slowest cases")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-time run")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rows: list[dict] = []
    peak, bw = peak_gflops(args.threads), copy_gbs()
    rows.append(dict(bench="machine peak", shape=f"{args.threads} threads FMA",
                     ggraph=f"{peak:.1f} GFLOPS", peer="-", ratio=None, target="-"))
    rows.append(dict(bench="memory copy", shape="256 MiB", ggraph=f"{bw:.2f} GB/s read",
                     peer="-", ratio=None, target="-"))
    bench_f32_matmul(rows)
    # the measured peak: the better of a vector FMA loop and the best BLAS sgemm seen
    blas = float(rows[-1]["peer"].split()[0])
    peak = max(peak, blas)
    rows[0]["ggraph"] = f"{peak:.1f} GFLOPS"
    rows[0]["shape"] = f"{args.threads} threads, best of FMA loop and sgemm"
    rows[-1]["of_peak"] = float(rows[-1]["ggraph"].split()[0]) / peak
    rows[-1]["target"] += f"; {rows[-1]['of_peak']:.0%} of the measured peak"
    bench_quant(rows, bw, args.quick)
    bench_attention(rows, args.threads)
    bench_dispatch(rows)
    if not args.no_compile:
        bench_compile(rows)
    print_table(rows, COLUMNS, sep="  ", header=False)
    write_results(args.out, rows, args=args, extra=dict(
        machine=platform.processor() or platform.machine(), threads=args.threads))



if __name__ == "__main__":
    main()
