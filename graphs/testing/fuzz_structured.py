"""The structured fuzz run: the base files, the plan that turns (seed, mutant index) into a
mutant and the settings it runs at, worker processes in parallel, and the unmutated files'
results that outputs are compared with.

Mutant i of seed s is drawn from np.random.default_rng([s, i]): its base (by the bases'
shares), its mutation (graphs/testing/gguf_mutate.py) and `per_mutant` settings among those its
mutation means something with (graphs/testing/fuzz_cases.py's SETTINGS); a share of the mutants run
their first setting through `ggraph run` instead of the API. So a case is reproduced from
the seed and the index alone (scripts/fuzz_gguf.py --seed S --mutant I).

A case's output is compared with the base file's at the same setting and inputs (run once
per such pair, and reported as mutation `none`). A case that times out runs once more in a
fresh worker with three times the limit (the first compilation of a kernel can take tens of
seconds on a loaded machine); only a second timeout counts.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ggraph.graphs.testing.fuzz_cases import SETTINGS, Setting, cli_command, request, run_cli
from ggraph.graphs.gguf.gguf_edit import GGUFParts
from ggraph.graphs.testing.gguf_fuzz import CHATML_TEMPLATE, CaseResult, FuzzReport, Mutant, Worker
from ggraph.graphs.testing.gguf_mutate import Base, Mutation, mutate
from ggraph.graphs.testing.gguf_mutate_inputs import TEMPLATES, deepseek2_writer, dense_writer, gemma3_writer
from ggraph.graphs.gguf.gguf_reader import ValueType

_WORKER = "ggraph.graphs.testing.fuzz_cases"


def structured_bases(dirpath: Path, smollm2: str | None = None
                     ) -> list[tuple[Base, float]]:
    """(base, share of the mutants): tiny llama (Q4_1), qwen2 (Q8_0), qwen3 (F16), gemma3
    (F32, sliding window) and deepseek2 (MLA, MoE), each with a chat template of its family,
    and SmolLM2-135M when its path is given (a few cases: its mutants are 90 MB)."""
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny
    from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2
    from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf as write_gemma3

    templates = dict(TEMPLATES)
    d = Path(dirpath)
    made = [
        ("llama", write_tiny(d / "llama0.gguf", TinyDense(weight_type="q4_1")), CHATML_TEMPLATE,
         dense_writer("llama"), 0.24),
        ("qwen2", write_tiny(d / "qwen20.gguf", TinyDense(arch="qwen2", weight_type="q8_0")),
         CHATML_TEMPLATE, dense_writer("qwen2"), 0.16),
        ("qwen3", write_tiny(d / "qwen30.gguf", TinyDense(arch="qwen3", weight_type="f16")),
         templates["llama3"], dense_writer("qwen3"), 0.16),
        ("gemma3", write_gemma3(d / "gemma30.gguf"), templates["gemma"], gemma3_writer, 0.22),
        ("deepseek2", write_tiny_deepseek2(d / "deepseek20.gguf"), CHATML_TEMPLATE,
         deepseek2_writer, 0.22),
    ]
    out: list[tuple[Base, float]] = []
    for name, path, template, writer, share in made:
        parts = GGUFParts.read(path)
        parts.set("tokenizer.chat_template", template, ValueType.STRING)
        final = d / f"{name}.gguf"
        final.write_bytes(parts.to_bytes())
        out.append((Base(name, str(final), GGUFParts.read(final), writer), share))
    if smollm2:
        out = [(b, s * 0.98) for b, s in out] + [(Base("smollm2", smollm2,
                                                       GGUFParts.read(smollm2)), 0.02)]
    return out


@dataclass
class Planned:
    index: int
    base: Base
    mutation: Mutation
    settings: list[Setting]
    cli: bool                      # the first setting runs through `ggraph run`


def plan_mutant(bases: list[tuple[Base, float]], seed: int, index: int, per_mutant: int = 3,
                kinds: tuple[str, ...] | None = None, cli_share: float = 0.04,
                in_turn: bool = False) -> Planned:
    """Mutant `index` of run `seed`: its base, mutation (its kind drawn, or the index-th in
    turn), settings and way of running."""
    rng = np.random.default_rng([seed, index])
    shares = np.array([s for _, s in bases])
    base = bases[int(rng.choice(len(bases), p=shares / shares.sum()))][0]
    m = mutate(base, rng, kinds, index if in_turn else None)
    fits = [s for s in SETTINGS if not m.prompts or s.prompt in m.prompts]
    picks = rng.choice(len(fits), size=min(per_mutant, len(fits)), replace=False)
    cli = bool(rng.random() < cli_share) and not any(
        k in m.run for k in ("ids", "n_past", "after_load"))
    return Planned(index, base, m, [fits[int(i)] for i in picks], cli)


def _write(path: str, data: bytes) -> None:
    """A fresh copy of a mutant that changes its own file after loading (an after_load
    case), written before each try."""
    with open(path, "wb") as f:
        f.write(data)


class _Lane:
    """One thread's worker process and mutant file."""

    def __init__(self, workdir: str, n: int) -> None:
        self.dir = os.path.join(workdir, f"lane{n}")
        os.makedirs(self.dir)
        self.path = os.path.join(self.dir, "mutant.gguf")
        self.worker = Worker(_WORKER)
        self.retried: list[str] = []   # cases that timed out once, then answered
        self.index = -1                 # the mutant running now

    def api(self, path: str, s: Setting, run: dict[str, Any], timeout: float,
            prepare: Callable[[], None] | None = None) -> tuple[str, str]:
        for limit in (timeout, timeout * 3):
            if prepare is not None:
                prepare()
            t0 = time.monotonic()
            kind, detail = self.worker.ask(request(path, s, run), limit)
            if self.worker.proc.poll() is not None:
                self.worker = Worker(_WORKER)
            if kind != "timeout":
                if limit > timeout:
                    self.retried.append(f"mutant {self.index} [{s.name}, api] {json.dumps(run)[:120]}: {kind} in "
                                        f"{time.monotonic() - t0:.0f} s on the second try")
                return kind, detail
        return kind, detail + " (twice; the second time within three times the limit)"

    def cli(self, path: str, s: Setting, run: dict[str, Any], timeout: float
            ) -> tuple[str, str]:
        argv, stdin = cli_command(path, s, run, self.dir)
        kind, detail = run_cli(argv, stdin, timeout * 2)
        if kind == "timeout":
            t0 = time.monotonic()
            kind, detail = run_cli(argv, stdin, timeout * 6)
            self.retried.append(f"mutant {self.index} [{s.name}, cli] {' '.join(argv[3:])[:160]}: {kind} in "
                                f"{time.monotonic() - t0:.0f} s on the second try")
        return kind, detail

    def close(self) -> None:
        self.worker.close()


