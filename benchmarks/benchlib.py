"""What every benchmark script shares (issue 28), so that no script keeps its own copy:

- the run record every JSON result carries (`run_record`): the CPU (graphs/eval/bench.py's
  machine_info), the threads, the ggraph commit measured, the UTC date, the load average at the
  start of the run and when the result was written (graphs/eval/bench.py's load_average),
  Python's and llama-cpp-python's versions, and the command line with its parsed options;
- writing results (`write_results`: the run record, the script's own keys, its rows) and
  printing tables, plain or markdown, from rows and column specs (`Column`, `print_table`,
  `header_lines` and `row_line` for tables printed a row at a time);
- the llama.cpp peer: llama-cpp-python imported after the OpenMP settings
  (`import_llama_cpp`), its Llama built with the project's settings (`llama_cpp_model`), and
  the speed table of a comparison (`print_peer_speed`);
- a paired A/B's figure by spell of the memory (`by_spell`, `spell_line`: ab_revision.py and
  ab_decode.py);
- `OwnBytes`, the weight source a CPU backend packs quantized leaves from when no model file
  is loaded (a leaf's own bytes, as a loaded model's GGUF file gives them);
- the options the scripts share, as argparse parents: `threads_option` (-t/--threads),
  `model_option` (-m/--model, resolved by graphs/gguf/fetch.py's resolve_model),
  `out_option` (-o/--out/--json) and `repeat_option` (-r/--repeat).

The scripts run as `python benchmarks/X.py` and some are loaded by path
(tests/graphs/models/test_deepseek2.py,
tools/ggml_ref.py), where benchmarks/ is not on sys.path: each script puts its own folder
there in one commented line before `from benchlib import ...`. Importing this module imports
nothing but the standard library (ggraph when a function needs it): ttft.py's children time
a fresh interpreter from its start, and busy_machine.py's parent only starts processes.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import time
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# a script imports this module before it measures anything: the load average now is the
# run's start in every record it writes (other work on a shared machine changes the figures).
# Read as graphs/eval/bench.py's load_average reads it, which is not imported here: that
# would import ggraph (see above)
try:
    START_LOAD: tuple[float, float, float] = os.getloadavg()
except (OSError, AttributeError):
    START_LOAD = (0.0, 0.0, 0.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1), linear between the sorted values; None for none."""
    if not values:
        return None
    v, x = sorted(values), q * (len(values) - 1)
    lo = int(x)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (x - lo)


def by_spell(a: Sequence[float], b: Sequence[float], paired: Sequence[float]
             ) -> dict[str, float]:
    """The median of `paired` (each pair of turns' paired figure: a difference or a ratio of
    sides a and b, whose times are `a` and `b`) over the pairs that ran faster than the median
    pair (`fast`: the mean of the two sides' times at or under the median's) and over the
    others (`slow`). A shared host's memory comes in spells (this project's 2-CPU EPYC reads
    31-37 GB/s at 2 threads, with spells of 45-60), and a change that costs or saves the same
    time a product (a fork, a quantization, a thread left alone at the end) weighs more in
    the fast ones: a paired median over both can hide what the fast spells show. A pair's
    turns run back to back, so a pair falls in one spell; it is sorted by both sides' mean,
    not one side's time alone, which would favour that side in the fast half (a turn faster
    by chance lands there)."""
    means = [(x + y) / 2 for x, y in zip(a, b)]
    cut = statistics.median(means)
    fast = [p for m, p in zip(means, paired) if m <= cut]
    slow = [p for m, p in zip(means, paired) if m > cut]
    return {"fast": statistics.median(fast) if fast else float("nan"),
            "slow": statistics.median(slow) if slow else float("nan"), "pair_median": cut}


def spell_line(spells: dict[str, float], fmt: str) -> str:
    """by_spell's two figures in words, each in `fmt`."""
    return (f"the faster half of pairs {fmt.format(spells['fast'])}, the slower half "
            f"{fmt.format(spells['slow'])} (split at the median of the pairs' mean times)")


def cpu_vendor() -> str | None:
    """"intel" or "amd" from /proc/cpuinfo (the suffix of a result's markdown copy)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return None
    return "intel" if "GenuineIntel" in info else "amd" if "AuthenticAMD" in info else None


def results_path(name: str) -> str:
    """benchmarks/results/NAME, whatever the working directory: a script's default JSON."""
    return os.path.join(RESULTS, name)


# -- the run record ------------------------------------------------------------------------------

