"""Decode speed of SmolLM2-135M on the CPU backend after a 512-token prompt (the tg64 of
compare_llama_cpp.py, n_kv 768), and per-op time of one decode graph.

    python benchmarks/bench_cpu_decode.py [--threads 2] [--n-gen 64] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import repeat_option, threads_option


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 parents=[threads_option(2), repeat_option(3)])
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import numba
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import default_model

    numba.set_num_threads(args.threads)
    eng = Engine(str(default_model()), EngineConfig(n_ctx=2048, n_ubatch=512,
                                                     n_threads=args.threads))
    rng = np.random.default_rng(0)
    pp = [int(x) for x in rng.integers(100, 40000, 512)]
    eng.eval(pp)
    for i in range(4):
        eng.eval([1 + i])
    for _ in range(args.repeat):
        eng.reset()
        eng.eval(pp)
        t0 = time.perf_counter()
        tok = 0
        for _ in range(args.n_gen):
            tok = int(np.argmax(eng.eval([tok])))
        dt = time.perf_counter() - t0
        print(f"tg{args.n_gen}: {args.n_gen / dt:.1f} tok/s ({dt / args.n_gen * 1e3:.2f} ms/token)")
    if args.profile:
        s = eng.session
        tot = defaultdict(float)
        cnt = defaultdict(int)

        def key(group):
            n = group[-1]   # the node a (fused) call produces
            return (str(n.op), n.name.split("-")[0],
                    "x".join(str(x) for x in n.src[0].ne[:3]) if n.src else "",
                    str(n.src[0].type) if n.src else "")

        class Timer:
            """What Session.run asks of a profile: run the calls, timing each by its key."""

            def time_calls(self, calls, groups, sync=None):
                for call, group in zip(calls, groups):
                    t0 = time.perf_counter()
                    call()
                    if sync is not None:
                        sync()
                    tot[key(group)] += time.perf_counter() - t0
                    cnt[key(group)] += 1

        reps = 20
        s.profile = Timer()
        t0 = time.perf_counter()
        for _ in range(reps):
            tok = int(np.argmax(eng.eval([tok])))
        wall = (time.perf_counter() - t0) / reps
        s.profile = None
        all_t = sum(tot.values()) / reps
        print(f"decode: {wall * 1e3:.2f} ms/token, kernels {all_t * 1e3:.2f} ms")
        for k, t in sorted(tot.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {t / reps * 1e3:7.2f} ms  {cnt[k] // reps:4d} calls "
                  f"{t / cnt[k] * 1e6:8.1f} us/call  {' '.join(k)}")

if __name__ == "__main__":
    main()
