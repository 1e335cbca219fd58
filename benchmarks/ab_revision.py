"""A paired A/B of the working tree against another revision, in one process: the other
revision's ggraph is extracted (git archive) and imported under the name `ggraph_base`, and
both take turns on the same work, the order alternating, so a stretch when the host's memory
is slow falls on both. For kernel changes that a switch cannot turn off (a packed layout, the
code LLVM is given): benchmarks/ab_decode.py is the one for switches.

    python benchmarks/ab_revision.py mv --base HEAD~1 --type Q4_K --shape 1536x8960 -t 1
    python benchmarks/ab_revision.py decode --base HEAD~1 -m qwen2.5-coder-1.5b -t 2 -n 150
    python benchmarks/ab_revision.py prompt --base cdec236 -m synthetic:qwen2.5-3b -t 1

- mv: a cold product, one graph of copies of one weight (--mib of them, past the L3) times
  one column (a decode step; --cols N: N columns, a prompt's product); random blocks with
  small finite f16 scales; each side packs its own copies as at model load. Checks that both
  sides give the same floats, prints each side's GB/s of stored bytes (median, best) and the
  paired speedup (base time / working-tree time). Each side's copies sit in memory of their
  own, and that alone moves a cold one-column product: the same tree on both sides gave
  0.959x (1536x8960) and 1.060x (8960x1536) over 8 rounds (Zen 4), so a difference of a few
  percent wants repeats. The decode and prompt modes' engines hold their own copies too.
- decode: two engines of one model, decode tokens in turn, the paired difference a token.
  Each engine's weights sit in memory of their own there too: the same tree on both sides
  gave +0.47 ms a token (Qwen2.5 1.5B, 2 threads, 100 tokens of ~24 ms; Zen 4), so a change
  of less than ~0.5 ms a token does not show.
- prompt: two engines of one model, a -p token prompt (one ubatch, random tokens) in turn,
  the paired speedup (e.g. whether a revision or the machine moved a prompt's figure).

mv and decode also print the paired figure by spell: over the pairs of turns that ran faster
than the median pair and over the others (benchlib.by_spell). On a shared host a change to a
product's fixed costs shows in the fast spells and hides in the slow ones.

The extracted revision is kept under ~/.cache/ggraph/ab/<commit> (its numba cache with it),
so a second run against the same base compiles nothing again.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (OwnBytes, by_spell, model_option, out_option, spell_line, threads_option,
                      write_results)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# setup.py's mapping: the top-level folders that install as ggraph.*
ROOTS = {"ggraph": "", "ops": "ops", "backends": "backends", "graphs": "graphs", "tools": "tools"}
NAME = "ggraph_base"
# where each type's f16 scales sit in a block (set to a small finite value; the rest random)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
_IMPORT = re.compile(r"\bggraph(?=[.\s])")


def extract(base: str) -> str:
    """The folder holding `ggraph_base`, the revision `base` with its imports renamed."""
    got = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", "--quiet",
                          f"{base}^{{commit}}"], text=True, capture_output=True)
    if got.returncode != 0:
        raise SystemExit(f"ab_revision: --base {base!r} names no commit of {REPO}")
    sha = got.stdout.strip()
    root = os.path.join(os.path.expanduser("~/.cache/ggraph/ab"), sha)
    pkg = os.path.join(root, NAME)
    if os.path.isfile(os.path.join(pkg, "__init__.py")):
        return root
    tmp = tempfile.mkdtemp(prefix="ab_")
    try:
        tar = os.path.join(tmp, "src.tar")
        subprocess.run(["git", "-C", REPO, "archive", "-o", tar, sha], check=True)
        with tarfile.open(tar) as t:
            t.extractall(os.path.join(tmp, "src"), filter="data")
        out = os.path.join(tmp, NAME)
        shutil.copytree(os.path.join(tmp, "src", "ggraph"), out)
        for sub, folder in ROOTS.items():
            if folder:
                shutil.copytree(os.path.join(tmp, "src", folder), os.path.join(out, sub))
        for d, _, files in os.walk(out):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    with open(p, encoding="utf-8") as fh:
                        text = fh.read()
                    with open(p, "w", encoding="utf-8") as fh:
                        fh.write(_IMPORT.sub(NAME, text))
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(pkg, ignore_errors=True)
        os.replace(out, pkg)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _mv_side(pkg: Any, type_name: str, wbytes: np.ndarray, k: int, m: int, n: int,
             copies: int, threads: int) -> dict[str, Any]:
    import importlib

    T = importlib.import_module(pkg.__name__ + ".ir.types").GGMLType
    backends = importlib.import_module(pkg.__name__ + ".backends")
    ctx = pkg.Context()
    x = ctx.new_tensor(T.F32, (k, n), "x").set_input()
    outs = []
    for i in range(copies):
        w = ctx.new_tensor(T[type_name], (k, m), f"w{i}")
        w.data = np.array(wbytes, copy=True)   # its own memory
        outs.append(pkg.ops.mul_mat(w, x))
    be = backends.get_backend("cpu", n_threads=threads, adaptive=False, weights=OwnBytes())
    return {"x": x, "outs": outs, "graph": pkg.build_graph(*outs), "session": be.session()}


def run_mv(args: argparse.Namespace, base: Any, head: Any) -> dict[str, Any]:
    import numba
    from ggraph.ir.types import TYPE_RECORDS, GGMLType

    rec = TYPE_RECORDS[GGMLType[args.type]]
    k, m = args.shape
    if k % rec.block_size:
        raise SystemExit(f"ab_revision: --shape {k}x{m}: K must be a multiple of "
                         f"{args.type}'s {rec.block_size}")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (m * (k // rec.block_size), rec.type_size), dtype=np.uint8)
    for at in F16_FIELDS[args.type]:
        blocks[:, at:at + 2] = np.array([0.001], np.float16).view(np.uint8)
    wbytes = blocks.reshape(m, -1)
    copies = max(1, (args.mib << 20) // wbytes.nbytes)
    numba.set_num_threads(args.threads)
    sides = {"base": _mv_side(base, args.type, wbytes, k, m, args.cols, copies, args.threads),
             "head": _mv_side(head, args.type, wbytes, k, m, args.cols, copies, args.threads)}
    x = rng.standard_normal((args.cols, k)).astype(np.float32)
    for s in sides.values():   # packs, then one warm run
        for _ in range(2):
            s["session"].run(s["graph"], {s["x"]: x})
    a, b = (np.array(s["session"].read(s["outs"][0])) for s in sides.values())
    if not np.array_equal(a, b):
        print(f"ab_revision: the two sides differ (max |diff| {float(np.max(np.abs(a - b)))})")
    times: dict[str, list[float]] = {k_: [] for k_ in sides}
    for r in range(args.rounds):
        for name in _turns(r):
            s = sides[name]
            t0 = time.perf_counter()
            s["session"].run(s["graph"], {s["x"]: x})
            times[name].append(time.perf_counter() - t0)
    gbs = {n: [copies * wbytes.nbytes / t / 1e9 for t in v] for n, v in times.items()}
    ratios = [tb / th for tb, th in zip(times["base"], times["head"])]
    print(f"{args.type} {k}x{m} x {args.cols} column(s), {args.threads} thread(s), {copies} copies "
          f"({copies * wbytes.nbytes / 2**20:.0f} MiB), {args.rounds} rounds: base "
          f"{statistics.median(gbs['base']):.2f} GB/s (best {max(gbs['base']):.2f}), working "
          f"tree {statistics.median(gbs['head']):.2f} (best {max(gbs['head']):.2f}); paired "
          f"speedup {statistics.median(ratios):.3f}, faster in "
          f"{sum(r_ > 1 for r_ in ratios)}/{len(ratios)}")
    spells = by_spell(times["base"], times["head"], ratios)
    print(f"  by spell: {spell_line(spells, '{:.3f}x')}")
    return {"same_result": bool(np.array_equal(a, b)), "copies": copies,
            "gbs": gbs, "paired_speedup_median": statistics.median(ratios),
            "paired_speedup_by_spell": spells}


def _turns(i: int) -> tuple[str, str]:
    """Round i's order of the two sides: alternating, so neither always runs first."""
    return ("base", "head") if i % 2 == 0 else ("head", "base")


