"""Time to the first token and peak memory, each from a fresh process: ggraph with a cold
numba kernel cache (a new, empty NUMBA_CACHE_DIR: every kernel compiles), ggraph with a warm
one (the cold run filled it), and llama.cpp through llama-cpp-python.

A child process does what a user's first run does: import the library, load the model
(ggraph's Engine without its load-time warmup, llama-cpp-python's Llama, which has none: so
kernel compilation shows where it happens), tokenize a fixed code prompt cut to
`--prompt-tokens` tokens, evaluate it and take the greedy first token, then evaluate that
token (the first decode step: what only decoding uses compiles there on a cold cache) for
the second. Every milestone is wall time on the system's monotonic clock from the moment the
parent started the child, so the interpreter's start counts too. Both engines run with the
same threads (-t), flash attention (-fa), context (-c) and ubatch (512).

Per run: the seconds to import, to load, to the first and to the second token, and the
stages between them (prompt eval, first decode step); the CPU seconds to the first token
(on a shared machine wall time stretches with the load, CPU time much less); the peak
resident memory (VmHWM) and, at each milestone, its anonymous and file-backed parts (mapped
weights count as file pages once read; a repacked copy of them is anonymous); for ggraph,
the numba functions compiled (all, and the outermost ones: a kernel compiles its helpers
inside itself), each one's seconds and their sum (backends/compiles.py). The JSON records
the commit of the code measured (and whether the checkout had uncommitted changes).
The GGUF is read once before the first run, so every run finds it in the OS page cache: cold
and warm here are numba's kernel cache, not the disk.

    python benchmarks/ttft.py [-m qwen2.5-coder-1.5b] [-t 2] [-fa on] [-c 4096]
                              [--prompt-tokens 32] [--runs 1] [--skip llama.cpp]
                              [--json benchmarks/results/ttft.json]
    python benchmarks/ttft.py --profile cold|warm [-m ...]   # cProfile of one ggraph child

A table on stdout and the JSON (with the CPU, graphs/eval/bench.py's machine_info) are the output.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

# benchlib.py imports only the standard library: nothing before a child's first milestone
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, code_version, command_line, import_llama_cpp, llama_cpp_model,
                    model_option, out_option, print_table, results_path, threads_option,
                    write_results)

# long enough for any tokenizer to give --prompt-tokens tokens; the same text on both engines
PROMPT = ("def quicksort(items: list[int]) -> list[int]:\n"
          "    \"\"\"Sort a list of integers with the quicksort algorithm and return a new "
          "list.\"\"\"\n    if len(items) <= 1:\n        return items\n"
          "    pivot = items[len(items) // 2]\n    left = [x for x in items if x < pivot]\n"
          "    middle = [x for x in items if x == pivot]\n"
          "    right = [x for x in items if x > pivot]\n"
          "    return quicksort(left) + middle + quicksort(right)\n")
VARIANTS = ("ggraph cold", "ggraph warm", "llama.cpp")


# -- the child: one first run, milestones on stdout ---------------------------------------------
def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon and RssFile from /proc/self/status, in KiB (empty elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


class Stamps(dict):
    """Milestone -> monotonic time; `status` keeps the memory (proc_status) at each, to tell
    where it grows: taken while the model is still loaded, not after it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.status: dict[str, dict[str, int]] = {}

    def __call__(self, name: str) -> None:
        self[name] = time.monotonic()
        self.status[name] = proc_status()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread): on a shared machine
    the wall times stretch with the load, the CPU time much less."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def child_ggraph(a: argparse.Namespace, stamps: Stamps,
                 cpu: dict[str, float]) -> dict[str, Any]:
    import numpy as np

    from ggraph.backends.compiles import counting
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    stamps("import")
    with counting() as compiles:
        eng = Engine(a.model, EngineConfig(
            n_ctx=a.ctx, n_ubatch=512, flash_attn=a.fa == "on", n_threads=a.threads,
            adaptive_threads=False, warmup=False))
        stamps("load")
        ids = eng.tokenizer.encode(PROMPT)[:a.prompt_tokens]
        first = int(np.argmax(eng.eval(ids)))
        stamps("first")
        cpu["first"] = cpu_seconds()
        c_first = (compiles.count, compiles.kernels, compiles.seconds)
        second = int(np.argmax(eng.eval([first])))
        stamps("second")
    return dict(tokens=[first, second], n_prompt=len(ids), compiled=compiles.count,
                compiled_kernels=compiles.kernels, compile_s=compiles.seconds,
                compiled_by_first=c_first[1], compile_s_by_first=c_first[2],
                compiled_each=[[n, round(dt, 3)] for n, dt in compiles.each])