def git_commit() -> tuple[str | None, bool]:
    """The short commit (`git rev-parse --short HEAD`) of the ggraph checkout being measured,
    and whether its tracked files have uncommitted changes; (None, False) outside a checkout."""
    import ggraph

    where = os.path.dirname(os.path.dirname(os.path.abspath(ggraph.__file__)))
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head, bool(dirty)


def code_version() -> str:
    """The commit as one string: "abc1234", "abc1234+uncommitted" or "not a git checkout"."""
    head, dirty = git_commit()
    if head is None:
        return "not a git checkout"
    return head + ("+uncommitted" if dirty else "")


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version (None when absent), read from its package metadata when
    it is not imported yet: importing it here would load libggml-cpu and its OpenMP runtime
    before the script chose the spin settings (`import_llama_cpp`)."""
    mod = sys.modules.get("llama_cpp")
    if mod is not None:
        return getattr(mod, "__version__", None)
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran the script: `python benchmarks/X.py ARGS` (argv: the arguments a
    main(argv) was given, default sys.argv's)."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.isfile(script):
        script = os.path.relpath(script)
    words = ["python", script] if script else ["python"]
    return shlex.join([*words, *(sys.argv[1:] if argv is None else argv)])


def plain(value: Any) -> Any:
    """A JSON value of a parsed option: lists, numbers, strings and None as they are, anything
    else (a Path) as its string."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)   # a str subclass (ModelPath) as a plain str too


