"""Compare ggraph's token ids with llama.cpp's (llama-cpp-python, vocabulary only) on text files.

    python benchmarks/compare_tokens_llama_cpp.py [-m MODEL ...] [FILE ...] [--vocab-dir DIR]

MODEL is a path or a model name (default: smollm2 and gemma3); FILE defaults to the corpus in
tests/data/corpus plus a few standard-library sources and documents found on this machine (texts
no test was written against). --vocab-dir adds llama.cpp's own test vocabularies
(models/ggml-vocab-*.gguf in a llama.cpp checkout), one per pre-tokenizer family. Each text is
tokenized with and without parsing special tokens, and its ids decoded back. Prints one line per
(model, file, mode) with the counts and the first difference, and writes
benchmarks/results/tokens_llama_cpp.json.
"""
from __future__ import annotations

import argparse
import glob
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, llama_cpp_model, llama_cpp_version, model_arg, out_option,
                    results_path, row_line, write_results)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "corpus"
MAX_BYTES = 64 * 1024  # the head of a larger file is enough to find a difference


def default_files() -> list[str]:
    files = sorted(str(p) for p in CORPUS.glob("*.txt"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in ("textwrap.py", "json/decoder.py", "this.py", "difflib.py", "email/utils.py"):
        if (stdlib / rel).is_file():
            files.append(str(stdlib / rel))
    for pattern in ("/usr/share/common-licenses/GPL-3", "/usr/share/doc/*/README*",
                    "/usr/share/doc/*/copyright"):
        files += sorted(p for p in glob.glob(pattern) if os.path.isfile(p)
                        and not p.endswith(".gz"))[:2]
    return files


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES)
    return raw.decode("utf-8", "replace")  # both tokenizers then see the same valid UTF-8


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_model(path: str, files: list[str]) -> list[dict[str, Any]]:
    from ggraph.graphs.gguf.gguf_reader import read_header
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer(read_header(path).metadata, path)
    build_s = time.perf_counter() - t0
    ref = llama_cpp_model(path, vocab_only=True)
    rows = []
    for f in files:
        text = read_text(f)
        for special in (False, True):
            t1 = time.perf_counter()
            ours = tok.encode(text, add_bos=tok.add_bos, special=special)
            enc_s = time.perf_counter() - t1
            theirs = ref.tokenize(text.encode("utf-8"), add_bos=True, special=special)
            at = first_difference(ours, theirs)
            row: dict[str, Any] = {
                "model": os.path.basename(path), "file": f, "special": special,
                "bytes": len(text.encode("utf-8")), "ggraph": len(ours),
                "llama_cpp": len(theirs), "equal": at is None, "encode_s": round(enc_s, 4),
                "build_s": round(build_s, 3)}
            if at is not None:
                row["first_difference"] = {
                    "index": at,
                    "ggraph": [tok.tokens[i] for i in ours[max(0, at - 2):at + 4]],
                    "llama_cpp": [tok.tokens[i] for i in theirs[max(0, at - 2):at + 4]]}
            if not special:
                row["round_trip"] = tok.decode(ours, special=False) == text
            rows.append(row)
    return rows


def status(r: dict[str, Any]) -> str:
    diff = "" if r["equal"] else f"  first difference at {r['first_difference']}"
    trip = "" if r.get("round_trip", True) else "  (decode does not round trip)"
    return f"{'equal' if r['equal'] else 'DIFFERENT'}{trip}{diff}"


COLUMNS = [Column(lambda r: r["model"][:34], "model", width=34, align="<"),
           Column(lambda r: os.path.basename(r["file"])[:26], "file", width=26, align="<"),
           Column(lambda r: f"special={int(r['special'])}", "special"),
           Column("ggraph", width=6), Column("llama_cpp", width=6),
           Column(status, "status", align="<")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 parents=[out_option(results_path("tokens_llama_cpp.json"))])
    ap.add_argument("files", nargs="*", help="text files (default: corpus + stdlib + docs)")
    ap.add_argument("-m", "--model", action="append", type=model_arg,
                    help="model path or name (repeatable; default smollm2 and gemma3)")
    ap.add_argument("--vocab-dir", help="a folder of llama.cpp ggml-vocab-*.gguf files")
    args = ap.parse_args(argv)
    if llama_cpp_version() is None:
        print("llama-cpp-python is not installed: nothing to compare against", file=sys.stderr)
        return 2
    models = [str(m) for m in (args.model or [model_arg("smollm2"), model_arg("gemma3")])]
    if args.vocab_dir:
        models += sorted(glob.glob(os.path.join(args.vocab_dir, "ggml-vocab-*.gguf")))
    files = args.files or default_files()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for m in models:
        try:
            got = compare_model(m, files)
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer model ggraph does not read
            skipped[os.path.basename(m)] = f"{type(e).__name__}: {e}"[:300]
            print(f"{os.path.basename(m)}: skipped ({skipped[os.path.basename(m)]})")
            continue
        rows += got
        for r in got:   # no header: the columns are model, file, mode, the two counts
            print(row_line(r, COLUMNS))
    n_eq = sum(r["equal"] for r in rows)
    print(f"{n_eq}/{len(rows)} equal; {len(skipped)} models skipped")
    write_results(args.out, rows, args=args, argv=argv, extra={
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "llama_cpp_python": llama_cpp_version(), "skipped": skipped})
    return 0 if n_eq == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
