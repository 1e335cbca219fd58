"""Perplexity of SmolLM2-135M Q4_1 on the repo's text (tests/data/ppl/python_reference.txt)
with llama-perplexity's method, in ggraph and in llama.cpp (llama-cpp-python, same process,
the same chunks and tokens, every chunk from an empty KV cache), and the KL divergence of each
against an unrounded reference.

- llama.cpp: Llama(logits_all=True), each chunk after reset(); its scored log-probabilities
  are also written as a llama.cpp base file (the format of --kl-divergence-base);
- the reference: ggraph with GGRAPH_EXACT_ACTIVATIONS=1 (f32 activations into the quantized
  matrix products; read at import of backends/cpu/kernels.py, so it runs in a subprocess of
  this script that writes its own base file);
- ggraph's default mode: PPL, and KL divergence against the reference and against llama.cpp's
  base file; then `ggraph perplexity --kl-divergence` on llama.cpp's base file (the command,
  in a subprocess) must print the same figures;
- ggraph --ggml-exact on the first --exact-chunks chunks only (it computes as ggml's CPU does,
  bit for bit, and is slow on 2 cores): PPL beside llama.cpp's over the same chunks and the
  largest logit difference.

    python benchmarks/perplexity_llama_cpp.py [--chunks 4] [--exact-chunks 1] [--threads 2]
    python benchmarks/perplexity_llama_cpp.py --mode llama-base --base-out FILE  # base only
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ggraph.graphs.eval.bench import machine_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (import_llama_cpp, llama_cpp_model, model_option, out_option, results_path,
                    threads_option, write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "tests", "data", "ppl", "python_reference.txt")


def load_tokens(model: str, n_ctx: int, n_chunks: int):
    from ggraph.graphs.gguf.gguf_reader import read_header
    from ggraph.graphs.eval.perplexity import plan_chunks, read_text
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    tok = Tokenizer(read_header(model).metadata, model)
    text = read_text(TEXT)
    tokens = np.asarray(tok.encode(text, special=False), dtype=np.int64)
    return text, tokens, plan_chunks(len(tokens), n_ctx, n_chunks,
                                     tok.bos if tok.add_bos else None)


def llama_cpp_ppl(model: str, n_ctx: int, threads: int):
    """llama.cpp with every position's logits, a chunk in one batch."""
    return llama_cpp_model(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512),
                           threads=threads, logits_all=True)


def llama_cpp_evaluate(llm, first: int):
    """Each chunk alone from an empty cache; its logits from position `first` on (the
    perplexity Evaluate of graphs/eval/perplexity.py)."""
    def evaluate(chunks: list[list[int]]) -> list[np.ndarray]:
        out = []
        for toks in chunks:
            llm.reset()  # n_tokens = 0: eval removes every cell of the KV cache first
            llm.eval(toks)
            out.append(np.array(llm.scores[first:len(toks)], dtype=np.float32))
        return out
    return evaluate


def ggraph_evaluate(model: str, n_ctx: int, threads: int, first: int, exact: bool = False):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.eval.perplexity import engine_evaluate

    eng = Engine(model, EngineConfig(n_ctx=n_ctx, n_ubatch=min(n_ctx, 512), n_threads=threads,
                                     ggml_exact=exact))
    return engine_evaluate(eng, first)


def ppl_of(values: list[np.ndarray]) -> dict:
    from ggraph.graphs.eval.perplexity import PplStats

    s = PplStats()
    for v in values:
        s.add(v)
    return {"ppl": s.ppl, "err": s.error, "count": s.count,
            "running_ppl": [float(np.exp(np.concatenate(values[:i + 1]).mean()))
                            for i in range(len(values))]}


def kld_figures(stats) -> dict:
    s = stats.summary()
    return {"mean_kld": s.kld[0], "mean_kld_err": s.kld[1], "median_kld": s.kld_median,
            "kld_99": s.kld_percentiles["99.0%"], "max_kld": s.kld_percentiles["Maximum"],
            "same_top": s.same_top[0], "same_top_err": s.same_top[1],
            "rms_dp": s.rms_p_diff[0], "ppl_ratio": s.ratio[0], "cor": s.cor, "count": s.count}


