"""`ggraph quantize` beside llama.cpp's llama-quantize on real models: the same bytes (issue 32's
must-show), and the time each takes, in the same run.

Per model (-m, default SmolLM2 135M and Qwen2.5-Coder 0.5B):
1. an F32 copy made by `ggraph quantize IN F32.gguf F32` and by `llama-quantize
   --allow-requantize IN F32.gguf F32`: the two must be the same bytes; llama.cpp's copy is the
   input of everything after;
2. an importance matrix from llama-imatrix on --text (--chunks chunks of -c tokens), and one
   from `ggraph imatrix` on the same text when that command exists;
3. for every file type (--types, default all that ggraph makes): both tools quantize the F32
   copy, without an imatrix and with each imatrix file (the same path given to both: it is
   written into the file). A row says SAME, or names the first differing byte: in the
   header, or the tensor and the byte within it.

    python benchmarks/quantize_equality.py [-m smollm2,qwen2.5-coder-0.5b] [--types Q4_K_M,...]
        [--text FILE] [-c 512] [--chunks 8] [-t 2] [--work DIR] [-o results.json]

llama.cpp's programs: ~/.cache/llamacpp-tools/build/bin (../shared/tools/llamacpp-tools.sh).
Prints a table; writes JSON (and a markdown copy, quantize_equality_{intel,amd}.md). Exit
status 1 when any file differs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, run_command, print_table, results_path,  # noqa: E402
                      write_markdown_table, write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.expanduser("~/.cache/llamacpp-tools/build/bin")
TEXT = os.path.join(ROOT, "tests", "data", "ppl", "python_reference.txt")

COLUMNS = [Column("model", align="<"), Column("type", align="<"),
           Column("imatrix", align="<"), Column("result", align="<"), Column("bytes"),
           Column("ggraph_s", "ggraph s", "{:.1f}"), Column("llama_s", "llama.cpp s", "{:.1f}")]


def seconds(cmd: list[str]) -> float:
    return run_command(cmd)[1]


def _ggraph(*args: str) -> list[str]:
    return [sys.executable, "-m", "ggraph.cli", *args]


def _compare(a: str, b: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from llama_quantize_ref import first_difference

    d = first_difference(a, b)
    return "SAME" if d is None else f"DIFF {d}"


def _types(text: str | None) -> list[str]:
    from ggraph.graphs.quantize.mix import FTYPES, parse_ftype

    if not text:
        return [t for t in FTYPES if t not in ("F32",)]
    return [parse_ftype(t) for t in text.split(",")]


def one_model(name: str, args: argparse.Namespace, rows: list[dict]) -> None:
    from ggraph.graphs.gguf.fetch import resolve_model

    src = resolve_model(name)
    work = os.path.join(args.work, os.path.basename(src).removesuffix(".gguf"))
    os.makedirs(work, exist_ok=True)
    t = str(args.threads)
    f32, f32g = os.path.join(work, "f32-llama.gguf"), os.path.join(work, "f32-ggraph.gguf")
    tg = seconds(_ggraph("quantize", src, f32g, "F32", t))
    tl = seconds([f"{BIN}/llama-quantize", "--allow-requantize", src, f32, "F32", t])
    rows.append(dict(model=name, type="F32 (from the file)", imatrix="-",
                     result=_compare(f32g, f32), bytes=os.path.getsize(f32), ggraph_s=tg,
                     llama_s=tl))
    print(_fmt(rows[-1]), flush=True)
    os.remove(f32g)
    imatrices = [("-", None)]
    im = os.path.join(work, "imatrix-llama.gguf")
    seconds([f"{BIN}/llama-imatrix", "-m", f32, "-f", args.text, "-c", str(args.ctx), "--chunks",
          str(args.chunks), "-o", im, "-t", t])
    imatrices.append(("llama-imatrix", im))
    imatrix_cmd = _ggraph("imatrix", "--help")
    if subprocess.run(imatrix_cmd, capture_output=True).returncode == 0:
        img = os.path.join(work, "imatrix-ggraph.gguf")
        seconds(_ggraph("imatrix", "-m", f32, "-f", args.text, "-c", str(args.ctx), "--chunks",
                     str(args.chunks), "-o", img, "-t", t))
        imatrices.append(("ggraph imatrix", img))
    for ftype in _types(args.types):
        for label, path in imatrices:
            if path is not None and ftype in ("F16", "BF16"):
                continue
            if path is None and ftype == "Q2_K_S":
                continue   # needs an imatrix in both tools
            extra = [] if path is None else ["--imatrix", path]
            a, b = os.path.join(work, f"g-{ftype}.gguf"), os.path.join(work, f"l-{ftype}.gguf")
            tg = seconds(_ggraph("quantize", *extra, f32, a, ftype, t))
            tl = seconds([f"{BIN}/llama-quantize", *extra, f32, b, ftype, t])
            rows.append(dict(model=name, type=ftype, imatrix=label, result=_compare(a, b),
                             bytes=os.path.getsize(b), ggraph_s=tg, llama_s=tl))
            print(_fmt(rows[-1]), flush=True)
            os.remove(a)
            os.remove(b)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _fmt(r: dict) -> str:
    return (f"{r['model']:<20s} {r['type']:<20s} {r['imatrix']:<15s} {r['result']:<6s} "
            f"{r['ggraph_s']:6.1f}s {r['llama_s']:6.1f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--models", default="smollm2,qwen2.5-coder-0.5b")
    ap.add_argument("--types", default="", help="file types (default: all ggraph makes)")
    ap.add_argument("--text", default=TEXT, help="the imatrix's calibration text")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--work", default="/tmp/ggraph-quantize-equality")
    ap.add_argument("--keep", action="store_true", help="keep the F32 copies and imatrices")
    ap.add_argument("-o", "--out", default=results_path("quantize_equality.json"))
    args = ap.parse_args()
    if not os.path.exists(f"{BIN}/llama-quantize"):
        print(f"no llama-quantize in {BIN}: run ../shared/tools/llamacpp-tools.sh",
              file=sys.stderr)
        return 2
    rows: list[dict] = []
    for m in args.models.split(","):
        one_model(m, args, rows)
    print()
    print_table(rows, COLUMNS)
    write_results(args.out, rows, args=args)
    write_markdown_table(args.out, rows, COLUMNS)
    return 0 if all(r["result"] == "SAME" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
