"""`ggraph imatrix` beside llama-imatrix on real models (issue 32's must-show): per weight, how
far the statistics are apart, next to how far llama.cpp is from itself, in the same run.

Per model (-m, default SmolLM2 135M and Qwen2.5-Coder 0.5B, as the files come), on --text with
-c tokens a chunk and --chunks chunks, both programs evaluating one chunk per batch (llama-
imatrix -b = -c):
- llama.cpp's spread: llama-imatrix with flash attention on against off (two correct builds of
  the same sums);
- ggraph (its fast default mode, -fa on) against llama-imatrix -fa on;
- ggraph --ggml-exact -fa off against llama-imatrix -fa off: entries bit for bit equal.
A row gives, over the entries, the median and largest relative difference of the per-weight
totals and of single columns, and how many entries are the same bytes; counts must be equal.

    python benchmarks/imatrix_agreement.py [-m smollm2,qwen2.5-coder-0.5b] [--text FILE]
        [-c 128] [--chunks 2] [-t 2] [-o results.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, run_command, print_table, results_path,  # noqa: E402
                      write_markdown_table, write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.expanduser("~/.cache/llamacpp-tools/build/bin")
TEXT = os.path.join(ROOT, "tests", "data", "ppl", "python_reference.txt")

COLUMNS = [Column("model", align="<"), Column("pair", align="<"),
           Column("entries"), Column("same_bytes", "same bytes"),
           Column("total_median", "total: median", "{:.1e}"),
           Column("total_max", "total: max", "{:.1e}"),
           Column("column_median", "column: median", "{:.1e}"),
           Column("column_max", "column: max", "{:.1e}"),
           Column("counts_equal", "counts equal")]


def seconds(cmd: list[str]) -> float:
    return run_command(cmd)[1]


def compare(a_path: str, b_path: str) -> dict:
    from ggraph.graphs.quantize.imatrix_file import read_imatrix

    a, b = read_imatrix(a_path), read_imatrix(b_path)
    if set(a.entries) != set(b.entries):
        raise RuntimeError(f"{a_path} and {b_path} hold different weights: "
                           f"{sorted(set(a.entries) ^ set(b.entries))[:5]}")
    tot, col, same, counts = [], [], 0, True
    for k, eb in b.entries.items():
        x, y = a.entries[k].sums.astype(np.float64), eb.sums.astype(np.float64)
        tot.append(abs(x.sum() / y.sum() - 1))
        col.append(np.abs(x - y) / np.maximum(np.abs(y), 1e-30))
        same += np.array_equal(a.entries[k].sums, eb.sums)
        counts &= np.array_equal(a.entries[k].counts, eb.counts)
    cols = np.concatenate(col)
    return dict(entries=len(b.entries), same_bytes=same, total_median=float(np.median(tot)),
                total_max=float(np.max(tot)), column_median=float(np.median(cols)),
                column_max=float(np.max(cols)), counts_equal=bool(counts))


def one_model(name: str, args: argparse.Namespace, rows: list[dict], d: str) -> None:
    from ggraph.graphs.gguf.fetch import resolve_model

    path = resolve_model(name)
    common = ["-m", path, "-f", args.text, "-c", str(args.ctx), "--chunks", str(args.chunks),
              "-t", str(args.threads)]
    files = {}
    for fa in ("on", "off"):
        files[f"llama-{fa}"] = f = os.path.join(d, f"{name}-llama-{fa}.gguf")
        seconds([f"{BIN}/llama-imatrix", *common, "-b", str(args.ctx), "-fa", fa, "-o", f])
    files["ggraph"] = f = os.path.join(d, f"{name}-ggraph.gguf")
    seconds([sys.executable, "-m", "ggraph.cli", "imatrix", *common, "-o", f])
    files["ggraph-exact"] = f = os.path.join(d, f"{name}-ggraph-exact.gguf")
    seconds([sys.executable, "-m", "ggraph.cli", "imatrix", *common, "--ggml-exact", "-fa", "off",
          "-o", f])
    for label, a, b in (("llama.cpp -fa on vs off (its spread)", "llama-on", "llama-off"),
                        ("ggraph vs llama.cpp (-fa on)", "ggraph", "llama-on"),
                        ("ggraph --ggml-exact vs llama.cpp (-fa off)", "ggraph-exact",
                         "llama-off")):
        rows.append(dict(model=name, pair=label, **compare(files[a], files[b])))
        print(rows[-1], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-o", "--out", default=results_path("imatrix_agreement.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for m in args.models.split(","):
            one_model(m, args, rows, d)
    print()
    print_table(rows, COLUMNS)
    write_results(args.out, rows, args=args)
    write_markdown_table(args.out, rows, COLUMNS)
    exact = [r for r in rows if "exact" in r["pair"]]
    return 0 if all(r["same_bytes"] == r["entries"] for r in exact) else 1


if __name__ == "__main__":
    sys.exit(main())
