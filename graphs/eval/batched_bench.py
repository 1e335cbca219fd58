"""Batched decoding speed in llama-batched-bench's terms (tools/batched-bench of llama.cpp):
for every prompt size PP, generation length TG and number of parallel sequences B, the time
to evaluate B prompts of PP random tokens (T_PP), then TG steps of one token for each of the B
sequences in one batch (T_TG), from an empty cache.

As llama-batched-bench: with `pps` one prompt is evaluated and shared by the B sequences
(seq_cp); with `tgs` the sequences generate one after the other instead of together; a batch
is decoded n_batch tokens at a time; a run that needs more cells than the context holds is
left out; N_KV counts the cells the run fills; S_PP = prompt tokens / T_PP, S_TG = B * TG /
T_TG, S = all tokens / (T_PP + T_TG). A warmup of 16 tokens comes first.

The peer is llama.cpp's own llama-batched-bench, run as a program on the same model and
settings (`llama_cpp_rows`): its jsonl records parsed into the same rows. This file owns the
measuring and the rows; tools/batched_bench.py owns the command line and the table.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ggraph.graphs.models.batch import Batch

BUILD_HINT = ("build it with ../shared/tools/llamacpp-tools.sh (llama.cpp's programs from "
              "llama-cpp-python's source package), or name it with --llama-bin")


@dataclass
class BatchedRow:
    """One line of llama-batched-bench's table."""
    pp: int
    tg: int
    pl: int
    n_kv: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float
    t: float
    s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cells_needed(pp: int, tg: int, pl: int, pps: bool, unified: bool = True) -> int:
    """llama-batched-bench's n_ctx_req: the cells a run fills."""
    if pps:
        return (pp if unified else pl * pp) + pl * tg
    return pl * (pp + tg)


def runs(npp: Sequence[int], ntg: Sequence[int], npl: Sequence[int]) -> list[tuple[int, int, int]]:
    """(pp, tg, pl) in llama-batched-bench's order."""
    return [(pp, tg, pl) for pp in npp for tg in ntg for pl in npl]


def batched_bench(engine: Any, npp: Sequence[int], ntg: Sequence[int], npl: Sequence[int],
                  pps: bool = False, tgs: bool = False, n_batch: int = 2048, seed: int = 0,
                  progress: Callable[[str], None] | None = None, warmup: bool = True
                  ) -> list[BatchedRow]:
    """Time every (pp, tg, pl) run on `engine` (an Engine whose cache holds max(npl)
    sequences: EngineConfig.n_seq_max). With `warmup`, each run's prompt batch and one of its
    generation steps are evaluated once untimed first, as llama-bench runs each test once:
    numba compiles a new shape's kernels there (llama.cpp has nothing to compile)."""
    n_vocab = engine.model.hp.n_vocab
    if max(npl) > engine.cfg.n_seq_max:
        raise ValueError(f"-npl {max(npl)} needs a cache of {max(npl)} sequences; the engine "
                         f"holds {engine.cfg.n_seq_max}")
    rng = np.random.default_rng(seed)
    unified = engine.cache.n_stream == 1

    def rand(n: int) -> list[int]:
        return [int(x) for x in rng.integers(0, n_vocab, n)]

    def decode(toks: list[int], seqs: list[int], pos: list[int], out: list[bool]) -> None:
        for a in range(0, len(toks), n_batch):
            b = a + n_batch
            engine.decode(Batch(toks[a:b], pos[a:b], [(s,) for s in seqs[a:b]], out[a:b]))

    engine.reset()
    decode(rand(16), [0] * 16, list(range(16)), [False] * 16)   # warm up (compiles)
    rows = []
    for pp, tg, pl in runs(npp, ntg, npl):
        if cells_needed(pp, tg, pl, pps, unified) > engine.cfg.n_ctx or \
                (not unified and pp + tg > engine.n_ctx_seq):   # (a sequence fills its stream)
            continue
        if progress:
            progress(f"batched-bench: PP {pp}, TG {tg}, B {pl}")
        n_prompts = 1 if pps else pl
        toks, seqs, pos, out = [], [], [], []
        for j in range(n_prompts):
            toks += rand(pp)
            seqs += [j] * pp
            pos += list(range(pp))
            out += [i == pp - 1 for i in range(pp)]
        if warmup:
            engine.reset()
            decode(toks, seqs, pos, out)
            for j in range(1, pl if pps else 0):
                engine.seq_cp(0, j)
            n_step = 1 if tgs else pl
            decode(rand(n_step), list(range(n_step)), [pp] * n_step, [True] * n_step)
        engine.reset()
        t0 = time.perf_counter()
        decode(toks, seqs, pos, out)
        t_pp = time.perf_counter() - t0
        if pps:
            for j in range(1, pl):
                engine.seq_cp(0, j)
        t0 = time.perf_counter()
        if tgs:
            for j in range(pl):
                for i in range(tg):
                    decode(rand(1), [j], [pp + i], [True])
        else:
            for i in range(tg):
                decode(rand(pl), list(range(pl)), [pp + i] * pl, [True] * pl)
        t_tg = time.perf_counter() - t0
        n_pp = pp if pps else pl * pp
        t = t_pp + t_tg
        rows.append(BatchedRow(pp, tg, pl, cells_needed(pp, tg, pl, pps, unified), t_pp,
                               n_pp / t_pp, t_tg, pl * tg / t_tg if t_tg else 0.0, t,
                               (n_pp + pl * tg) / t))
    engine.reset()
    return rows