def run_record(args: argparse.Namespace | None = None, *, threads: Any = None,
               load_start: Sequence[float] | None = None,
               argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The record every JSON result carries: the machine, the code and the command. threads:
    default args.threads; load_start: default the load average when this module was
    imported."""
    from ggraph.graphs.eval.bench import load_average, machine_info

    mi = machine_info()
    head, dirty = git_commit()
    if threads is None:
        threads = getattr(args, "threads", None)
    return {
        "cpu": mi.line, "n_cpus": mi.n_cpus, "threads": plain(threads),
        "commit": head, "uncommitted": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_avg": {"start": list(START_LOAD if load_start is None else load_start),
                     "end": list(load_average())},
        "python": platform.python_version(), "llama_cpp_python": llama_cpp_version(),
        "command": command_line(argv),
        "args": {k: plain(v) for k, v in vars(args).items()} if args is not None else {}}


# -- writing results -----------------------------------------------------------------------------

def write_results(path: str, rows: list | None = None, *, args: argparse.Namespace | None,
                  extra: dict[str, Any] | None = None, rows_key: str = "rows",
                  threads: Any = None, load_start: Sequence[float] | None = None,
                  argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Write {"run": run_record(...), **extra, rows_key: rows} as JSON to `path` (its folder
    made), print "wrote PATH", and return what was written. The run record sits under one
    key of its own, so no script's keys change."""
    out: dict[str, Any] = {"run": run_record(args, threads=threads, load_start=load_start,
                                             argv=argv)}
    if extra:
        if "run" in extra:
            raise ValueError("write_results: 'run' is the run record's key")
        out.update(extra)
    if rows is not None:
        out[rows_key] = rows
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    print(f"wrote {path}")
    return out


def run_command(cmd: Sequence[str]) -> tuple[str, float]:
    """Run a program to its end: (its standard output and error, the seconds it took). A
    failure raises, with the command and the end of its standard error."""
    t = time.perf_counter()
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r.stdout + r.stderr, time.perf_counter() - t


def write_markdown_table(json_path: str, rows: Sequence[dict], columns: Sequence["Column"],
                         notes: Sequence[str] = ()) -> str:
    """A markdown copy of a results table beside its JSON (NAME_{intel,amd}.md), headed by
    the machine and the command; `notes` as bullets under it. Prints and returns its path."""
    from ggraph.graphs.eval.bench import machine_info

    path = f"{os.path.splitext(json_path)[0]}_{cpu_vendor() or 'cpu'}.md"
    lines = [f"Machine: {machine_info().line}", "", f"Command: `{command_line()}`", "",
             *table_lines(rows, columns, sep=" | ", markdown=True), "",
             *(f"- {n}" for n in notes)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path}")
    return path


@dataclass(frozen=True)
class Column:
    """One column of a printed table."""
    key: str | Callable[[dict], Any]   # the row's value: its key, or a function of the row
    title: str | None = None           # the header (default: the key)
    fmt: str = "{}"                    # str.format of the value
    width: int = 0                     # the least width (0: the widest cell of the table)
    align: str = ">"                   # ">" right, "<" left
    missing: str = "-"                 # the cell where the value is absent or None
    gap: str | None = None             # text before the column in a plain table (default: sep)

    @property
    def header(self) -> str:
        if self.title is not None:
            return self.title
        return self.key if isinstance(self.key, str) else ""

    def cell(self, row: dict) -> str:
        v = self.key(row) if callable(self.key) else row.get(self.key)
        return self.missing if v is None else self.fmt.format(v)


def join_cells(cells: Sequence[str], columns: Sequence[Column], widths: Sequence[int],
               sep: str, markdown: bool) -> str:
    padded = [f"{c:{col.align}{w}}" for c, col, w in zip(cells, columns, widths)]
    if markdown:
        return "| " + " | ".join(padded) + " |"
    line = padded[0] if padded else ""
    for p, col in zip(padded[1:], columns[1:]):
        line += (sep if col.gap is None else col.gap) + p
    return line.rstrip()


def fixed_widths(columns: Sequence[Column], markdown: bool = False) -> list[int]:
    """Each column's width where no rows are known yet: its width, or its header's."""
    return [max(c.width or len(c.header), 3 if markdown else 0) for c in columns]


def header_lines(columns: Sequence[Column], *, sep: str = " ", markdown: bool = False,
                 widths: Sequence[int] | None = None) -> list[str]:
    """The header: one line, and the alignment line of a markdown table."""
    widths = widths or fixed_widths(columns, markdown)
    lines = [join_cells([c.header for c in columns], columns, widths, sep, markdown)]
    if markdown:
        lines.append("| " + " | ".join("-" * w if c.align == "<" else "-" * (w - 1) + ":"
                                       for c, w in zip(columns, widths)) + " |")
    return lines


def row_line(row: dict, columns: Sequence[Column], *, sep: str = " ", markdown: bool = False,
             widths: Sequence[int] | None = None) -> str:
    """One row's line (for tables printed as their rows are measured: fixed widths)."""
    widths = widths or fixed_widths(columns, markdown)
    return join_cells([c.cell(row) for c in columns], columns, widths, sep, markdown)


def table_lines(rows: Sequence[dict], columns: Sequence[Column], *, sep: str = " ",
                markdown: bool = False, header: bool = True) -> list[str]:
    """A whole table: every column as wide as its width, its widest cell and (with the
    header) its title."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([col.width, len(col.header) if header else 0, 3 if markdown else 0]
                  + [len(cs[i]) for cs in cells]) for i, col in enumerate(columns)]
    lines = header_lines(columns, sep=sep, markdown=markdown, widths=widths) if header else []
    return lines + [join_cells(cs, columns, widths, sep, markdown) for cs in cells]


def print_table(rows: Sequence[dict], columns: Sequence[Column], *, sep: str = " ",
                markdown: bool = False, header: bool = True) -> None:
    """Print `table_lines`."""
    print("\n".join(table_lines(rows, columns, sep=sep, markdown=markdown, header=header)))


# -- the llama.cpp peer --------------------------------------------------------------------------

def import_llama_cpp() -> Any:
    """llama_cpp, imported after the OpenMP settings: libggml-cpu loads the OpenMP runtime
    that numba's threads share, which reads its spin settings once (backends/cpu/threads.py),
    so configure_openmp must come first. Without llama-cpp-python: a one-line exit."""
    from ggraph.backends.cpu.threads import configure_openmp

    configure_openmp()
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"{os.path.basename(sys.argv[0] or 'benchmark')}: the llama.cpp peer "
                         f"needs llama-cpp-python (pip install llama-cpp-python; it builds "
                         f"llama.cpp from source, minutes): {e}") from None
    return llama_cpp


def llama_cpp_model(model_path: str, *, n_ctx: int = 512, n_batch: int = 512,
                    n_ubatch: int | None = None, threads: int | None = None,
                    flash_attn: bool = False, logits_all: bool = False,
                    type_k: str | int | None = None, type_v: str | int | None = None,
                    swa_full: bool | None = None, verbose: bool = False, **kw: Any) -> Any:
    """llama-cpp-python's Llama with the settings the comparisons use: n_ubatch at most
    n_batch (512 by default), threads for both single tokens and batches (None: the library's
    own counts), cache types by name ("f16", "q8_0") or ggml id, no log unless verbose.
    swa_full None keeps llama-cpp-python's full-size sliding-window cache; False sizes it as
    llama-cli does. Other keywords (vocab_only, n_gpu_layers) go to Llama as they are."""
    llama_cpp = import_llama_cpp()
    from ggraph.ir.types import GGMLType

    settings: dict[str, Any] = dict(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512) if n_ubatch is None
        else n_ubatch, flash_attn=flash_attn, logits_all=logits_all, verbose=verbose)
    if threads is not None:
        settings.update(n_threads=threads, n_threads_batch=threads)
    for name, t in (("type_k", type_k), ("type_v", type_v)):
        if t is not None:
            settings[name] = int(GGMLType.parse(t)) if isinstance(t, str) else int(t)
    if swa_full is not None:
        settings["swa_full"] = swa_full
    return llama_cpp.Llama(model_path=model_path, **settings, **kw)


PEER_SPEED = [Column("test", "", width=14, align="<"),
              Column("llama_cpp", "llama.cpp", "{:.1f}", 12),
              Column("ggraph", "ggraph", "{:.1f}", 12),
              Column("ratio", "ratio", "{:.2f}", 8)]


def print_peer_speed(speed: dict[str, float], tests: Sequence[str]) -> None:
    """A comparison's speed table: tok/s of llama.cpp and ggraph per test (the keys
    TEST_llama_cpp and TEST_ggraph of `speed`) and ggraph's over llama.cpp's."""
    rows = [dict(test=f"{t} tok/s", llama_cpp=speed[f"{t}_llama_cpp"],
                 ggraph=speed[f"{t}_ggraph"],
                 ratio=speed[f"{t}_ggraph"] / speed[f"{t}_llama_cpp"]) for t in tests]
    print("\n".join(header_lines(PEER_SPEED, sep="") +
                    [row_line(r, PEER_SPEED, sep="") for r in rows]))


# -- weights a backend packs ---------------------------------------------------------------------

class OwnBytes:
    """The WeightSource a loaded model gives the CPU backend (graphs/gguf_file.GGUFModel),
    over leaf tensors' own bytes: the backend packs their rows from it as at model load, and
    there are no mapped pages to release."""

    def read_rows(self, t: Any, row0: int, out: Any) -> None:
        import numpy as np

        out[...] = np.asarray(t.data).reshape(-1, out.shape[1])[row0:row0 + out.shape[0]]

    def release(self, t: Any) -> None:
        pass


# -- the shared options --------------------------------------------------------------------------

class ModelPath(str):
    """A GGUF path resolved from -m/--model that keeps what was asked for in `spec` (a model
    name such as "default", or the path itself): file names and tables may show either."""
    spec: str


def model_arg(spec: str) -> ModelPath:
    """argparse type of a model option: graphs/gguf/fetch.py's resolve_model (a name is
    fetched once), its refusal an argparse error."""
    if os.path.isabs(spec) and os.path.isfile(spec):
        path = ModelPath(spec)   # a child process given the parent's path: no ggraph import
        path.spec = spec
        return path
    from ggraph.graphs.gguf.fetch import resolve_model

    try:
        path = ModelPath(resolve_model(spec))
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    path.spec = spec
    return path


def threads_option(default: int | list[int] | None = 2, *, many: bool = False,
                   help: str | None = None) -> argparse.ArgumentParser:
    """-t/--threads N (many: N [N ...], a list)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-t", "--threads", type=int, nargs="+" if many else None, default=default,
                   help=help or f"threads (default {default})")
    return p


def model_option(default: str = "default", *, help: str | None = None
                 ) -> argparse.ArgumentParser:
    """-m/--model NAME|PATH, resolved to a path (ModelPath, the name in .spec) as the
    arguments are parsed."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-m", "--model", type=model_arg, default=default,
                   help=help or f"a model name resolve_model knows or a GGUF path (default "
                                f"{default})")
    return p


def out_option(default: str | None, *, help: str | None = None) -> argparse.ArgumentParser:
    """-o/--out/--json PATH: where the JSON goes (args.out)."""
    shown = default
    if default and os.path.dirname(default) == RESULTS:   # as the docstrings name it
        shown = os.path.join("benchmarks", "results", os.path.basename(default))
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-o", "--out", "--json", dest="out", default=default, metavar="PATH",
                   help=help or (f"the JSON result (default {shown})" if default
                                 else "the JSON result (default: none)"))
    return p


def repeat_option(default: int = 3, *aliases: str, help: str | None = None
                  ) -> argparse.ArgumentParser:
    """-r/--repeat N (and the script's older spellings in `aliases`): args.repeat."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-r", "--repeat", *aliases, dest="repeat", type=int, default=default,
                   help=help or f"repetitions (default {default})")
    return p