def child_llama_cpp(a: argparse.Namespace, stamps: Stamps,
                    cpu: dict[str, float]) -> dict[str, Any]:
    import numpy as np

    llama_cpp = import_llama_cpp()
    stamps("import")
    llm = llama_cpp_model(a.model, n_ctx=a.ctx, n_batch=512, n_ubatch=512, threads=a.threads,
                          flash_attn=a.fa == "on")
    stamps("load")
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:   # Llama keeps no scores without logits_all
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(n_vocab,))

    ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)[:a.prompt_tokens]
    llm.eval(ids)
    first = int(np.argmax(last_logits()))
    stamps("first")
    cpu["first"] = cpu_seconds()
    llm.eval([first])
    second = int(np.argmax(last_logits()))
    stamps("second")
    return dict(tokens=[first, second], n_prompt=len(ids))


def child(a: argparse.Namespace) -> None:
    stamps = Stamps()
    stamps("main")
    cpu: dict[str, float] = {}
    out = (child_llama_cpp if a.child == "llama.cpp" else child_ggraph)(a, stamps, cpu)
    out.update(stamps=dict(stamps), memory_kib=stamps.status, cpu_first_s=cpu["first"],
               cpu_s=cpu_seconds())
    print("TTFT " + json.dumps(out), flush=True)


