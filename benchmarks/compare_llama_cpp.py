"""SmolLM2-135M-Instruct Q4_1 in ggraph and in llama.cpp (llama-cpp-python, built from source),
same machine, same run: tokens, greedy continuations, per-position logits, and speed.

- tokenization of each prompt by both;
- the first 16 greedy tokens of each prompt (ggraph fed llama.cpp's prompt tokens);
- NMSE of ggraph's logits against llama.cpp's at every prompt position;
- prompt processing of 512 tokens and generation of 64 tokens, 2 threads each.

    pip install llama-cpp-python   # builds llama.cpp from source (minutes)
    python benchmarks/compare_llama_cpp.py [--threads 2] [-m MODEL] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ggraph.check.conformance import nmse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (import_llama_cpp, llama_cpp_model, model_option, out_option,
                    print_peer_speed, results_path, threads_option, write_results)

PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village,",
           "def fibonacci(n):",
           "The three primary colors are"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, parents=[
        threads_option(2), model_option("default"),
        out_option(None, help="default: benchmarks/results/llama_cpp.json "
                              "(llama_cpp_exact.json with --ggml-exact)")])
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--ggml-exact", action="store_true",
                    help="ggraph computes quantized mul_mat bit for bit as ggml's x86 CPU "
                         "(backends/cpu/ggml_exact.py)")
    args = ap.parse_args()
    if args.out is None:
        args.out = results_path("llama_cpp" + ("_exact" if args.ggml_exact else "") + ".json")
    if args.ggml_exact:   # the fusion pass rounds its norm chain as ggraph does, not as ggml;
        os.environ["GGRAPH_FUSE"] = "0"   # read when backends/cpu/fusion.py is imported below
    llama_cpp = import_llama_cpp()
    import numba

    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    numba.set_num_threads(args.threads)
    path = str(args.model)
    llm = llama_cpp_model(path, n_ctx=2048, n_batch=512, n_ubatch=512, threads=args.threads,
                          logits_all=True)
    eng = Engine(path, EngineConfig(n_ctx=2048, n_ubatch=512, n_threads=args.threads,
                                    ggml_exact=args.ggml_exact))
    out: dict = {"llama_cpp_version": llama_cpp.__version__, "threads": args.threads,
                 "ggml_exact": args.ggml_exact,
                 "prompts": []}
    for prompt in PROMPTS:
        toks_cpp = llm.tokenize(prompt.encode(), add_bos=False, special=False)
        toks_gg = eng.tokenizer.encode(prompt)
        llm.reset()
        llm.eval(toks_cpp)
        logits_cpp = np.array(llm.scores[: len(toks_cpp)])
        gen_cpp = []
        for _ in range(args.n_gen):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            gen_cpp.append(t)
            llm.eval([t])
        eng.reset()
        logits_gg = eng.eval(toks_cpp, all_logits=True)
        eng.reset()
        gen_gg = list(eng.generate(toks_cpp, args.n_gen, stop_at_eos=False))
        err = [nmse(a, b) for a, b in zip(logits_cpp, logits_gg)]
        n_equal = sum(bool(np.array_equal(a, b)) for a, b in zip(logits_cpp, logits_gg))
        same = sum(1 for a, b in zip(gen_cpp, gen_gg) if a == b)
        first_diff = next((i for i, (a, b) in enumerate(zip(gen_cpp, gen_gg)) if a != b), None)
        row = dict(prompt=prompt, tokens_equal=toks_cpp == toks_gg, tokens_llama_cpp=toks_cpp,
                   tokens_ggraph=toks_gg, greedy_equal=gen_cpp == gen_gg,
                   first_difference=first_diff, same_tokens=same,
                   text_llama_cpp=eng.tokenizer.decode(gen_cpp),
                   text_ggraph=eng.tokenizer.decode(gen_gg),
                   logits_nmse_max=max(err), logits_nmse_mean=float(np.mean(err)),
                   logits_nmse_per_position=[float(e) for e in err],
                   positions_bit_equal=n_equal)
        out["prompts"].append(row)
        print(f"{prompt!r}: tokens {'equal' if row['tokens_equal'] else 'DIFFER'}, greedy "
              f"{args.n_gen} {'equal' if row['greedy_equal'] else f'differ at {first_diff}'}, "
              f"logits NMSE max {max(err):.2e} mean {np.mean(err):.2e}, bit-equal positions "
              f"{n_equal}/{len(err)}")
        print(f"   llama.cpp: {row['text_llama_cpp']!r}\n   ggraph:    {row['text_ggraph']!r}")
    if not args.skip_speed:
        rng = np.random.default_rng(0)
        pp = [int(x) for x in rng.integers(100, 40000, 512)]
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(pp)
        pp_cpp = 512 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(64):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        tg_cpp = 64 / (time.perf_counter() - t0)
        # compile and bind the 512-token and the decode graphs outside the timing (llama.cpp's
        # kernels are compiled before its run too)
        eng.reset()
        eng.eval(pp)
        for i in range(4):
            eng.eval([1 + i])
        eng.reset()
        t0 = time.perf_counter()
        eng.eval(pp)
        pp_gg = 512 / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        tok = 0
        for i in range(64):
            tok = int(np.argmax(eng.eval([tok])))
        tg_gg = 64 / (time.perf_counter() - t0)
        out["speed"] = dict(pp512_llama_cpp=pp_cpp, pp512_ggraph=pp_gg,
                            tg64_llama_cpp=tg_cpp, tg64_ggraph=tg_gg)
        print_peer_speed(out["speed"], ("pp512", "tg64"))
    write_results(args.out, args=args, extra=out)


if __name__ == "__main__":
    main()