def _engines(args: argparse.Namespace, base: Any, head: Any, **config: Any) -> dict[str, Any]:
    """An engine of args.model from each side's package, on args.threads threads, flash
    attention on, the last token's logits only; `config`: the mode's other EngineConfig
    fields."""
    import importlib

    engines = {}
    for name, pkg in (("base", base), ("head", head)):
        eng = importlib.import_module(pkg.__name__ + ".graphs.runtime.engine")
        engines[name] = eng.Engine(str(args.model), eng.EngineConfig(
            n_threads=args.threads, adaptive_threads=False, reserve_outputs="last",
            flash_attn=True, **config))
    return engines


def run_decode(args: argparse.Namespace, base: Any, head: Any) -> dict[str, Any]:
    engines = _engines(args, base, head, n_ctx=1024)
    for e in engines.values():   # compiles and binds the prompt's and the step's graphs
        e.eval([1, 2, 3, 4])
        e.eval([5])
    ms: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(args.n):
        for name in _turns(i):
            t0 = time.perf_counter()
            engines[name].eval([6 + i % 64])
            ms[name].append((time.perf_counter() - t0) * 1e3)
    d = np.array(ms["base"]) - np.array(ms["head"])
    print(f"{os.path.basename(str(args.model))}, {args.threads} thread(s), {args.n} tokens: base "
          f"median {np.median(ms['base']):.2f} ms, working tree {np.median(ms['head']):.2f}; "
          f"paired (base - working tree) median {np.median(d):+.3f} ms a token, mean "
          f"{d.mean():+.3f}; working tree faster on {np.mean(d > 0):.0%} of tokens")
    spells = by_spell(ms["base"], ms["head"], list(d))
    print(f"  by spell: {spell_line(spells, '{:+.3f} ms')}")
    return {"ms": ms, "paired_median_ms": float(np.median(d)), "paired_mean_ms": float(d.mean()),
            "paired_median_ms_by_spell": spells}


