"""Prompt throughput over Ray stages with and without pipelining (backends/ray_stages.py).

SmolLM2 split over two stage actors of a local Ray cluster (one thread each), a prompt of
random tokens in ubatches: with pipelining, ubatch u+1 runs on stage 0 while ubatch u runs on
stage 1; without, every split is awaited before the next starts. The overlap is measured:
the stages' kernel seconds (each split reports its own) over the wall time of the prompt; 1.0
means the stages never ran at once, 2.0 two stages busy all the time. The same split in one
process (two CPU backends) and one backend alone are timed beside them.

    python benchmarks/ray_pipeline.py --json benchmarks/results/ray_pipeline.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ggraph.graphs.eval.bench import machine_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import Column, git_commit, out_option, print_table, repeat_option, write_results

COLUMNS = [Column("run", align="<"), Column("tokens_per_s", "prompt tokens/s", "{:.1f}"),
           Column(lambda r: (f"{r['stage_kernel_s']:.2f}" if "overlap" in r else "-")
                  + f" / {r['seconds']:.2f}", "stage kernel s / wall s"),
           Column("overlap", fmt="{:.2f}"),
           Column("decode_tokens_per_s", "decode tokens/s", "{:.1f}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[repeat_option(3, help="repetitions (median)"),
                                          out_option("")])
    ap.add_argument("-p", type=int, default=256, help="prompt tokens")
    ap.add_argument("-ub", type=int, default=32, help="ubatch size")
    ap.add_argument("-n", type=int, default=16, help="tokens generated (decode speed)")
    args = ap.parse_args()

    import ray

    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import default_model

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    path = str(default_model())
    cfg = dict(n_ctx=max(512, args.p), n_ubatch=args.ub, reserve_outputs="last", n_threads=1,
               adaptive_threads=False)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 40000, args.p)]
    runs = [("one backend", dict()),
            ("two CPU backends, one process", dict(devices="cpu,cpu", n_gpu_layers=31)),
            ("two Ray stages, awaited in turn", dict(devices="ray:cpu,ray:cpu", n_gpu_layers=31,
                                                     pipeline=False)),
            ("two Ray stages, pipelined", dict(devices="ray:cpu,ray:cpu", n_gpu_layers=31))]
    rows, ref = [], None
    for name, kw in runs:
        eng = Engine(path, EngineConfig(**cfg, **kw))
        eng.eval(prompt[:args.ub * 2], n_past=0)  # compile and ship the graphs: a prompt's
        eng.eval(prompt[:1])                      # and a decode step's
        walls, busy = [], []
        for _ in range(args.repeat):
            if hasattr(eng.runner, "stage_busy"):
                eng.runner.stage_busy()
            t0 = time.perf_counter()
            logits = eng.eval(prompt, n_past=0)
            walls.append(time.perf_counter() - t0)
            if hasattr(eng.runner, "stage_busy"):
                busy.append(eng.runner.stage_busy())
        wall = float(np.median(walls))
        eng.reset()
        t0 = time.perf_counter()
        toks = list(eng.generate(prompt[:8], args.n, stop_at_eos=False))
        gen_s = time.perf_counter() - t0
        row = {"run": name, "prompt_tokens": args.p, "ubatch": args.ub, "seconds": wall,
               "tokens_per_s": args.p / wall, "generated": toks,
               "decode_tokens_per_s": args.n / gen_s}
        if busy:
            row["stage_kernel_s"] = float(np.median(busy))
            row["overlap"] = row["stage_kernel_s"] / wall
        if "devices" in kw:
            ref = logits if ref is None else ref
            row["logits_equal_split_in_one_process"] = bool(np.array_equal(logits, ref))
        rows.append(row)
        if hasattr(eng.runner, "shutdown"):
            eng.runner.shutdown()
        print(f"{name}: prompt {row['tokens_per_s']:.1f} tok/s, decode "
              f"{row['decode_tokens_per_s']:.1f} tok/s"
              + (f", stages busy {row['stage_kernel_s']:.2f} s of {wall:.2f} s "
                 f"(overlap {row['overlap']:.2f})" if busy else ""), flush=True)
    cpu = machine_info().cpu
    print(f"\nSmolLM2-135M Q4_1, prompt {args.p} tokens, ubatch {args.ub}, one thread per "
          f"stage; CPU: {cpu}")
    print_table(rows, COLUMNS, markdown=True)
    same = len({tuple(r["generated"]) for r in rows}) == 1
    print(f"greedy tokens {'equal' if same else 'DIFFER'} across the runs")
    if args.out:
        write_results(args.out, rows, args=args, threads=1, extra={
            "commit": git_commit()[0], "cpu": cpu, "greedy_equal": same})
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
