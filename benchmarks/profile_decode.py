"""Where a model's time goes on the CPU (SmolLM2 unless -m names another): the per-op profile
(backends/profile.py) of a prompt ubatch and of decode tokens, beside the unprofiled speed of
the same runs.

    python benchmarks/profile_decode.py [--threads 2] [--prompt 128] [--gen 32] [--fa 1] [--by name]
                                        [--json out.json]

Every token runs at the -t thread count (no ThreadGovernor: its trials of fewer threads would
slow some tokens and every node with them). Kernels are compiled and bound by a warm-up pass
before anything is timed. Profiled runs read the clock around every kernel call, so their
tok/s is a little lower than the plain figure printed first.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import model_option, out_option, threads_option, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        model_option("default"), threads_option(2), out_option("")])
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens (one ubatch)")
    ap.add_argument("--gen", type=int, default=32, help="decode tokens to time")
    ap.add_argument("--by", choices=("op", "name", "both"), default="both")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--fa", type=int, choices=(0, 1), default=0, help="flash attention")
    args = ap.parse_args()

    from ggraph.backends.profile import Profile
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    path = str(args.model)
    eng = Engine(path, EngineConfig(n_ctx=1024, n_ubatch=512, n_threads=args.threads,
                                    flash_attn=bool(args.fa), reserve_outputs="last",
                                    adaptive_threads=False))   # every token at -t, as llama-bench
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 40000, args.prompt)]

    def decode(n: int) -> float:
        tok, t0 = 0, time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(eng.eval([tok])))
        return n / (time.perf_counter() - t0)

    def prefill() -> float:
        eng.reset()
        t0 = time.perf_counter()
        eng.eval(prompt)
        return len(prompt) / (time.perf_counter() - t0)

    prefill()          # compile and bind the prompt and decode graphs
    decode(4)
    pp, tg = prefill(), decode(args.gen)
    import numba
    print(f"{path}: threads {numba.get_num_threads()} ({numba.threading_layer()} layer); "
          f"plain: prompt {args.prompt} tokens {pp:.1f} tok/s, decode {tg:.2f} tok/s")

    out = {"model": path, "threads": args.threads, "pp_tok_s": pp, "tg_tok_s": tg}
    for what, run in (("prompt", prefill), ("decode", lambda: decode(args.gen))):
        prof = Profile()
        eng.reset() if what == "prompt" else None
        with prof.attach(eng.runner):
            speed = run()
        print(f"\n== {what}: {speed:.2f} tok/s profiled, {prof.runs} graph runs")
        for by in (("op", "name") if args.by == "both" else (args.by,)):
            print("\n".join(prof.table(by=by, top=args.top)))
            print()
        out[what] = dict(tok_s=speed, **prof.to_json())
    if args.out:
        write_results(args.out, args=args, extra=out)


if __name__ == "__main__":
    main()