def run_prompt(args: argparse.Namespace, base: Any, head: Any) -> dict[str, Any]:
    engines = _engines(args, base, head, n_ctx=max(1024, args.p), n_ubatch=args.p)
    prompt = [int(x) for x in np.random.default_rng(0).integers(100, 30000, args.p)]
    for e in engines.values():   # compiles and binds the prompt's graph
        e.eval(prompt)
    tps: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(args.rounds):
        for name in _turns(i):
            engines[name].reset()
            t0 = time.perf_counter()
            engines[name].eval(prompt)
            tps[name].append(args.p / (time.perf_counter() - t0))
    ratios = [h / b for b, h in zip(tps["base"], tps["head"])]
    print(f"{os.path.basename(str(args.model))}, {args.threads} thread(s), {args.p}-token prompt, "
          f"{args.rounds} rounds: base median {np.median(tps['base']):.2f} tok/s, working tree "
          f"{np.median(tps['head']):.2f}; paired speedup {np.median(ratios):.3f}, faster in "
          f"{sum(r > 1 for r in ratios)}/{len(ratios)}")
    return {"tok_s": tps, "paired_speedup_median": float(np.median(ratios))}


def _count(text: str) -> int:
    """argparse type of the counts (tokens, rounds, columns, MiB): a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _shape(text: str) -> tuple[int, int]:
    """argparse type of --shape: "KxM", two positive integers."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected KxM, two positive integers (such as "
                                         f"1536x8960), got {text!r}")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False, parents=[threads_option(1), out_option("")])
    common.add_argument("--base", default="HEAD",
                        help="the revision to compare with (default HEAD)")
    sub = ap.add_subparsers(dest="what", required=True)
    mv = sub.add_parser("mv", help="a cold mat-vec of one weight type", parents=[common])
    mv.add_argument("--type", default="Q4_K", choices=sorted(F16_FIELDS))
    mv.add_argument("--shape", type=_shape, default=(1536, 8960),
                    help="KxM (default 1536x8960)")
    mv.add_argument("--cols", type=_count, default=1,
                    help="activation columns (default 1, a decode step; 512: a prompt's product)")
    mv.add_argument("--mib", type=_count, default=400,
                    help="MiB of weight copies (default 400)")
    mv.add_argument("--rounds", type=_count, default=30)
    dec = sub.add_parser("decode", help="decode tokens of a model",
                         parents=[common, model_option("qwen2.5-coder-1.5b")])
    dec.add_argument("-n", type=_count, default=150, help="decode tokens each side times")
    pp = sub.add_parser("prompt", help="one ubatch of a prompt of a model",
                        parents=[common, model_option("qwen2.5-coder-1.5b")])
    pp.add_argument("-p", type=_count, default=512, help="prompt tokens, one ubatch (default 512)")
    pp.add_argument("--rounds", type=_count, default=6)
    args = ap.parse_args()

    sys.path.insert(0, extract(args.base))
    import ggraph
    base = __import__(NAME)
    run = {"mv": run_mv, "decode": run_decode, "prompt": run_prompt}[args.what]
    result = run(args, base, ggraph)
    if args.out:
        write_results(args.out, None, args=args, extra={"base": args.base, **result})


if __name__ == "__main__":
    main()