def write_base(evaluate, tokens, chunking, n_vocab: int, path: str) -> dict:
    """Evaluate every chunk, write the base file, return PPL figures and timings."""
    from ggraph.graphs.eval.perplexity import BaseWriter, run_perplexity

    times: list[float] = []
    with BaseWriter(path, chunking, n_vocab, tokens) as w:
        st = run_perplexity(evaluate, tokens, chunking, lambda d: times.append(d.seconds), w)
    return {**ppl_of(st.values), "nll": [v.tolist() for v in st.values], "s_per_chunk": times}


def mode_base(args: argparse.Namespace, model: str) -> None:
    """A subprocess mode: write one base file, print its figures as JSON on the last line."""
    _, tokens, chunking = load_tokens(model, args.ctx, args.chunks)
    if args.mode == "llama-base":
        llm = llama_cpp_ppl(model, args.ctx, args.threads)
        evaluate, n_vocab = llama_cpp_evaluate(llm, chunking.first), llm.n_vocab()
    else:
        from ggraph.graphs.gguf.gguf_reader import read_header
        from ggraph.backends.cpu import kernels

        evaluate = ggraph_evaluate(model, args.ctx, args.threads, chunking.first)
        n_vocab = len(read_header(model).metadata["tokenizer.ggml.tokens"])
        print(f"round activations: {kernels.ROUND_ACTIVATIONS}", file=sys.stderr)
    print(json.dumps(write_base(evaluate, tokens, chunking, n_vocab, args.base_out)))


def compare(evaluate, tokens, chunking, bases: dict, chunks: int | None = None) -> dict:
    """NLL per chunk and KL divergence against each base file, one pass over the chunks."""
    from ggraph.graphs.eval.kl_divergence import KldStats, token_kld
    from ggraph.graphs.eval.perplexity import BaseFile, chunk_passes, token_nll

    files = {k: BaseFile.read(p) for k, p in bases.items()}
    stats = {k: KldStats() for k in bases}
    nll, times, logits_kept = [], [], []
    first_chunks = dataclasses.replace(chunking, n_chunk=chunks or chunking.n_chunk)
    for i, scored, dt in chunk_passes(evaluate, tokens, first_chunks):
        times.append(dt)
        tgt = chunking.targets(tokens, i)
        nll.append(token_nll(scored, tgt))
        for k, f in files.items():
            stats[k].add(token_kld(scored, f.chunk_rows(i), tgt))
        logits_kept.append(scored)
        print(f"  chunk {i + 1}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return {"ppl": ppl_of(nll), "nll": nll, "s_per_chunk": times,
            "kld": {k: kld_figures(s) for k, s in stats.items()}, "logits": logits_kept}