# -- the parent: runs, table, JSON --------------------------------------------------------------
def run_child(a: argparse.Namespace, engine: str, env: dict[str, str],
              profile: str | None = None) -> dict[str, Any]:
    """One fresh process; its milestones as seconds since it was started."""
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-s", "cumulative"]
    cmd += [os.path.abspath(__file__), "--child", engine, "-m", a.model, "-t", str(a.threads),
            "-fa", a.fa, "-c", str(a.ctx), "--prompt-tokens", str(a.prompt_tokens)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"ttft: the {engine} child failed ({p.returncode}):\n{p.stderr[-3000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("TTFT "))
    r = json.loads(line[5:])
    st = {k: v - t0 for k, v in r.pop("stamps").items()}
    mem = r.pop("memory_kib")
    status = mem["second"]   # the model still loaded
    r["anon_mib_at"] = {k: round(v.get("RssAnon", 0) / 1024) for k, v in mem.items()}
    r["file_mib_at"] = {k: round(v.get("RssFile", 0) / 1024) for k, v in mem.items()}
    r.update(start_s=st["main"], import_s=st["import"] - st["main"],
             load_s=st["load"] - st["import"], prompt_s=st["first"] - st["load"],
             decode_s=st["second"] - st["first"], loaded_at_s=st["load"],
             first_token_s=st["first"], second_token_s=st["second"],
             peak_rss_mib=status.get("VmHWM", 0) / 1024,
             rss_anon_mib=status.get("RssAnon", 0) / 1024,
             rss_file_mib=status.get("RssFile", 0) / 1024)
    if profile:
        r["profile"] = p.stdout
    return r


def read_through(path: str) -> None:
    """Read the file once, so that every run finds it in the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def measure(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for i in range(a.runs):
        cache = tempfile.mkdtemp(prefix="ggraph-ttft-numba-")
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        try:
            for name in VARIANTS:
                if name in a.skip or (name == "ggraph warm" and "ggraph cold" in a.skip):
                    continue
                engine = "llama.cpp" if name == "llama.cpp" else "ggraph"
                print(f"ttft: run {i + 1}/{a.runs}: {name}", file=sys.stderr, flush=True)
                # cold: the empty cache; warm: the same cache, filled by the cold run
                rows.append(dict(variant=name, run=i + 1, **run_child(a, engine, env)))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return rows


COLUMNS = [Column("variant", "", width=12, align="<"),
           Column("import_s", "import s", "{:.2f}", 8), Column("load_s", "load s", "{:.2f}", 7),
           Column("prompt_s", "prompt s", "{:.2f}", 8),
           Column("first_token_s", "1st token s", "{:.2f}", 11),
           Column("decode_s", "decode s", "{:.2f}", 8),
           Column("second_token_s", "2nd token s", "{:.2f}", 11),
           Column("cpu_first_s", "CPU s to 1st", "{:.1f}", 12),
           Column("peak_rss_mib", "peak RSS MiB", "{:.0f}", 12),
           Column("rss_anon_mib", "anon MiB", "{:.0f}", 8),
           Column("rss_file_mib", "file MiB", "{:.0f}", 8),
           Column("compiled_kernels", "compiled", "{}", 8),
           Column("compile_s", "compile s", "{:.1f}", 9)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[model_option("qwen2.5-coder-1.5b"),
                                          threads_option(2, help="threads on both (default 2)"),
                                          out_option(results_path("ttft.json"))])
    ap.add_argument("-fa", "--flash-attn", dest="fa", choices=("on", "off"), default="on",
                    help="flash attention on both (default on)")
    ap.add_argument("-c", "--ctx-size", dest="ctx", type=int, default=4096,
                    help="context on both (default 4096, llama-cli's)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    ap.add_argument("--runs", type=int, default=1, help="cold/warm/llama.cpp rounds")
    ap.add_argument("--skip", action="append", default=[], choices=VARIANTS,
                    help="leave a variant out")
    ap.add_argument("--profile", choices=("cold", "warm"),
                    help="print the cProfile of one ggraph child instead (cold: a new cache)")
    ap.add_argument("--child", choices=("ggraph", "llama.cpp"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for flag, v, lo in (("-t/--threads", a.threads, 1), ("--prompt-tokens", a.prompt_tokens, 1),
                        ("--runs", a.runs, 1), ("-c/--ctx-size", a.ctx, 2)):
        if v < lo:
            ap.error(f"{flag} must be >= {lo}, got {v}")
    if a.prompt_tokens + 1 > a.ctx:
        ap.error(f"--prompt-tokens {a.prompt_tokens} and a generated token need -c > "
                 f"{a.prompt_tokens}")
    if a.child:
        child(a)
        return
    from ggraph.graphs.eval.bench import machine_info

    read_through(a.model)
    if a.profile:
        env = dict(os.environ)
        cache = None
        if a.profile == "cold":
            cache = env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="ggraph-ttft-numba-")
        try:
            r = run_child(a, "ggraph", env, profile=a.profile)
        finally:
            if cache:
                shutil.rmtree(cache, ignore_errors=True)
        print(r.pop("profile")[:12000])
        print(json.dumps(r))
        return
    rows = measure(a)
    m = machine_info()
    print(f"{os.path.basename(a.model)}: {a.prompt_tokens}-token prompt, -t {a.threads}, "
          f"-fa {a.fa}, -c {a.ctx}; seconds from process start (import, load, prompt and "
          f"decode are the stages between); anon and file: resident MiB at the second token; "
          f"compiled: numba kernels (outermost) and their seconds\n")
    print_table(rows, COLUMNS, markdown=True)
    print(f"\ncpu: {m.line}")
    firsts = {r["variant"]: r["tokens"][0] for r in rows}
    if len(set(firsts.values())) > 1:
        print(f"note: the first tokens differ: {firsts}")
    write_results(a.out, rows, args=a, argv=argv, extra=dict(
        model=os.path.basename(a.model), threads=a.threads, flash_attn=a.fa == "on",
        n_ctx=a.ctx, prompt_tokens=a.prompt_tokens, cpu=m.line, code=code_version(),
        load_avg=list(os.getloadavg()), command=command_line(argv)))


if __name__ == "__main__":
    main()
