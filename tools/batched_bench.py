"""`ggraph batched-bench`: llama.cpp's llama-batched-bench. For every prompt size (-npp),
generation length (-ntg) and number of parallel sequences (-npl): B prompts evaluated in one
batch (T_PP), then TG steps that decode one token of each of the B sequences together (T_TG),
in a KV cache of -c cells (runs that need more are left out): a stream of pad256(-c / max B)
cells per sequence, as llama-batched-bench by default, or one unified stream with -kvu.

    ggraph batched-bench -m MODEL -npp 128 -ntg 64 -npl 1,2,4,8 [-c 4096] [-pps] [-tgs]
                         [-kvu] [-t N] [-fa on|off] [-b 2048] [-ub 512] [-ctk f16] [-ctv f16]
                         [--vs llama.cpp] [--llama-bin PATH] [--json PATH] [--no-warmup]
                         [--progress]

The table is llama-batched-bench's (PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, T, S). With
`--vs llama.cpp` llama.cpp's own llama-batched-bench runs the same settings in this run (as a
program: ../shared/tools/llamacpp-tools.sh builds it; with -kvu or -no-kvu as ggraph's cache),
its table follows, and a last table gives ggraph / llama.cpp per run. --json writes every row,
the machine and the command. -pps shares one prompt among the sequences (seq_cp); -tgs
generates for the sequences one after the other. Each run's shapes are evaluated once
untimed first (numba compiles a new shape's kernels there; --no-warmup skips it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Sequence

HEAD = ("|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |"
        % ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"))
RULE = "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"


def register(sub: argparse._SubParsersAction) -> None:
    from ggraph.tools.common.defaults import (N_BATCH, add_context_flags, add_flash_attn_flag,
                                              add_threads_flag)

    p = sub.add_parser("batched-bench", help="batched decoding speed (llama-batched-bench)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("-m", "--model", default="default", help="GGUF path or model name (default: default)")
    add("-npp", default="128", help="prompt sizes, comma-separated (default 128)")
    add("-ntg", default="128", help="generation lengths (default 128)")
    add("-npl", default="1,2,4,8", help="parallel sequences (default 1,2,4,8)")
    add("-pps", action="store_true", help="one prompt shared by the sequences")
    add("-tgs", action="store_true", help="the sequences generate one after the other")
    add("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=False,
        help="one unified KV cache for every sequence (default: a stream per sequence, as "
        "llama-batched-bench)")
    add("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
        help="a KV cache stream per sequence (the default)")
    add_context_flags(p)
    add("-b", "--batch-size", type=int, default=N_BATCH, help=f"(default {N_BATCH})")
    add("-ctk", "--cache-type-k", default="f16")
    add("-ctv", "--cache-type-v", default="f16")
    add_flash_attn_flag(p)
    add_threads_flag(p)
    add("--vs", choices=("llama.cpp",), help="run llama.cpp's llama-batched-bench too")
    add("--llama-bin", metavar="PATH", help="the llama-batched-bench program (default: "
        "$GGRAPH_LLAMA_BIN, PATH, or ~/.cache/llamacpp-tools/build/bin)")
    add("--json", metavar="PATH", help="write the rows, machine and command as JSON")
    add("--no-warmup", action="store_true", help="no untimed run of each run's shapes first "
        "(numba compiles a new shape's kernels there)")
    add("--progress", action="store_true", help="say on standard error which run is timed")
    p.set_defaults(func=run)


def sizes(flag: str, text: str, lo: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < lo:
        raise ValueError(f"{flag} values must be >= {lo}, got {text!r}")
    return vals


def table(rows: Sequence[Any], title: str) -> list[str]:
    out = [title, "", HEAD, RULE]
    for r in rows:
        out.append("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |"
                   % (r.pp, r.tg, r.pl, r.n_kv, r.t_pp, r.s_pp, r.t_tg, r.s_tg, r.t, r.s))
    return out + [""]


def ratios(ours: Sequence[Any], peer: Sequence[Any]) -> list[str]:
    by = {(r.pp, r.tg, r.pl): r for r in peer}
    out = ["ggraph / llama.cpp", "", "|%6s | %6s | %4s | %10s | %10s | %10s |"
           % ("PP", "TG", "B", "S_PP", "S_TG", "S"), "|-------|--------|------|------------|"
           "------------|------------|"]
    for r in ours:
        q = by.get((r.pp, r.tg, r.pl))
        if q is None:
            continue
        out.append("|%6d | %6d | %4d | %9.2fx | %9.2fx | %9.2fx |"
                   % (r.pp, r.tg, r.pl, r.s_pp / q.s_pp, r.s_tg / q.s_tg, r.s / q.s))
    return out + [""]


def run(args: argparse.Namespace) -> int:
    from ggraph.graphs.eval.batched_bench import (batched_bench, find_llama_batched_bench,
                                                  llama_cpp_command, llama_cpp_rows)
    from ggraph.graphs.eval.bench import load_average, machine_info
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.tools.common.defaults import check_threads, flash_attn_on

    npp, ntg = sizes("-npp", args.npp, 1), sizes("-ntg", args.ntg, 0)
    npl = sizes("-npl", args.npl, 1)
    if args.ctx_size < 1 or args.ubatch_size < 1 or args.batch_size < 1:
        raise ValueError("-c, -ub and -b must be >= 1")
    threads = check_threads(args.threads)
    flash = flash_attn_on(args.fa)
    binary = find_llama_batched_bench(args.llama_bin) if args.vs else None
    with contextlib.redirect_stdout(sys.stderr):   # a download's messages are not output
        path = resolve_model(args.model)
    machine = machine_info()
    n_threads = threads or machine.n_cpus
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.progress else None
    start = load_average()
    eng = Engine(path, EngineConfig(n_ctx=args.ctx_size, n_ubatch=args.ubatch_size,
                                    type_k=args.cache_type_k, type_v=args.cache_type_v,
                                    flash_attn=flash, n_threads=threads, n_seq_max=max(npl),
                                    kv_unified=args.kv_unified, adaptive_threads=False))
    kvu = int(args.kv_unified)
    print(f"main: n_kv_max = {args.ctx_size}, n_batch = {args.batch_size}, n_ubatch = "
          f"{args.ubatch_size}, flash_attn = {int(flash)}, is_pp_shared = {int(args.pps)}, "
          f"is_tg_separate = {int(args.tgs)}, n_threads = {n_threads}, kv_unified = {kvu}\n")
    ours = batched_bench(eng, npp, ntg, npl, args.pps, args.tgs, args.batch_size,
                         progress=say, warmup=not args.no_warmup)
    del eng
    lines = table(ours, "ggraph")
    peer: list[Any] = []
    cmd: list[str] = []
    if binary:
        cmd = llama_cpp_command(binary, path, npp, ntg, npl, args.ctx_size, n_threads, flash,
                                args.pps, args.tgs, args.kv_unified, args.batch_size,
                                args.ubatch_size)
        if say:
            say("batched-bench: llama.cpp: " + " ".join(cmd))
        peer = llama_cpp_rows(cmd, expect=len(ours))
        flag = "-kvu" if args.kv_unified else "-no-kvu"
        lines += table(peer, f"llama.cpp (llama-batched-bench {flag})") + ratios(ours, peer)
    end = load_average()
    lines.append(f"cpu: {machine.line}")
    lines.append("load average (1, 5, 15 min), start / end: "
                 f"{' '.join(f'{x:.2f}' for x in start)} / {' '.join(f'{x:.2f}' for x in end)}")
    print("\n".join(lines))
    if args.json:
        rec = {"machine": machine.line, "threads": n_threads, "flash_attn": flash,
               "kv_unified": args.kv_unified,
               "n_ctx": args.ctx_size, "n_batch": args.batch_size, "n_ubatch": args.ubatch_size,
               "pps": args.pps, "tgs": args.tgs, "model": path, "load_start": start,
               "load_end": end, "ggraph": [r.as_dict() for r in ours],
               "llama.cpp": [r.as_dict() for r in peer], "llama.cpp command": cmd}
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0