def find_llama_batched_bench(given: str | None = None) -> str:
    """The llama-batched-bench program: `given`, else in GGRAPH_LLAMA_BIN (default: where
    ../shared/tools/llamacpp-tools.sh builds it), else on PATH."""
    from ggraph import config

    for cand in (given, str(config.llama_bin() / "llama-batched-bench"),
                 shutil.which("llama-batched-bench")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise FileNotFoundError(f"llama-batched-bench not found: {BUILD_HINT}")


def llama_cpp_command(binary: str, model: str, npp: Sequence[int], ntg: Sequence[int],
                      npl: Sequence[int], n_ctx: int, n_threads: int, flash: bool,
                      pps: bool, tgs: bool, unified: bool, n_batch: int, n_ubatch: int
                      ) -> list[str]:
    join = lambda v: ",".join(str(x) for x in v)  # noqa: E731
    cmd = [binary, "-m", model, "-npp", join(npp), "-ntg", join(ntg), "-npl", join(npl),
           "-c", str(n_ctx), "-t", str(n_threads), "-tb", str(n_threads),
           "-b", str(n_batch), "-ub", str(n_ubatch), "-fa", "on" if flash else "off",
           "--output-format", "jsonl", "-ngl", "0"]
    cmd += ["-kvu"] if unified else ["-no-kvu"]
    cmd += ["-pps"] if pps else []
    cmd += ["-tgs"] if tgs else []
    return cmd


def parse_llama_cpp(text: str) -> list[BatchedRow]:
    """llama-batched-bench's jsonl records as rows (other lines are its log)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and '"speed_tg"' in line):
            continue
        # printf's inf / nan (a run too short for the clock) are not JSON
        r = json.loads(re.sub(r":\s*(-?)inf\b", r": \1Infinity", line).replace(": nan", ": NaN"))
        rows.append(BatchedRow(r["pp"], r["tg"], r["pl"], r["n_kv"], r["t_pp"], r["speed_pp"],
                               r["t_tg"], r["speed_tg"], r["t"], r["speed"]))
    return rows


def llama_cpp_rows(cmd: list[str], timeout: float = 3600.0, tries: int = 3,
                   expect: int | None = None) -> list[BatchedRow]:
    """Run llama-batched-bench and parse its records; a failure is one line with its exit
    status and the last of its output. Its log is written by a thread, and a short run
    sometimes ends before the thread writes everything: seen 1 in ~50 on a tiny model with
    nothing printed, and with the last record missing. So a run that exits 0 having printed
    none of its log, or fewer records than `expect` (the runs that fit its context: as many
    as ggraph's side made), is run again, up to `tries` runs."""
    for _ in range(tries):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rows = parse_llama_cpp(proc.stdout + "\n" + proc.stderr)
        if proc.returncode != 0:
            break
        if expect is not None:
            if len(rows) >= expect:
                break
        elif rows or "n_kv_max" in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0 or not rows:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-batched-bench exited with status {proc.returncode}: "
                           f"{tail[0][:300]}")
    if expect is not None and len(rows) < expect:
        raise RuntimeError(f"llama-batched-bench printed {len(rows)} of its {expect} records "
                           f"in each of {tries} runs (exit status 0)")
    return rows
