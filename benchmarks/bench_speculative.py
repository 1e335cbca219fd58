"""Speculative decoding against llama.cpp's, on the same prompts and in the same run:
Qwen2.5-Coder 1.5B (the target) with Qwen2.5-Coder 0.5B as the draft, greedy.

Per code prompt, for each engine: the target alone (tokens/s of its decoding), the target
with the draft (tokens/s, the drafted and accepted tokens), and the speed-up, which is what
speculative decoding is for. ggraph's speculative text must be its target's own greedy text,
token for token (checked; a mismatch is reported). llama.cpp runs as its programs:
llama-completion for the target alone and llama-speculative-simple with -md (both built by
../shared/tools/llamacpp-tools.sh; `llama-speculative-simple` is not in its default list:
`../shared/tools/llamacpp-tools.sh ~/.cache/llamacpp-tools llama-speculative-simple`).
ggraph's engines are loaded once, and each measurement follows an untimed run of the same
prompt (numba compiles there).

    python benchmarks/bench_speculative.py [-m qwen2.5-coder-1.5b] [-md qwen2.5-coder-0.5b]
        [-n 128] [-t 2] [--draft-max 3] [--skip llama.cpp] [--json PATH]

A table on stdout; the JSON holds every figure, the CPU and the commands.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "def quicksort(arr):\n",
    "# Python: read a CSV file and print the sum of the second column\nimport csv\n",
    "class LinkedList:\n    def __init__(self):\n",
    "// C: reverse a string in place\n#include <string.h>\n\nvoid reverse(char *s) {\n",
]


def ggraph_runs(target: str, draft: str, n: int, threads: int, n_max: int) -> list[dict]:
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.runtime.speculative import SpecParams, Speculator

    cfg = EngineConfig(n_ctx=4096, n_threads=threads, flash_attn=True, adaptive_threads=False,
                       warmup=True)
    tgt, dft = Engine(target, cfg), Engine(draft, cfg)
    spec = Speculator(tgt, dft, SpecParams(n_max=n_max))
    out = []
    for text in PROMPTS:
        prompt = tgt.tokenizer.encode(text)

        def alone() -> tuple[list[int], float]:
            tgt.reset()
            toks, first, t0 = [], None, 0.0
            for tok in tgt.generate(prompt, n, stop_at_eos=False):
                if first is None:   # decoding from the first token on, as llama_perf counts
                    first, t0 = tok, time.perf_counter()
                toks.append(tok)
            return toks, (len(toks) - 1) / (time.perf_counter() - t0)

        def speculative() -> tuple[list[int], float, object]:
            spec.stats.__init__()
            toks, t0 = [], 0.0
            for tok in spec.generate(prompt, n, stop_at_eos=False):
                if not toks:
                    t0 = time.perf_counter()
                toks.append(tok)
            return toks, (len(toks) - 1) / (time.perf_counter() - t0), spec.stats

        alone()                                    # untimed: compiles
        base, base_tps = alone()
        speculative()
        got, spec_tps, st = speculative()
        out.append({"prompt": text, "alone_tps": base_tps, "spec_tps": spec_tps,
                    "speedup": spec_tps / base_tps, "same_tokens": got == base,
                    "n_drafted": st.n_drafted, "n_accept": st.n_accept,
                    "accept_pct": st.accept_pct})
    return out


def llama_runs(bin_dir: Path, target: str, draft: str, n: int, threads: int,
               n_max: int) -> list[dict]:
    out = []
    common = ["-n", str(n), "-t", str(threads), "-c", "4096", "--temp", "0", "-fa", "on",
              "-ngl", "0"]
    for text in PROMPTS:
        base = [str(bin_dir / "llama-completion"), "-m", target, "-p", text, "-no-cnv",
                "--no-display-prompt", *common]
        spec = [str(bin_dir / "llama-speculative-simple"), "-m", target, "-md", draft,
                "-p", text, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max),
                *common]
        r1 = subprocess.run(base, capture_output=True, text=True, timeout=1200)
        m1 = re.search(r"eval time =\s*[\d.]+ ms /\s*(\d+) runs.*?([\d.]+) tokens per second",
                       r1.stderr)
        r2 = subprocess.run(spec, capture_output=True, text=True, timeout=1200)
        m2 = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s",
                       r2.stderr + r2.stdout)
        m3 = re.search(r"n_drafted = (\d+)\s.*?n_accept\s+= (\d+)\s.*?accept\s+= ([\d.]+)%",
                       r2.stderr + r2.stdout, re.S)
        if not (m1 and m2 and m3):
            raise RuntimeError(f"llama.cpp's output not understood (rc {r1.returncode}, "
                               f"{r2.returncode}): {(r2.stderr or r1.stderr)[-300:]}")
        alone_tps, spec_tps = float(m1.group(2)), float(m2.group(3))
        out.append({"prompt": text, "alone_tps": alone_tps, "spec_tps": spec_tps,
                    "speedup": spec_tps / alone_tps, "n_drafted": int(m3.group(1)),
                    "n_accept": int(m3.group(2)), "accept_pct": float(m3.group(3)),
                    "commands": [base, spec]})
    return out


def main() -> int:
    from ggraph import config
    from ggraph.graphs.eval.bench import load_average, machine_info
    from ggraph.graphs.gguf.fetch import resolve_model

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="qwen2.5-coder-1.5b")
    ap.add_argument("-md", default="qwen2.5-coder-0.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--skip", choices=("llama.cpp",), default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    target, draft = resolve_model(a.m), resolve_model(a.md)
    start = load_average()
    ours = ggraph_runs(target, draft, a.n, a.t, a.draft_max)
    peer = [] if a.skip else llama_runs(config.llama_bin(), target, draft, a.n, a.t,
                                        a.draft_max)
    end = load_average()
    print(f"| prompt | ggraph alone t/s | ggraph spec t/s | speed-up | accept | same tokens |"
          f"{' llama.cpp alone | llama.cpp spec | speed-up | accept |' if peer else ''}")
    print("|---|---:|---:|---:|---:|---|" + ("---:|---:|---:|---:|" if peer else ""))
    for i, r in enumerate(ours):
        row = (f"| {i} | {r['alone_tps']:.2f} | {r['spec_tps']:.2f} | {r['speedup']:.2f}x | "
               f"{r['accept_pct']:.1f}% | {'yes' if r['same_tokens'] else 'NO'} |")
        if peer:
            q = peer[i]
            row += (f" {q['alone_tps']:.2f} | {q['spec_tps']:.2f} | {q['speedup']:.2f}x | "
                    f"{q['accept_pct']:.1f}% |")
        print(row)
    machine = machine_info()
    print(f"\ncpu: {machine.line}; threads {a.t}; draft max {a.draft_max}; {a.n} tokens; "
          f"load {start[0]:.2f} -> {end[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine.line, "threads": a.t,
                                            "n": a.n, "draft_max": a.draft_max,
                                            "target": target, "draft": draft,
                                            "ggraph": ours, "llama.cpp": peer,
                                            "load": [start, end]}, indent=1) + "\n")
    return 0 if all(r["same_tokens"] for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
