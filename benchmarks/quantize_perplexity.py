"""Perplexity of quantized files (issue 32's table): `ggraph perplexity` beside llama.cpp's
llama-perplexity on the same files, the same text and chunking, in the same run.

Per model (-m, default SmolLM2 135M and Qwen2.5-Coder 0.5B): an F32 copy of the file
(`ggraph quantize IN F32`), an importance matrix of it (`ggraph imatrix` when it exists, else
llama-imatrix) on --imatrix-text, then for each file type (--types, default Q4_K_M and IQ4_XS)
the copy quantized by `ggraph quantize` without and with that imatrix; every file (the F32 copy
too) gets its perplexity on --text from both programs. The calibration text and the scored text
should differ (the defaults: llama.cpp's Apache licence text for calibration, Python source for
scoring), as a real evaluation keeps them apart.

    python benchmarks/quantize_perplexity.py [-m smollm2,qwen2.5-coder-0.5b]
        [--types Q4_K_M,IQ4_XS] [--text FILE] [--imatrix-text FILE] [-c 512] [--chunks 8]
        [-t 2] [--work DIR] [-o results.json]

Prints a table (PPL ± its error from each program, and their difference); writes JSON and a
markdown copy (quantize_perplexity_{intel,amd}.md).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, run_command, print_table, results_path, table_lines,  # noqa: E402
                      write_markdown_table, write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.expanduser("~/.cache/llamacpp-tools/build/bin")
TEXT = os.path.join(ROOT, "tests", "data", "ppl", "python_reference.txt")
CALIBRATION = os.path.join(ROOT, "tests", "data", "corpus", "apache-2.0.txt")
FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")

COLUMNS = [Column("model", align="<"), Column("type", align="<"),
           Column("imatrix", align="<"), Column("mib", "MiB", "{:.1f}"),
           Column(lambda r: f"{r['ggraph_ppl']:.4f} ± {r['ggraph_err']:.4f}", "ggraph PPL"),
           Column(lambda r: f"{r['llama_ppl']:.4f} ± {r['llama_err']:.4f}", "llama.cpp PPL"),
           Column(lambda r: f"{100 * (r['ggraph_ppl'] / r['llama_ppl'] - 1):+.3f}%",
                  "difference"),
           Column("ggraph_s", "ggraph s", "{:.1f}"), Column("llama_s", "llama.cpp s", "{:.1f}")]


def _ggraph(*args: str) -> list[str]:
    return [sys.executable, "-m", "ggraph.cli", *args]


def _ppl(out: str, who: str) -> tuple[float, float]:
    m = FINAL.search(out)
    if m is None:
        raise RuntimeError(f"{who}: no 'Final estimate' line in:\n{out[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def one_file(model: str, ftype: str, label: str, path: str, args: argparse.Namespace,
             rows: list[dict]) -> None:
    common = ["-f", args.text, "-c", str(args.ctx), "--chunks", str(args.chunks), "-t",
              str(args.threads)]
    out_g, tg = run_command(_ggraph("perplexity", "-m", path, *common))
    out_l, tl = run_command([f"{BIN}/llama-perplexity", "-m", path, *common])
    (pg, eg), (pl, el) = _ppl(out_g, "ggraph perplexity"), _ppl(out_l, "llama-perplexity")
    rows.append(dict(model=model, type=ftype, imatrix=label, mib=os.path.getsize(path) / 2**20,
                     ggraph_ppl=pg, ggraph_err=eg, llama_ppl=pl, llama_err=el, ggraph_s=tg,
                     llama_s=tl))
    print(table_lines(rows[-1:], COLUMNS, header=False)[0], flush=True)


def one_model(model: str, args: argparse.Namespace, rows: list[dict]) -> None:
    from ggraph.graphs.gguf.fetch import resolve_model

    src = resolve_model(model)
    work = os.path.join(args.work, os.path.basename(src).removesuffix(".gguf"))
    os.makedirs(work, exist_ok=True)
    t = str(args.threads)
    f32 = os.path.join(work, "f32.gguf")
    run_command(_ggraph("quantize", src, f32, "F32", t))
    im = os.path.join(work, "imatrix.gguf")
    im_args = ["-m", f32, "-f", args.imatrix_text, "-c", str(args.ctx), "--chunks",
               str(args.chunks), "-o", im, "-t", t]
    if subprocess.run(_ggraph("imatrix", "--help"), capture_output=True).returncode == 0:
        run_command(_ggraph("imatrix", *im_args))
        who = "ggraph imatrix"
    else:
        run_command([f"{BIN}/llama-imatrix", *im_args])
        who = "llama-imatrix"
    one_file(model, "F32", "-", f32, args, rows)
    for ftype in args.types.split(","):
        for label, extra in (("-", []), (who, ["--imatrix", im])):
            q = os.path.join(work, f"{ftype}.gguf")
            run_command(_ggraph("quantize", *extra, f32, q, ftype, t))
            one_file(model, ftype, label, q, args, rows)
            os.remove(q)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--types", default="Q4_K_M,IQ4_XS")
    ap.add_argument("--text", default=TEXT, help="the scored text")
    ap.add_argument("--imatrix-text", default=CALIBRATION, help="the calibration text")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/ggraph-quantize-perplexity")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("-o", "--out", default=results_path("quantize_perplexity.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    for m in args.models.split(","):
        one_model(m, args, rows)
    print()
    print_table(rows, COLUMNS)
    write_results(args.out, rows, args=args)
    write_markdown_table(args.out, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
