"""SmolLM2 split across the CPU and the CUDA backend (numba's CUDA simulator, or a real GPU):
greedy tokens must equal the CPU alone's.

The simulator runs every CUDA thread as a Python thread: one SmolLM2 layer takes minutes per
token there, so this is a script (about half an hour with 2 layers on CUDA), not a CI test. CI
covers the same path on the tiny model (tests/backends/cuda/test_cuda_sim.py) and SmolLM2
across two CPU backends (tests/core/plan/test_sched.py).

    NUMBA_ENABLE_CUDASIM=1 python benchmarks/sched_smollm2_cudasim.py --ngl 2 -n 4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import out_option, results_path, write_results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[out_option(results_path("sched_smollm2_cudasim.json"))])
    ap.add_argument("--ngl", type=int, default=2, help="layers on the CUDA device")
    ap.add_argument("-n", type=int, default=4, help="tokens to generate")
    ap.add_argument("-p", default="The capital of France is")
    args = ap.parse_args()

    from ggraph.backends.cuda import runtime as R
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import default_model

    path = str(default_model())
    cfg = dict(n_ctx=256, n_ubatch=32, reserve_outputs="last")
    cpu = Engine(path, EngineConfig(**cfg))
    prompt = cpu.tokenizer.encode(args.p)
    t0 = time.perf_counter()
    ref = list(cpu.generate(prompt, args.n, stop_at_eos=False))
    t_cpu = time.perf_counter() - t0
    print(f"CPU alone: {ref} ({t_cpu:.1f} s)", flush=True)

    split = Engine(path, EngineConfig(devices="cuda", n_gpu_layers=args.ngl, **cfg))
    print("\n".join(split.memory_lines()), flush=True)
    got, t0 = [], time.perf_counter()
    for tok in split.generate(prompt, args.n, stop_at_eos=False):
        got.append(tok)
        print(f"  token {len(got)}: {tok} ({time.perf_counter() - t0:.0f} s)", flush=True)
    t_split = time.perf_counter() - t0
    same = got == ref
    print(f"CPU + {R.MODE} CUDA ({args.ngl} layers): {got}: "
          f"{'the same tokens' if same else 'DIFFERENT tokens'} ({t_split:.0f} s)")
    out = {"model": os.path.basename(path), "prompt": args.p, "prompt_tokens": prompt,
           "n_gpu_layers": args.ngl, "cuda_mode": R.MODE, "tokens_cpu": ref,
           "tokens_split": got, "equal": same, "seconds_cpu": t_cpu, "seconds_split": t_split,
           "memory": split.memory_lines()}
    write_results(args.out, args=args, extra=out)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
