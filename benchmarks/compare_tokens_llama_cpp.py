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
import json
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "corpus"
OUT = ROOT / "benchmarks" / "results" / "tokens_llama_cpp.json"
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
    from ggraph.backends.cpu.threads import configure_openmp

    configure_openmp()   # libggml-cpu loads the OpenMP runtime: bounded spin first
    import llama_cpp

    from ggraph.graphs.gguf.gguf_reader import read_header
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    t0 = time.perf_counter()
    tok = Tokenizer(read_header(path).metadata, path)
    build_s = time.perf_counter() - t0
    ref = llama_cpp.Llama(path, vocab_only=True, verbose=False)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="text files (default: corpus + stdlib + docs)")
    ap.add_argument("-m", "--model", action="append", help="model path or name (repeatable)")
    ap.add_argument("--vocab-dir", help="a folder of llama.cpp ggml-vocab-*.gguf files")
    ap.add_argument("-o", "--out", default=str(OUT))
    args = ap.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: nothing to compare against", file=sys.stderr)
        return 2
    from ggraph.graphs.gguf.fetch import resolve_model

    models = [resolve_model(m) for m in (args.model or ["smollm2", "gemma3"])]
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
        for r in got:
            diff = "" if r["equal"] else f"  first difference at {r['first_difference']}"
            trip = "" if r.get("round_trip", True) else "  (decode does not round trip)"
            print(f"{r['model'][:34]:34} {os.path.basename(r['file'])[:26]:26} "
                  f"special={int(r['special'])} {r['ggraph']:6} {r['llama_cpp']:6} "
                  f"{'equal' if r['equal'] else 'DIFFERENT'}{trip}{diff}")
    n_eq = sum(r["equal"] for r in rows)
    print(f"{n_eq}/{len(rows)} equal; {len(skipped)} models skipped")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "llama_cpp_python": __import__("llama_cpp").__version__,
        "rows": rows, "skipped": skipped}, indent=1, ensure_ascii=False))
    print(f"wrote {out}")
    return 0 if n_eq == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
