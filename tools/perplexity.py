"""`ggraph perplexity`: llama.cpp's llama-perplexity. The text is cut into chunks of -c tokens,
each evaluated from an empty KV cache with only its second half scored; the running PPL is
printed after each chunk ([1]x.xxxx,[2]...) and then "Final estimate: PPL = x +/- y".

    ggraph perplexity -m MODEL -f TEXT [-c 512] [--chunks N]
    ggraph perplexity -m MODEL -f TEXT --kl-divergence-base BASE      # write BASE
    ggraph perplexity -m MODEL --kl-divergence-base BASE --kl-divergence

With --kl-divergence-base alone the scored log-probabilities are saved in llama.cpp's file
format (files written by llama-perplexity are read, and the other way round); with
--kl-divergence as well the text and chunking come from BASE and the logits are compared with
it: KL divergence, Δp and top-token agreement, as llama.cpp prints them.

As llama-perplexity, -b packs n_seq = b / c chunks into one batch (each its own sequence,
attending to its own chunk only, so the figures are those of one chunk at a time): the KV
cache holds n_seq * c cells. "Final estimate" goes to standard output; the informational lines
go to standard error, as llama.cpp's do.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ggraph.graphs.runtime.engine import Engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a model on a text (llama-perplexity)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="default",
                   help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    p.add_argument("-f", "--file", help="the text (UTF-8; one trailing newline is dropped)")
    from ggraph.tools.common.defaults import (N_BATCH, N_CTX_PERPLEXITY, add_context_flags, add_flash_attn_flag,
                           add_load_flags, add_lora_flags, add_threads_flag)

    add_context_flags(p, n_ctx=None, ctx_help=f"tokens per chunk (default {N_CTX_PERPLEXITY}; with "
                      f"--kl-divergence, the base file's)")
    p.add_argument("-b", "--batch-size", type=int, default=N_BATCH,
                   help=f"logical batch (default {N_BATCH}): b / c chunks are evaluated "
                        f"together, in ubatches of -ub tokens")
    add_flash_attn_flag(p)
    p.add_argument("--chunks", type=int, default=-1, help="at most N chunks (default: all)")
    p.add_argument("--kl-divergence-base", "--save-all-logits", metavar="FILE",
                   help="the log-probability file to write (or with --kl-divergence, to read)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare with the log-probabilities of --kl-divergence-base")
    p.add_argument("--ggml-exact", action="store_true",
                   help="compute as ggml's CPU does, bit for bit (slower)")
    add_threads_flag(p)
    add_load_flags(p)
    add_lora_flags(p)
    p.set_defaults(func=main)


class Progress:
    """A progress bar on a terminal: after the values on the same line when standard output
    is that terminal (it is erased before the next value), else on standard error's own
    line. Nothing when standard error is not a terminal."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        out, err = out or sys.stdout, err or sys.stderr  # looked up now: tests swap them
        self.err = err
        self.on = err.isatty()
        self.inline = self.on and out.isatty()
        self.shown = 0

    def draw(self, done: int, total: int, elapsed: float) -> None:
        if not self.on:
            return
        width = 20
        fill = width * done // max(total, 1)
        eta = elapsed / done * (total - done) if done else float("nan")
        text = (f" [{'#' * fill}{'.' * (width - fill)}] {done}/{total}"
                + (f" ETA {eta:.0f} s" if done else ""))
        self.clear()
        if self.inline:  # after the values; the cursor goes back to where they continue
            self.err.write(f"{text}\033[{len(text)}D")
        else:
            self.err.write(f"\r{text}")
        self.shown = len(text)
        self.err.flush()

    def clear(self) -> None:
        if self.on and self.shown:
            self.err.write("\033[K" if self.inline else "\r\033[K")
            self.err.flush()
            self.shown = 0


def check_options(args: argparse.Namespace) -> None:
    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds, check_threads

    check_bounds(args, {"ctx_size": ("-c/--ctx-size", 4, ""),
                        "batch_size": ("-b/--batch-size", 1, ""),
                        "ubatch_size": SIZE_BOUNDS["ubatch_size"]})
    check_threads(args.threads)
    if args.chunks == 0 or args.chunks < -1:
        raise ValueError(f"--chunks must be >= 1 (or -1: all), got {args.chunks}")
    if args.kl_divergence and not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs --kl-divergence-base FILE: you must provide a "
                         "name of a file containing the log probabilities of the base model")
    if not args.kl_divergence and not args.file:
        raise ValueError("give the text with -f FILE")


def pass_batch(args: argparse.Namespace, n_ctx: int, n_seq: int) -> int:
    """A pass's batch as llama-perplexity takes it: -b, at most the n_seq chunks' tokens."""
    return min(args.batch_size, n_seq * n_ctx)


def load_engine(args: argparse.Namespace, n_ctx: int, n_seq: int) -> Engine:
    """The engine for passes of n_seq chunks of n_ctx tokens (llama-perplexity's context:
    n_seq * n_ctx cells, a batch of at most that, ubatches of -ub)."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import resolve_model

    from ggraph.tools.common.defaults import flash_attn_on, lora_config

    path = resolve_model(args.model)
    # warmup: kernels compile before the first chunk, whose time is the pass estimate
    cfg = EngineConfig(n_ctx=n_seq * n_ctx,
                       n_ubatch=min(pass_batch(args, n_ctx, n_seq), args.ubatch_size),
                       n_seq_max=n_seq, n_threads=args.threads, ggml_exact=args.ggml_exact,
                       flash_attn=flash_attn_on(args.fa), warmup=True, use_mmap=args.mmap,
                       use_mlock=args.mlock, loras=lora_config(args))
    eng = Engine(path, cfg, progress=sys.stderr.isatty())
    for line in eng.load_notes():
        info(line)
    return eng


def eta_words(seconds: int) -> str:
    """llama.cpp's ETA: "1 hours 2.50 minutes" from an hour on, else "2.50 minutes"."""
    hours = f"{seconds // 3600} hours " if seconds >= 3600 else ""
    return f"{hours}{seconds % 3600 / 60:.2f} minutes"


