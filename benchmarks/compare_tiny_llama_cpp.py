"""Every tiny random GGUF writer in ggraph, run by llama.cpp and by ggraph on the same token
ids: per-position logits NMSE of ggraph against llama.cpp.

Writers (a table, one row each): llama, qwen2 and qwen3 from graphs/testing/tiny.py (F32 and Q8_0
matrices, tied and untied output), deepseek2 from graphs/testing/tiny_deepseek2.py, and gemma3 from
graphs/testing/tiny_gemma3.py (`write_tiny_gguf(path, **kw)`) when that module exists; a writer whose
module is missing or whose file llama.cpp refuses is reported as such, not dropped. Both
sides use their default F16 KV cache and one ubatch per sequence. ggraph runs twice: its
default CPU kernels, and `ggml_exact` (quantized mul_mat, rms_norm, rope, softmax bit for bit
as ggml's x86 CPU: backends/cpu/ggml_exact.py), column "exact max".

    pip install llama-cpp-python
    python benchmarks/compare_tiny_llama_cpp.py [--json benchmarks/results/tiny_llama_cpp.json]
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ggraph.check.conformance import nmse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, import_llama_cpp, llama_cpp_model, out_option, print_table,
                    results_path, threads_option, write_results)

N_CTX = 128
SEQ_LENGTHS = (8, 24, 64)


@dataclass(frozen=True)
class Writer:
    """One tiny model: module and function that write it, and their keyword arguments."""
    module: str
    function: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    config: str = ""   # a dataclass in `module` built from kwargs and passed as cfg

    def write(self, path: str) -> str:
        mod = importlib.import_module(self.module)
        fn: Callable[..., str] = getattr(mod, self.function)
        if self.config:
            return fn(path, getattr(mod, self.config)(**self.kwargs))
        return fn(path, **self.kwargs)


TINY = "ggraph.graphs.testing.tiny"
WRITERS: dict[str, Writer] = {
    "llama-f32": Writer(TINY, "write_tiny_gguf", dict(arch="llama")),
    "llama-q8_0-untied": Writer(TINY, "write_tiny_gguf", dict(arch="llama", weight_type="q8_0",
                                                              tied_output=False)),
    "qwen2-f32": Writer(TINY, "write_tiny_gguf", dict(arch="qwen2", rms_eps=1e-6)),
    "qwen2-f32-untied-bias": Writer(TINY, "write_tiny_gguf", dict(
        arch="qwen2", tied_output=False, output_bias=True, seed=1)),
    "qwen2-q8_0": Writer(TINY, "write_tiny_gguf", dict(arch="qwen2", weight_type="q8_0")),
    "qwen3-f32": Writer(TINY, "write_tiny_gguf", dict(arch="qwen3", head_dim=32,
                                                      rms_eps=1e-6)),
    "qwen3-f32-untied-mqa": Writer(TINY, "write_tiny_gguf", dict(
        arch="qwen3", head_dim=32, n_head_kv=1, tied_output=False, seed=2)),
    "qwen3-q8_0": Writer(TINY, "write_tiny_gguf", dict(arch="qwen3", head_dim=32,
                                                       weight_type="q8_0")),
    "deepseek2-f32": Writer("ggraph.graphs.testing.tiny_deepseek2", "write_tiny_deepseek2",
                            config="TinyDeepSeek2"),
    "gemma3-f32": Writer("ggraph.graphs.testing.tiny_gemma3", "write_tiny_gguf"),
}


def llama_cpp_logits(path: str, seqs: list[list[int]], threads: int) -> list[np.ndarray]:
    llm = llama_cpp_model(path, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, logits_all=True,
                          threads=threads)
    out = []
    for toks in seqs:
        llm.reset()
        llm.eval(toks)
        out.append(np.array(llm.scores[: len(toks)], np.float64))
    llm.close()
    return out


def ggraph_logits(path: str, seqs: list[list[int]], threads: int,
                  ggml_exact: bool = False) -> list[np.ndarray]:
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    eng = Engine(path, EngineConfig(n_ctx=N_CTX, n_ubatch=N_CTX, n_threads=threads,
                                    ggml_exact=ggml_exact))
    out = []
    for toks in seqs:
        eng.reset()
        out.append(np.asarray(eng.eval(toks, all_logits=True), np.float64))
    return out


def compare(name: str, writer: Writer, tmp: str, threads: int) -> dict[str, Any]:
    row: dict[str, Any] = dict(model=name, writer=f"{writer.module}.{writer.function}",
                               kwargs=writer.kwargs)
    try:
        path = writer.write(os.path.join(tmp, f"{name}.gguf"))
    except ModuleNotFoundError as e:
        return dict(row, status=f"skipped: {e.name} is not present")
    try:
        from ggraph.graphs.gguf.gguf_file import load_gguf

        n_vocab = len(load_gguf(path, with_data=False).metadata["tokenizer.ggml.tokens"])
        rng = np.random.default_rng(0)
        seqs = [[int(t) for t in rng.integers(3, n_vocab, n)] for n in SEQ_LENGTHS]
        ref_all = llama_cpp_logits(path, seqs, threads)
    except Exception as e:  # llama.cpp refuses the file: a finding, reported
        return dict(row, status=f"llama.cpp failed: {type(e).__name__}: {e}")
    try:
        got_all = ggraph_logits(path, seqs, threads)
        exact_all = ggraph_logits(path, seqs, threads, ggml_exact=True)
    except Exception as e:
        return dict(row, status=f"ggraph failed: {type(e).__name__}: {e}",
                    trace=traceback.format_exc(limit=3))
    per_pos = [[nmse(a, b) for a, b in zip(ref, got)] for ref, got in zip(ref_all, got_all)]
    flat = [x for p in per_pos for x in p]
    argmax_same = sum(int(np.argmax(a) == np.argmax(b)) for ref, got in zip(ref_all, got_all)
                      for a, b in zip(ref, got))
    exact = [nmse(a, b) for ref, got in zip(ref_all, exact_all) for a, b in zip(ref, got)]
    return dict(row, status="ok", seq_lengths=list(SEQ_LENGTHS), nmse_max=max(flat),
                nmse_mean=float(np.mean(flat)), argmax_agree=f"{argmax_same}/{len(flat)}",
                ggml_exact_nmse_max=max(exact), nmse_per_position=per_pos)


# a row that did not run leaves the figures blank and says why under status
COLUMNS = [Column("model", width=24, align="<"),
           Column("nmse_max", "NMSE max", "{:.2e}", 11, missing=""),
           Column("nmse_mean", "NMSE mean", "{:.2e}", 11, missing=""),
           Column("argmax_agree", "argmax", width=9, missing=""),
           Column("ggml_exact_nmse_max", "exact max", "{:.2e}", 11, missing=""),
           Column(lambda r: r["status"][:110], "status", align="<", gap="  ")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[threads_option(2),
                                          out_option(results_path("tiny_llama_cpp.json"))])
    ap.add_argument("--only", nargs="*", help="rows to run (names from the table)")
    args = ap.parse_args()
    llama_cpp = import_llama_cpp()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, writer in WRITERS.items():
            if args.only and name not in args.only:
                continue
            rows.append(compare(name, writer, tmp, args.threads))
    print_table(rows, COLUMNS, sep="")
    write_results(args.out, rows, args=args, extra=dict(
        llama_cpp_version=llama_cpp.__version__, threads=args.threads,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        n_ctx=N_CTX, kv_cache="f16 (both)"))


if __name__ == "__main__":
    main()
