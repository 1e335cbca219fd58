"""`ggraph run -np N` (tools/run.py): N sequences generated together, as llama-parallel runs
its clients: the prompts are the lines of -f (N at a time) or N copies of -p, each copy
sampled with its own seed (seed + i when --seed is given); the texts are printed when a wave
is done, each with its prompt, its counts and why it stopped, then llama_perf's lines."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from ggraph.tools.common.cli_text import argv_text, process_escapes


def prompts_of(args: Any) -> list[str]:
    """-f: its non-empty lines (escapes processed as -p's are); else -p, N times."""
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as f:
            lines = [ln.rstrip("\n") for ln in f]
        texts = [ln for ln in lines if ln.strip()]
        if not texts:
            raise ValueError(f"{args.file}: no prompts (one per line)")
    else:
        text = argv_text(args.prompt if args.prompt is not None else "The capital of France is")
        texts = [text] * args.parallel
    return [process_escapes(t) if args.escape else t for t in texts]


def run_parallel(args: Any, cfg: Any, sampling: Any, path: str) -> int:
    from ggraph.graphs.runtime.engine import Engine
    from ggraph.graphs.runtime.parallel import generate_parallel
    from ggraph.graphs.runtime.sampling import LLAMA_DEFAULT_SEED, Sampler
    from ggraph.tools.common.run_loop import prompt_ids

    texts = prompts_of(args)
    t0 = time.perf_counter()
    eng = Engine(path, cfg)
    load_s = time.perf_counter() - t0
    ids = [prompt_ids(eng, path, t, t) for t in texts]   # every prompt checked first
    for line in eng.load_notes() + eng.memory_lines():
        print(line, file=sys.stderr)
    n_predict = args.n_predict if args.n_predict > 0 else eng.cfg.n_ctx
    total_gen = total_s = 0.0
    for w in range(0, len(ids), args.parallel):
        wave = ids[w:w + args.parallel]
        # llama.cpp's chain per sequence (--temp 0: greedy after it); a given seed S gives
        # sequence i the seed S + i, the random one a random seed each
        samplers = [Sampler(sampling if sampling.seed == LLAMA_DEFAULT_SEED else
                            dataclasses.replace(sampling, seed=(sampling.seed + i) %
                                                LLAMA_DEFAULT_SEED), eng.tokenizer)
                    for i in range(len(wave))]
        t1 = time.perf_counter()
        results = generate_parallel(eng, wave, n_predict, samplers)
        total_s += time.perf_counter() - t1
        for i, r in enumerate(results):
            total_gen += len(r.tokens)
            shown = [t for t in r.tokens if t not in eng.eog]
            print(f"Sequence {w + i} (prompt {len(r.prompt)} tokens, {len(r.tokens)} "
                  f"generated, stop: {r.stop}):")
            print(texts[w + i] + eng.tokenizer.decode(shown), flush=True)
            print(flush=True)
    print(f"llama_perf_context_print:        load time = {load_s * 1e3:10.2f} ms",
          file=sys.stderr)
    rate = total_gen / total_s if total_s else 0.0
    print(f"parallel: {len(ids)} sequences, {args.parallel} at a time, {int(total_gen)} tokens "
          f"generated in {total_s:.2f} s ({rate:.2f} tokens per second, prompts included)",
          file=sys.stderr)
    return 0