def info(msg: str) -> None:
    sys.stdout.flush()
    print(msg, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    check_options(args)
    if args.kl_divergence:
        return run_kl_divergence(args)
    return run_ppl(args)


def run_ppl(args: argparse.Namespace) -> int:
    import numpy as np

    from ggraph.graphs.eval.perplexity import (BaseWriter, ChunkDone, engine_evaluate, plan_chunks,
                                               read_text, run_perplexity, seq_count)

    from ggraph.tools.common.defaults import N_CTX_PERPLEXITY

    n_ctx = args.ctx_size or N_CTX_PERPLEXITY
    n_seq = seq_count(args.batch_size, n_ctx)
    text = read_text(args.file)  # before the model loads: a missing file fails at once
    eng = load_engine(args, n_ctx, n_seq)
    tok = eng.tokenizer
    if tok.add_eos:
        raise ValueError("the model adds an EOS token to every text; llama-perplexity refuses "
                         "such models too")
    info("perplexity: tokenizing the input ..")
    t0 = time.perf_counter()
    tokens = np.asarray(tok.encode(text, special=False), dtype=np.int64)
    info(f"perplexity: tokenization took {1e3 * (time.perf_counter() - t0):g} ms")
    bos = tok.bos if tok.add_bos else None
    chunking = plan_chunks(len(tokens), n_ctx, args.chunks, bos)
    info(f"perplexity: calculating perplexity over {chunking.n_chunk} chunks, n_ctx={n_ctx}, "
         f"batch_size={pass_batch(args, n_ctx, n_seq)}, n_seq={n_seq}")
    base = None
    if args.kl_divergence_base:
        info(f"perplexity: saving all logits to {args.kl_divergence_base}")
        base = BaseWriter(args.kl_divergence_base, chunking, eng.model.hp.n_vocab, tokens)
    bar = Progress()
    started = time.perf_counter()
    bar.draw(0, chunking.n_chunk, 0.0)

    def on_chunk(d: ChunkDone) -> None:
        bar.clear()
        if d.index == 0:
            info(f"perplexity: {d.seconds:.2f} seconds per pass - ETA "
                 f"{eta_words(d.eta_seconds)}")
        print(f"[{d.index + 1}]{d.stats.ppl:.4f},", end="", flush=True)
        bar.draw(d.index + 1, d.n_chunk, time.perf_counter() - started)

    try:
        stats = run_perplexity(engine_evaluate(eng, chunking.first), tokens, chunking, on_chunk,
                               base, n_seq)
    finally:
        bar.clear()
        if base is not None:
            base.close()
    print(flush=True)
    err = stats.error
    if err != err:  # NaN: no spread to measure
        info("Unexpected negative standard deviation of log(prob)")
        print(f"Final estimate: PPL = {stats.ppl:.4f}", flush=True)
    else:
        print(f"Final estimate: PPL = {stats.ppl:.4f} +/- {err:.5f}", flush=True)
    return 0


def run_kl_divergence(args: argparse.Namespace) -> int:
    from ggraph.graphs.eval.kl_divergence import CHUNK_HEADER, KldStats, token_kld
    from ggraph.graphs.eval.perplexity import (BaseFile, Chunking, chunk_passes, engine_evaluate,
                                               run_eta, seq_count)

    base = BaseFile.read(args.kl_divergence_base)
    if args.ctx_size is not None and args.ctx_size < base.n_ctx:
        raise ValueError(f"{base.path} has been computed with {base.n_ctx}, while the current "
                         f"context is {args.ctx_size}. Increase it with -c and retry")
    if args.file:
        info(f"kl_divergence: the text and chunks come from {base.path}; -f is not read")
    n_seq = seq_count(args.batch_size, base.n_ctx)
    eng = load_engine(args, base.n_ctx, n_seq)
    n_vocab = eng.model.hp.n_vocab
    if base.n_vocab != n_vocab:
        raise ValueError(f"inconsistent vocabulary ({base.n_vocab} in {base.path} vs "
                         f"{n_vocab} in the model)")
    tok = eng.tokenizer
    n_chunk = base.n_chunk if args.chunks < 0 else min(args.chunks, base.n_chunk)
    chunking = Chunking(base.n_ctx, n_chunk, tok.bos if tok.add_bos else None)
    info(f"kl_divergence: computing over {n_chunk} chunks, n_ctx={base.n_ctx}, "
         f"batch_size={pass_batch(args, base.n_ctx, n_seq)}, n_seq={n_seq}")
    evaluate = engine_evaluate(eng, chunking.first)
    stats = KldStats()
    bar = Progress()
    started = time.perf_counter()
    bar.draw(0, n_chunk, 0.0)
    try:
        for i, scored, dt in chunk_passes(evaluate, base.tokens, chunking, n_seq):
            stats.add(token_kld(scored, base.chunk_rows(i), chunking.targets(base.tokens, i)))
            bar.clear()
            if i == 0:
                info(f"kl_divergence: {dt:.2f} seconds per pass - ETA "
                     f"{eta_words(run_eta(dt, n_chunk, n_seq))}")
                print(f"\n{CHUNK_HEADER}", flush=True)
            print(stats.chunk_line(i), flush=True)
            bar.draw(i + 1, n_chunk, time.perf_counter() - started)
    finally:
        bar.clear()
    print(flush=True)
    for line in stats.report_lines():
        print(line)
    sys.stdout.flush()
    return 0