def run_sub(args: argparse.Namespace, mode: str, out: str, env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--base-out", out,
           "--model", str(args.model), "--chunks", str(args.chunks), "--ctx", str(args.ctx),
           "--threads", str(args.threads)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cli_kld(args: argparse.Namespace, model: str, base: str) -> dict:
    """`ggraph perplexity --kl-divergence` on a base file; the figures it prints."""
    cmd = [sys.executable, "-m", "ggraph.cli", "perplexity", "-m", model, "-t",
           str(args.threads), "--kl-divergence-base", base, "--kl-divergence"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ggraph perplexity --kl-divergence failed:\n{r.stderr[-3000:]}")
    out = {"command": " ".join(["ggraph"] + cmd[3:]), "seconds": time.perf_counter() - t0}
    for ln in r.stdout.splitlines():
        for key, label in (("mean_kld", "Mean    KLD:"), ("same_top", "Same top p:"),
                           ("ppl_q", "Mean PPL(Q)  "), ("ppl_base", "Mean PPL(base)"),
                           ("rms_dp", "RMS Δp    :")):
            if ln.startswith(label):
                out[key] = ln.split(":", 1)[1].strip()
    out["stdout_tail"] = r.stdout.splitlines()[-40:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[model_option("default"), threads_option(2),
                                          out_option(results_path("perplexity_llama_cpp.json"))])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--exact-chunks", type=int, default=1)
    ap.add_argument("--mode", choices=("all", "llama-base", "ggraph-base"), default="all")
    ap.add_argument("--base-out", help="the base file a --mode writes")
    args = ap.parse_args()
    import numba

    numba.set_num_threads(args.threads)
    model = str(args.model)
    if args.mode != "all":
        if not args.base_out:
            ap.error("--mode needs --base-out FILE")
        mode_base(args, model)
        return
    llama_cpp = import_llama_cpp()
    t_start = time.perf_counter()
    _, tokens, chunking = load_tokens(model, args.ctx, args.chunks)
    tmp = tempfile.mkdtemp(prefix="ggraph-ppl-")
    ref_base, cpp_base = os.path.join(tmp, "reference.kld"), os.path.join(tmp, "llama_cpp.kld")
    try:
        print("llama.cpp ...", file=sys.stderr, flush=True)
        llm = llama_cpp_ppl(model, args.ctx, args.threads)
        cpp_toks = llm.tokenize(read_bytes(TEXT), add_bos=False, special=False)
        cpp = write_base(llama_cpp_evaluate(llm, chunking.first), tokens, chunking,
                         llm.n_vocab(), cpp_base)
        print("reference (GGRAPH_EXACT_ACTIVATIONS=1, subprocess) ...", file=sys.stderr,
              flush=True)
        ref = run_sub(args, "ggraph-base", ref_base, {"GGRAPH_EXACT_ACTIVATIONS": "1"})
        print("llama.cpp against the reference ...", file=sys.stderr, flush=True)
        cpp_vs_ref = compare(llama_cpp_evaluate(llm, chunking.first), tokens, chunking,
                             {"ref": ref_base})
        print("ggraph default ...", file=sys.stderr, flush=True)
        dflt = compare(ggraph_evaluate(model, args.ctx, args.threads, chunking.first), tokens,
                       chunking, {"ref": ref_base, "llama_cpp": cpp_base})
        print("ggraph perplexity --kl-divergence on llama.cpp's base file ...",
              file=sys.stderr, flush=True)
        cli = cli_kld(args, model, cpp_base)
        n_ex = max(0, min(args.exact_chunks, chunking.n_chunk))
        exact = exact_max_diff = None
        if n_ex:  # --exact-chunks 0 skips it (the exact engine of a 1.5B model is slow and big)
            print(f"ggraph --ggml-exact over {n_ex} chunk(s) ...", file=sys.stderr, flush=True)
            exact = compare(ggraph_evaluate(model, args.ctx, args.threads, chunking.first,
                                            exact=True), tokens, chunking,
                            {"ref": ref_base, "llama_cpp": cpp_base}, chunks=n_ex)
            cpp_logits = [lg[:chunking.n_scored] for lg in llama_cpp_evaluate(
                llm, chunking.first)([chunking.chunk(tokens, i) for i in range(n_ex)])]
            exact_max_diff = max(float(np.abs(a - b).max())
                                 for a, b in zip(exact["logits"], cpp_logits))
    finally:
        for p in (ref_base, cpp_base):
            if os.path.exists(p):
                os.remove(p)
        os.rmdir(tmp)
    cpp_nll = [np.asarray(v) for v in cpp["nll"]]
    cpp_ex = ppl_of(cpp_nll[:n_ex]) if n_ex else None
    res = {
        "cpu": machine_info().line, "threads": args.threads,
        "llama_cpp_version": llama_cpp.__version__,
        "model": os.path.basename(model), "text": "tests/data/ppl/python_reference.txt",
        "n_tokens": int(len(tokens)), "tokens_equal_llama_cpp": list(cpp_toks) == tokens.tolist(),
        "n_ctx": args.ctx, "n_chunk": chunking.n_chunk, "scored_tokens": cpp["count"],
        "ppl": {"llama_cpp": strip(cpp), "ggraph_default": strip(dflt["ppl"]),
                "reference_f32_activations": strip(ref)},
        "s_per_chunk": {"llama_cpp": cpp["s_per_chunk"], "ggraph_default": dflt["s_per_chunk"],
                        "reference": ref["s_per_chunk"],
                        "ggraph_exact": exact["s_per_chunk"] if exact else []},
        "kld_vs_reference": {"llama_cpp": cpp_vs_ref["kld"]["ref"],
                             "ggraph_default": dflt["kld"]["ref"]},
        "ggraph_default_vs_llama_cpp_base": dflt["kld"]["llama_cpp"],
        "cli_kl_divergence_vs_llama_cpp_base": cli,
        "exact": {"chunks": n_ex, "ggraph_exact": strip(exact["ppl"]), "llama_cpp": cpp_ex,
                  "max_abs_logit_diff_vs_llama_cpp": exact_max_diff,
                  "kld_vs_llama_cpp_base": exact["kld"]["llama_cpp"],
                  "kld_vs_reference": exact["kld"]["ref"]} if exact else None,
        "seconds": time.perf_counter() - t_start,
    }
    d_ppl = dflt["ppl"]["ppl"] / cpp["ppl"] - 1
    res["targets"] = {
        "default_ppl_within_1pct": {"rel_diff": d_ppl, "holds": abs(d_ppl) <= 0.01},
        "ggraph_kld_le_llama_cpp": {"ggraph": dflt["kld"]["ref"]["mean_kld"],
                                    "llama_cpp": cpp_vs_ref["kld"]["ref"]["mean_kld"],
                                    "holds": dflt["kld"]["ref"]["mean_kld"]
                                    <= cpp_vs_ref["kld"]["ref"]["mean_kld"]},
    }
    if exact:
        res["targets"]["exact_ppl_equal"] = {"ggraph": exact["ppl"]["ppl"],
                                             "llama_cpp": cpp_ex["ppl"],
                                             "holds": exact["ppl"]["ppl"] == cpp_ex["ppl"]}
    print_table(res)
    write_results(args.out, args=args, extra=res)


def read_bytes(path: str) -> bytes:
    from ggraph.graphs.eval.perplexity import read_text

    return read_text(path).encode()


def strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("nll", "logits", "s_per_chunk")}


def print_table(r: dict) -> None:
    print(f"{r['model']}, {r['n_tokens']} tokens, {r['n_chunk']} chunks of {r['n_ctx']} "
          f"({r['scored_tokens']} scored); {r['cpu']}, {r['threads']} threads")
    print(f"{'':34s}{'PPL':>20s}{'KLD vs ref':>22s}{'same top':>10s}{'RMS dp':>9s}")
    kr = r["kld_vs_reference"]
    rows = [("llama.cpp", r["ppl"]["llama_cpp"], kr["llama_cpp"]),
            ("ggraph default", r["ppl"]["ggraph_default"], kr["ggraph_default"]),
            ("reference (f32 activations)", r["ppl"]["reference_f32_activations"], None)]
    for name, p, k in rows:
        ks = (f"{k['mean_kld']:.6f} ± {k['mean_kld_err']:.6f}{100 * k['same_top']:9.2f}%"
              f"{100 * k['rms_dp']:8.3f}%") if k else ""
        print(f"{name:34s}{p['ppl']:11.4f} ± {p['err']:6.4f}   {ks}")
    e = r["exact"]
    if e:
        print(f"over the first {e['chunks']} chunk(s): ggraph --ggml-exact PPL "
              f"{e['ggraph_exact']['ppl']:.6f}, llama.cpp {e['llama_cpp']['ppl']:.6f}, largest "
              f"logit difference {e['max_abs_logit_diff_vs_llama_cpp']:.3g}")
    g = r["ggraph_default_vs_llama_cpp_base"]
    print(f"ggraph default vs llama.cpp's base file: KLD {g['mean_kld']:.6f}, same top "
          f"{100 * g['same_top']:.2f}%; the command printed: "
          f"KLD {r['cli_kl_divergence_vs_llama_cpp_base'].get('mean_kld')}, same top "
          f"{r['cli_kl_divergence_vs_llama_cpp_base'].get('same_top')}")
    for k, v in r["targets"].items():
        print(f"target {k}: {'holds' if v['holds'] else 'does not hold'} "
              f"({', '.join(f'{a}={b}' for a, b in v.items() if a != 'holds')})")


if __name__ == "__main__":
    main()
