"""CUDA launches per decode token, counted without a GPU, and the host's own cost per token.

Runs a model's decode step on the CUDA backend in the PTX-only mode with every launch counted
instead of compiled (no driver, no toolkit needed): launches per token by op (a fused group
counts once, under its first node's op), and the host-side seconds per token of ggraph's own
work (feeding inputs, replaying the bound launches with numba's dispatch stubbed out). numba's
dispatch per launch on a real GPU (15-35 us, issue 18) comes on top: the launch count times
that is the ceiling on decode speed before any GPU work.

    python benchmarks/cuda_launches.py --json benchmarks/results/cuda_launches.json
    python benchmarks/cuda_launches.py -m gemma3

Each model runs four ways: fusion (backends/cuda/fusion.py) off and on, with K*Q, softmax, V
attention and with flash attention.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import Column, git_commit, model_option, out_option, print_table, write_results


def count(model: str, n_ctx: int, steps: int, flash: bool = False, fuse: bool = True) -> dict:
    from ggraph.backends.cuda import runtime as R

    if R.MODE != "ptx":
        R.enable_ptx_check()
    from ggraph.backends.cuda import fusion, kernels

    kernels.PTX_ALL_PATHS = False  # the launches of the path a GPU takes, not all of them
    fusion.ENABLED = fuse
    made: collections.Counter = collections.Counter()
    bound = R.bound

    def counting_bound(kernel, grid, block, *args):
        call = bound(kernel, grid, block, *args)
        if call is None:
            return None
        name = kernel.py_func.__name__
        made[name] += 1  # launches bound per graph, by kernel

        def run():
            ran[0] += 1
        return run

    ran = [0]
    R.bound = counting_bound  # restored below: counts of one configuration at a time
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import resolve_model

    eng = Engine(resolve_model(model), EngineConfig(backend="cuda", n_ctx=n_ctx, n_ubatch=32,
                                                    reserve_outputs="last", flash_attn=flash))
    eng.eval([1, 2, 3, 4])
    made.clear()
    eng.eval([5])           # binds the decode graph
    per_graph = dict(made)
    ran[0] = 0
    t0 = time.perf_counter()
    for i in range(steps):
        eng.eval([6 + i])
    dt = (time.perf_counter() - t0) / steps
    R.bound = bound
    return {"model": model, "flash_attn": flash, "fused": fuse, "launches_per_token": ran[0] / steps,
            "host_ms_per_token": dt * 1e3, "by_kernel": dict(sorted(per_graph.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[model_option("default"), out_option("")])
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("-n", "--steps", type=int, default=20)
    args = ap.parse_args()
    rows = [count(args.model.spec, args.ctx, args.steps, fa, fuse)
            for fa in (False, True) for fuse in (False, True)]
    print(f"{args.model.spec}: CUDA launches per decode token (context {args.ctx}), counted in "
          f"the PTX-only mode; host ms: ggraph's own work per token, numba's dispatch not "
          f"included")
    kernels = sorted({k for r in rows for k in r["by_kernel"]})
    print_table(rows, [
        Column(lambda r: "flash" if r["flash_attn"] else "K*Q, softmax, V", "attention",
               align="<"),
        Column(lambda r: "on" if r["fused"] else "off", "fusion", align="<"),
        Column("launches_per_token", "launches", "{:.0f}"),
        Column("host_ms_per_token", "host ms", "{:.2f}"),
        *(Column(lambda r, k=k: r["by_kernel"].get(k, 0), k) for k in kernels)], markdown=True)
    if args.out:
        write_results(args.out, rows, args=args, extra={
            "commit": git_commit()[0], "cpu": platform.processor() or platform.machine(),
            "context": args.ctx})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
