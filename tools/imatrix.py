"""`ggraph imatrix`: llama.cpp's llama-imatrix. Runs a model over a calibration text and writes
the importance matrix `ggraph quantize --imatrix` (and llama-quantize) read: per weight of
every layer, the sums of squared activations per input column, with their counts.

    ggraph imatrix -m MODEL -f TEXT [-c 512] [--chunks N] [-o imatrix.gguf]
        [--output-format gguf|dat] [--process-output] [--no-ppl] [--ggml-exact]

The text is cut into chunks of -c tokens (BOS first where the model adds one), each evaluated
from an empty cache; the running perplexity of the chunks' second halves prints as
llama-imatrix prints it ([1]x.xxxx,[2]...). The file is written at the end, and every
--output-frequency chunks. One difference: ggraph evaluates one chunk per batch, where
llama-imatrix packs -b / -c of them (its default -b 2048: four); the sums differ only in
rounding. Give llama-imatrix `-b` equal to `-c`, and ggraph --ggml-exact, for the same bits.
"""
from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("imatrix", help="compute an importance matrix for quantize "
                                       "(llama-imatrix)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="default",
                   help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    p.add_argument("-f", "--file", required=True, help="the calibration text (UTF-8)")
    from ggraph.tools.common.defaults import (N_CTX_PERPLEXITY, add_context_flags,
                                              add_flash_attn_flag, add_load_flags,
                                              add_threads_flag)

    add_context_flags(p, n_ctx=N_CTX_PERPLEXITY, ctx_help="tokens per chunk")
    add_flash_attn_flag(p)
    p.add_argument("--chunks", type=int, default=-1, help="at most N chunks (default: all)")
    p.add_argument("-o", "--output-file", default="imatrix.gguf", help="the file to write")
    p.add_argument("--output-format", choices=("gguf", "dat"), default=None,
                   help="gguf (default) or llama.cpp's legacy dat (default: by the name)")
    p.add_argument("--output-frequency", type=int, default=10,
                   help="write the file every N chunks (default 10)")
    p.add_argument("--process-output", action="store_true",
                   help="collect output.weight's statistics too")
    p.add_argument("--no-ppl", action="store_true", help="do not compute the perplexity")
    p.add_argument("--ggml-exact", action="store_true",
                   help="compute as ggml's CPU does, bit for bit (slower)")
    add_threads_flag(p)
    add_load_flags(p)
    p.set_defaults(func=main, batch_size=None)


def main(args: argparse.Namespace) -> int:
    import numpy as np

    from ggraph.graphs.eval.perplexity import plan_chunks, read_text
    from ggraph.graphs.quantize.imatrix import ChunkReport, ImatrixCollector, collect_imatrix
    from ggraph.graphs.quantize.imatrix_file import write_imatrix_dat, write_imatrix_gguf
    from ggraph.tools.common.defaults import check_bounds, check_threads
    from ggraph.tools.perplexity import eta_words, info, load_engine

    check_bounds(args, {"ctx_size": ("-c/--ctx-size", 4, "")})
    check_threads(args.threads)
    if args.chunks == 0 or args.chunks < -1:
        raise ValueError(f"--chunks must be >= 1 (or -1: all), got {args.chunks}")
    if args.output_frequency < 1:
        raise ValueError(f"--output-frequency must be >= 1, got {args.output_frequency}")
    fmt = args.output_format or ("dat" if args.output_file.endswith(".dat") else "gguf")
    n_ctx = args.ctx_size
    text = read_text(args.file)
    args.batch_size = n_ctx               # one chunk per pass (see the module's docstring)
    eng = load_engine(args, n_ctx, 1)
    tok = eng.tokenizer
    info("imatrix: tokenizing the input ..")
    tokens = np.asarray(tok.encode(text, special=False), dtype=np.int64)
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"{args.file} tokenizes to only {len(tokens)} tokens; a context of "
                         f"{n_ctx} needs at least {2 * n_ctx}")
    chunking = plan_chunks(len(tokens), n_ctx, args.chunks, tok.bos if tok.add_bos else None)
    info(f"imatrix: computing over {chunking.n_chunk} chunks, n_ctx={n_ctx}, "
         f"batch_size={n_ctx}, n_seq=1")
    collector = ImatrixCollector(process_output=args.process_output)

    def save() -> None:
        st = collector.stats([args.file], n_ctx)
        if fmt == "dat":
            write_imatrix_dat(args.output_file, st, args.file)
        else:
            write_imatrix_gguf(args.output_file, st)

    def on_chunk(r: ChunkReport) -> None:
        if r.index == 0:
            info(f"imatrix: {r.seconds:.2f} seconds per pass - ETA "
                 f"{eta_words(int(r.seconds * r.n_chunk))}")
        if not args.no_ppl:
            print(f"[{r.index + 1}]{r.ppl:.4f},", end="", flush=True)
        if (r.index + 1) % args.output_frequency == 0:
            save()

    t0 = time.perf_counter()
    stats = collect_imatrix(eng, tokens, chunking, collector, not args.no_ppl, on_chunk)
    print(flush=True)
    if not args.no_ppl:
        print(f"Final estimate: PPL = {stats.ppl:.4f} +/- {stats.error:.5f}", flush=True)
    save()
    info(f"imatrix: stored {len(collector.entries)} entries after {chunking.n_chunk} chunks "
         f"in {args.output_file} ({time.perf_counter() - t0:.1f} s)")
    sys.stdout.flush()
    return 0