class StructuredFuzz:
    def __init__(self, bases: list[tuple[Base, float]], seed: int = 0, per_mutant: int = 3,
                 timeout: float = 60.0, kinds: tuple[str, ...] | None = None,
                 cli_share: float = 0.04, repro: str = "", keep: str | None = None,
                 in_turn: bool = False) -> None:
        self.bases, self.seed, self.per_mutant = bases, seed, per_mutant
        self.timeout, self.kinds, self.cli_share = timeout, kinds, cli_share
        self.in_turn = in_turn   # the mutations' kinds taken in turn, not drawn
        self.repro, self.keep = repro, keep
        self.lock = threading.Lock()
        self.baselines: dict[str, tuple[str, str]] = {}
        self.pending: dict[str, threading.Event] = {}
        self.report = FuzzReport()
        self.retried: list[str] = []   # cases that answered only on their second try

    def plan(self, index: int) -> Planned:
        return plan_mutant(self.bases, self.seed, index, self.per_mutant, self.kinds,
                           self.cli_share, self.in_turn)

    def baseline(self, lane: _Lane, base: Base, s: Setting, run: dict[str, Any], via: str
                 ) -> tuple[str, str]:
        """The base file's result at this setting and inputs, run once (by whichever lane
        asks first) and reported as a case of mutation `none`."""
        plain = {k: v for k, v in run.items() if k != "after_load"}
        key = json.dumps([base.name, s.name, plain, via], sort_keys=True)
        with self.lock:
            if key in self.baselines:
                return self.baselines[key]
            event = self.pending.get(key)
            mine = event is None
            if mine:
                event = self.pending[key] = threading.Event()
        if not mine:
            event.wait()
            return self.baselines[key]
        got = lane.cli(base.path, s, plain, self.timeout) if via == "cli" else \
            lane.api(base.path, s, plain, self.timeout)
        kind, detail = got
        outcome = {"ok": "same output", "error": "clean error"}.get(kind, kind)
        what = f"{base.name} unmutated" + (f", inputs {json.dumps(plain)[:200]}" if plain else "")
        with self.lock:
            self.baselines[key] = got
            self.report.results.append(CaseResult(
                Mutant(-1, "none", what, b""), outcome, detail if outcome != "same output"
                else "", base.name, s.name, via, ""))
        event.set()
        return got

    def run_mutant(self, lane: _Lane, index: int, count: int) -> list[CaseResult]:
        """The cases of mutant `index` at its first `count` settings."""
        p = self.plan(index)
        lane.index = index
        m, base = p.mutation, p.base
        path = base.path
        if m.data is not None:
            path = lane.path
            with open(path, "wb") as f:
                f.write(m.data)
        if self.keep:
            shutil.copy(path, os.path.join(self.keep, f"mutant-{self.seed}-{index}.gguf"))
        results = []
        for n, s in enumerate(p.settings[:count]):
            via = "cli" if p.cli and n == 0 else "api"
            prepare = None
            if "after_load" in m.run:   # the case changes its file: each setting a fresh copy
                path = lane.path
                prepare = partial(_write, lane.path, m.data if m.data is not None else base.raw)
            want = self.baseline(lane, base, s, m.run, via)
            got = lane.cli(path, s, m.run, self.timeout) if via == "cli" else \
                lane.api(path, s, m.run, self.timeout, prepare)
            kind, detail = got
            if kind == "ok":
                outcome = "same output" if want == got else "different output"
                detail = ""
            else:
                outcome = {"error": "clean error"}.get(kind, kind)
            results.append(CaseResult(Mutant(index, m.kind, m.what, b""), outcome, detail,
                                      base.name, s.name, via,
                                      f"{self.repro} --seed {self.seed} --mutant {index}"))
        return results

    def run(self, n_cases: int, jobs: int = 1, mutants: list[int] | None = None,
            progress: bool = False) -> FuzzReport:
        """n_cases cases (per_mutant per mutant; the last mutant may run fewer), or every
        case of the given mutants, over `jobs` worker processes."""
        todo: queue.Queue = queue.Queue()
        if mutants is None:
            n_mut = -(-n_cases // self.per_mutant)
            for i in range(n_mut):
                todo.put((i, min(self.per_mutant, n_cases - i * self.per_mutant)))
        else:
            for i in mutants:
                todo.put((i, self.per_mutant))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=todo.qsize(), desc="fuzzing", unit="mutant")
        tmp = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        cases: list[CaseResult] = []
        errors: list[BaseException] = []

        def lane_main(n: int, workdir: str) -> None:
            lane = _Lane(workdir, n)
            try:
                while not errors:
                    try:
                        i, count = todo.get_nowait()
                    except queue.Empty:
                        return
                    got = self.run_mutant(lane, i, count)
                    with self.lock:
                        cases.extend(got)
                    if bar is not None:
                        bar.update()
            except BaseException as e:  # noqa: BLE001 - the fuzzer's own failure: re-raised
                errors.append(e)
            finally:
                lane.close()
                with self.lock:
                    self.retried += lane.retried

        with tempfile.TemporaryDirectory(dir=tmp) as workdir:
            threads = [threading.Thread(target=lane_main, args=(n, workdir))
                       for n in range(max(jobs, 1))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if bar is not None:
            bar.close()
        if errors:
            raise errors[0]
        cases.sort(key=lambda c: (c.mutant.index, c.setting))
        self.report.results = sorted(self.report.results, key=lambda c: (c.base, c.setting)) \
            + cases
        return self.report
