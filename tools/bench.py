"""`ggraph bench`: llama.cpp's llama-bench. Prompt processing (pp N) and text generation
(tg N) speed, each test repeated -r times after a warmup run (twice: ggraph lays a graph's
calls out on its second run) and printed as mean ± standard deviation of the tokens/s.
Every option takes a comma-separated list of values (or may be given several times); the
tests are every combination of them, in llama-bench's order.

    ggraph bench -m MODEL[,MODEL...] [-p 512] [-n 128] [-pg PP,TG] [-d 0,4096] [-r 5]
                 [-t 1,2] [-fa 0,1] [-ctk f16] [-ctv f16] [-b 2048] [-ub 512]
                 [-ngl 99 -dev cuda] [-o md|csv|json|jsonl] [-oe md|csv|json|jsonl|none]
                 [--vs llama.cpp] [--progress]

MODEL: a GGUF path or a model name (default, smollm2, gemma3). With `--vs llama.cpp` every
test is measured on llama-cpp-python as well, in this process, the two taking turns within
each repetition; the table then shows both speeds and their ratio (ggraph / llama.cpp). The
CPU (its model name and AVX-512/AVX2/AMX flags) and the load average are printed under the
table and kept in every csv/json record: speeds on a shared machine mean little without them.

-fa takes on/off/auto (or 1/0) and defaults to auto, which is on as in `ggraph run`
(tools/common/defaults.py).

-d N runs each test with N random tokens already in the KV cache ("tg32 @ d4096"; the
context holds depth + test tokens). Unlike llama-bench, the prefix is evaluated once per test
and engine, untimed, and every repetition cuts the cache back to it (a 16384-token prefix
takes minutes on a small CPU); the warmup runs at the depth. --progress says how far a long
prefix got. llama-cpp-python is measured the same way.

bw% (generation tests): the weights a token reads (every tensor but the token embeddings,
unless the output layer reads them too) times tokens/s, over the machine's read bandwidth at
the test's thread count, measured beside every sample: before the first and after each
engine's turn (a numba reduction over 1 GiB, the median of 3 reads each time); a sample's
denominator is the higher of the reads on either side of it, as a neighbour's load on a
shared host only lowers it, and bw% is the median of the samples' shares (--no-bandwidth
skips it): how close decoding is to the memory's speed at the time it ran. A shared host's
bandwidth moves within seconds (this project's 2-CPU EPYC: 2-thread reads at 31-37 GB/s with
spells of 50-60 lasting ~10 s), so a read minutes from a sample can belong to another spell.
The reads take ~0.1-0.2 s each and leave the caches cold before every sample, of either engine.

-ngl N puts the last N layers on the offload devices of -dev/--devices (ggraph's list: cuda,
cuda,cuda, cuda:1, or cpu for a second CPU backend standing in for a device), the output
layer too once N exceeds the layer count (llama.cpp's rule; -1, the default: all); -ngl > 0
needs -dev. llama-cpp-python gets n_gpu_layers as well; a build without GPU offload (this
project's CPU machines) ignores it and runs every layer on the CPU. Other differences from
llama-bench: there is no -sm or -mmp, and -dev is one device list for the whole run. -oe
prints a second format on standard error, as llama-bench's does.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

if TYPE_CHECKING:
    from ggraph.graphs.eval.bench import BenchResult, MachineInfo

from ggraph.tools.common.defaults import FLASH_ATTN, flash_attn_on

FORMATS = ("md", "csv", "json", "jsonl")
DEFAULTS = dict(n_prompt="512", n_gen="128", n_batch="2048", n_ubatch="512", type_k="f16",
                type_v="f16", flash_attn=FLASH_ATTN)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="prompt and generation speed (llama-bench)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("-m", "--model", action="append", help="GGUF paths or model names, comma-separated "
        "(default: default)")
    add("-p", "--n-prompt", dest="n_prompt", action="append", help="prompt sizes (default 512)")
    add("-n", "--n-gen", dest="n_gen", action="append", help="generation sizes (default 128)")
    add("-pg", dest="n_pg", action="append", metavar="PP,TG",
        help="a prompt of PP tokens then TG generated ones, timed together")
    add("-b", "--batch-size", dest="n_batch", action="append", help="(default 2048)")
    add("-ub", "--ubatch-size", dest="n_ubatch", action="append", help="(default 512)")
    add("-ctk", "--cache-type-k", dest="type_k", action="append", help="(default f16)")
    add("-ctv", "--cache-type-v", dest="type_v", action="append", help="(default f16)")
    add("-fa", "--flash-attn", dest="flash_attn", action="append",
        help=f"on/off/auto or 1/0 (default {FLASH_ATTN}: on, as in ggraph run)")
    add("-t", "--threads", dest="n_threads", action="append",
        help="(default: the CPUs this process may use)")
    add("-d", "--n-depth", dest="n_depth", action="append",
        help="tokens already in the KV cache when each test starts (default 0)")
    add("-ngl", "--n-gpu-layers", dest="n_gpu_layers", action="append",
        help="the last layers on the -dev devices, the output layer too past the layer "
             "count (default -1: all)")
    add("-dev", "--devices", default="", metavar="LIST",
        help="ggraph's offload devices beside the host CPU: cuda, cuda,cuda, cuda:1, or cpu "
             "(a second CPU backend standing in for one); default none")
    add("-r", "--repetitions", type=int, default=5, help="timed runs per test (default 5)")
    add("-o", "--output", choices=FORMATS, default="md", help="standard output's format")
    add("-oe", "--output-err", choices=FORMATS + ("none",), default="none",
        help="a format printed on standard error as well (default none)")
    add("--vs", choices=("llama.cpp",), action="append", default=[],
        help="measure llama-cpp-python on the same tests, in this process")
    add("--no-warmup", action="store_true", help="no untimed run before each test")
    add("--no-bandwidth", action="store_true", help="skip the read-bandwidth measurement "
        "behind the bw%% column of generation tests")
    add("--progress", action="store_true", help="say on standard error which test runs")
    p.set_defaults(func=run)


# -- option values ----------------------------------------------------------------------------
def split(values: Sequence[str] | None, default: str) -> list[str]:
    """The comma-separated values of an option given any number of times."""
    out = [v.strip() for text in (values or [default]) for v in text.split(",")]
    return out


def int_list(flag: str, values: Sequence[str] | None, default: str, lo: int) -> list[int]:
    out = []
    for v in split(values, default):
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"{flag}: {v!r} is not an integer") from None
        if n < lo:
            raise ValueError(f"{flag} must be >= {lo}, got {n}")
        out.append(n)
    return out


def type_list(flag: str, values: Sequence[str] | None, default: str) -> list[str]:
    from ggraph.ir.types import GGMLType

    out = []
    for v in split(values, default):
        try:
            out.append(GGMLType.parse(v).name.lower())
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    return out


TRUTHY, FALSY = ("1", "on", "true", "yes", "enabled"), ("0", "off", "false", "no", "disabled")


def bool_list(flag: str, values: Sequence[str] | None, default: str) -> list[bool]:
    out = []
    for v in split(values, default):
        if v.lower() == "auto":   # resolved as every subcommand resolves it
            out.append(flash_attn_on("auto"))
            continue
        if v.lower() not in TRUTHY + FALSY:
            raise ValueError(f"{flag}: {v!r} is not 0/1 (on/off) or auto")
        out.append(v.lower() in TRUTHY)
    return out


def pg_list(values: Sequence[str] | None) -> list[tuple[int, int]]:
    out = []
    for v in values or []:
        parts = v.split(",")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"-pg: {v!r} is not PP,TG (two non-negative integers)")
        out.append((int(parts[0]), int(parts[1])))
    return out


@dataclass
class Settings:
    """The parsed, checked option lists."""
    models: list[str]
    n_prompt: list[int]
    n_gen: list[int]
    n_pg: list[tuple[int, int]]
    n_batch: list[int]
    n_ubatch: list[int]
    type_k: list[str]
    type_v: list[str]
    flash_attn: list[bool]
    n_threads: list[int]
    n_depth: list[int]
    n_gpu_layers: list[int]
    devices: str
    bandwidth: bool              # measure the read bandwidth for the tg tests' bw% column
    # the columns llama-bench adds to its table: settings given several values or a
    # value other than the default
    varied: list[str]


def settings(args: argparse.Namespace) -> Settings:
    """Every option list parsed and checked, before any model loads."""
    from ggraph.graphs.eval.bench import machine_info

    if args.repetitions < 1:
        raise ValueError(f"-r/--repetitions must be >= 1, got {args.repetitions}")
    s = Settings(
        models=[m for m in split(args.model, "default") if m] or ["default"],
        n_prompt=int_list("-p/--n-prompt", args.n_prompt, DEFAULTS["n_prompt"], 0),
        n_gen=int_list("-n/--n-gen", args.n_gen, DEFAULTS["n_gen"], 0),
        n_pg=pg_list(args.n_pg),
        n_batch=int_list("-b/--batch-size", args.n_batch, DEFAULTS["n_batch"], 1),
        n_ubatch=int_list("-ub/--ubatch-size", args.n_ubatch, DEFAULTS["n_ubatch"], 1),
        type_k=type_list("-ctk/--cache-type-k", args.type_k, DEFAULTS["type_k"]),
        type_v=type_list("-ctv/--cache-type-v", args.type_v, DEFAULTS["type_v"]),
        flash_attn=bool_list("-fa/--flash-attn", args.flash_attn, DEFAULTS["flash_attn"]),
        n_threads=int_list("-t/--threads", args.n_threads, str(machine_info().n_cpus), 1),
        n_depth=int_list("-d/--n-depth", args.n_depth, "0", 0),
        n_gpu_layers=int_list("-ngl/--n-gpu-layers", args.n_gpu_layers, "-1", -1),
        devices=args.devices.strip(), bandwidth=not args.no_bandwidth, varied=[])
    s.bandwidth = s.bandwidth and any(s.n_gen) and not s.devices
    offload = [n for n in s.n_gpu_layers if n > 0]
    if offload and not s.devices:
        raise ValueError(f"-ngl/--n-gpu-layers {offload[0]} needs offload devices: give "
                         f"-dev/--devices (cuda, or cpu standing in for one)")
    if s.devices:
        from ggraph.graphs.deploy.placement import parse_devices

        try:
            devs = parse_devices(s.devices, flag="-dev/--devices")
        except ValueError as e:
            raise ValueError(f"-dev/--devices: {e}") from None
        if any(d.kind == "virtual" for d in devs):
            raise ValueError(f"-dev/--devices {s.devices!r}: benchmarks need backends (cuda, "
                             f"cpu); sizes such as 24GiB are for `ggraph plan`")
    defaults: dict[str, list[Any]] = dict(n_batch=[2048], n_ubatch=[512], type_k=["f16"],
                                          type_v=["f16"],
                                          flash_attn=[flash_attn_on(FLASH_ATTN)])
    s.varied = [name for name, d in defaults.items() if getattr(s, name) != d]
    # llama-bench shows ngl where layers can go elsewhere than the CPU
    if s.devices or s.n_gpu_layers != [-1]:
        s.varied.insert(0, "n_gpu_layers")
    if s.devices:
        s.varied.append("devices")
    return s


# -- output -----------------------------------------------------------------------------------
# column -> (title, width): a negative width aligns left, as llama-bench's table does
COLUMNS: dict[str, tuple[str, int]] = {
    "model": ("model", -30), "size": ("size", 10), "params": ("params", 10),
    "backend": ("backend", 10), "n_threads": ("threads", 7), "n_batch": ("n_batch", 7),
    "n_ubatch": ("n_ubatch", 8), "type_k": ("type_k", -6), "type_v": ("type_v", -6),
    "flash_attn": ("fa", 2), "n_gpu_layers": ("ngl", 3), "devices": ("dev", -12),
    "test": ("test", 15), "t/s": ("t/s", 20),
    "ggraph": ("ggraph t/s", 20), "llama.cpp": ("llama.cpp t/s", 20),
    "ratio": ("ggraph/llama.cpp", 16), "bw": ("bw%", 5), "peer bw": ("peer bw%", 8),
}


def speed(r: BenchResult) -> str:
    return f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"


def cell(key: str, rs: Sequence[BenchResult]) -> str:
    """The markdown table's value of column `key` for one test's results (ggraph first)."""
    r = rs[0]
    m, t = r.model, r.test
    if key == "model":
        return m.model_type
    if key == "size":
        gib = m.size / 1024 ** 3
        return f"{gib:.2f} GiB" if gib >= 1 else f"{m.size / 1024 ** 2:.2f} MiB"
    if key == "params":
        return f"{m.n_params / 1e9:.2f} B" if m.n_params >= 1e9 else f"{m.n_params / 1e6:.2f} M"
    if key == "backend":
        return r.backend
    if key == "devices":
        return r.devices
    if key == "test":
        return t.name
    if key == "flash_attn":
        return str(int(t.flash_attn))
    if key in ("t/s", "ggraph"):
        return speed(r)
    if key == "ratio":
        return f"{r.avg_ts / rs[1].avg_ts:.2f}" if rs[1].avg_ts else "-"
    if key in ("bw", "peer bw"):
        share = (r if key == "bw" else rs[1]).bw_share
        return "-" if share is None else f"{100 * share:.0f}"
    peer = [x for x in rs if x.engine == key]
    if peer:
        return speed(peer[0])
    return str(getattr(t, key))


class Printer:
    """One output format on one stream: header, then each test's results as they come, then
    the footer."""

    def __init__(self, fmt: str, out: TextIO, machine: MachineInfo, s: Settings,
                 peers: Sequence[str]) -> None:
        self.fmt, self.out, self.machine, self.peers = fmt, out, machine, peers
        speeds = ["ggraph", *peers, "ratio"] if peers else ["t/s"]
        if s.bandwidth:
            speeds += ["bw", "peer bw"] if peers else ["bw"]
        self.columns = ["model", "size", "params", "backend", "n_threads", *s.varied, "test",
                        *speeds]
        self.records: list[dict[str, Any]] = []
        self.csv: Any = None
        self.load_start = (0.0, 0.0, 0.0)
        self.bandwidth: dict[int, list[float]] = {}   # threads -> GB/s per test, by run()

    def fmt_row(self, values: Sequence[str]) -> str:
        parts = []
        for key, v in zip(self.columns, values):
            w = COLUMNS[key][1]
            # "±" is one character: Python pads by characters, so no byte-count fix is needed
            parts.append(v.ljust(-w) if w < 0 else v.rjust(w))
        return "| " + " | ".join(parts) + " |"

    def header(self, load: tuple[float, float, float]) -> None:
        self.load_start = load
        if self.fmt == "md":
            print(self.fmt_row([COLUMNS[k][0] for k in self.columns]), file=self.out)
            dashes = ["-" * (abs(COLUMNS[k][1]) - 1) + (":" if COLUMNS[k][1] > 0 else "-")
                      for k in self.columns]
            print("| " + " | ".join(dashes) + " |", file=self.out, flush=True)

    def test(self, rs: Sequence[BenchResult]) -> None:
        recs = [r.record(self.machine) for r in rs]
        if len(rs) > 1 and rs[1].avg_ts:  # ggraph's record carries the ratio to the peer
            recs[0]["ratio_vs_llama_cpp"] = rs[0].avg_ts / rs[1].avg_ts
        if self.fmt == "md":
            print(self.fmt_row([cell(k, rs) for k in self.columns]), file=self.out)
        elif self.fmt == "csv":
            for rec in recs:
                row = {k: (" ".join(f"{x:.2f}" for x in v) if k == "load_avg" else v)
                       for k, v in rec.items() if k not in ("samples_ns", "samples_ts")}
                if self.csv is None:
                    fields = list(row) + (["ratio_vs_llama_cpp"] if self.peers
                                          and "ratio_vs_llama_cpp" not in row else [])
                    self.csv = csv.DictWriter(self.out, fieldnames=fields, restval="",
                                              lineterminator="\n")
                    self.csv.writeheader()
                self.csv.writerow(row)
        elif self.fmt == "jsonl":
            for rec in recs:
                print(json.dumps(rec), file=self.out)
        self.records += recs
        self.out.flush()

    def footer(self, load: tuple[float, float, float]) -> None:
        if self.fmt == "md":
            ld = " / ".join(f"{a:.2f} {b:.2f} {c:.2f}" for a, b, c in (self.load_start, load))
            print(f"\ncpu: {self.machine.line}\nload average (1, 5, 15 min), start / end: {ld}",
                  file=self.out)
            if self.peers:
                print("ggraph/llama.cpp: the ratio of the mean tokens/s, measured in one "
                      "process taking turns", file=self.out)
            if any(self.bandwidth.values()):   # a figure read beside some test
                bw = ", ".join(f"{n} threads {_span(g)} GB/s"
                               for n, g in sorted(self.bandwidth.items()) if g)
                print(f"bw%: a generation test's weights read per second over the machine's "
                      f"read bandwidth measured beside each sample, the median of the "
                      f"samples' shares ({bw})", file=self.out)
        elif self.fmt == "json":
            json.dump(self.records, self.out, indent=1)
            print(file=self.out)
        self.out.flush()


def _span(values: Sequence[float]) -> str:
    lo, hi = f"{min(values):.1f}", f"{max(values):.1f}"
    return lo if lo == hi else f"{lo}-{hi}"


def bandwidth_reader(n_threads: int, into: list[float]) -> Callable[[], float]:
    """The read beside each sample (run_test's `read`): the machine's read bandwidth at
    n_threads, the median of 3 reads, each figure also kept in `into`."""
    from ggraph.backends.cpu.membw import read_bandwidth

    def read() -> float:
        into.append(read_bandwidth(n_threads, 3))
        return into[-1]
    return read


def run(args: argparse.Namespace) -> int:
    from ggraph.graphs.eval.bench import (expand, load_average, machine_info, model_info,
                                     peer_available, run_test)
    from ggraph.graphs.gguf.fetch import resolve_model

    s = settings(args)
    peers = list(dict.fromkeys(args.vs))
    for p in peers:
        if not peer_available(p):
            raise ValueError(f"--vs {p}: llama-cpp-python is not installed "
                             f"(pip install llama-cpp-python)")
    with contextlib.redirect_stdout(sys.stderr):   # a download's messages are not output
        paths = [resolve_model(m) for m in s.models]
    tests = expand(paths, s.n_prompt, s.n_gen, s.n_pg, s.n_batch, s.n_ubatch, s.type_k,
                   s.type_v, s.flash_attn, s.n_threads, s.n_depth, s.n_gpu_layers, s.devices)
    if not tests:
        raise ValueError("no tests: every -p, -n and -pg size is 0")
    machine = machine_info()
    printers = [Printer(args.output, sys.stdout, machine, s, peers)]
    if args.output_err != "none":
        printers.append(Printer(args.output_err, sys.stderr, machine, s, peers))
    infos = {p: model_info(p) for p in paths}

    def each(f: Callable[[Printer], Any]) -> None:
        for pr in printers:
            f(pr)

    bandwidth: dict[int, list[float]] = {n: [] for n in s.n_threads}
    for pr in printers:
        pr.bandwidth = bandwidth
    start = load_average()
    each(lambda pr: pr.header(start))
    for i, t in enumerate(tests, 1):
        def say(line: str, i: int = i) -> None:
            print(f"ggraph bench: test {i}/{len(tests)}: {line}", file=sys.stderr, flush=True)

        if args.progress:
            say(f"{infos[t.model].model_type} {t.name} t={t.n_threads} fa={int(t.flash_attn)}"
                + (f" ngl={t.n_gpu_layers}" if s.devices else ""))
        measure = s.bandwidth and t.n_gen > 0 and not t.n_prompt
        rs = run_test(t, reps=args.repetitions, peers=peers, warmup=not args.no_warmup,
                      model=infos[t.model], progress=say if args.progress else None,
                      read=bandwidth_reader(t.n_threads, bandwidth[t.n_threads])
                      if measure else None)
        each(lambda pr: pr.test(rs))
    end = load_average()
    each(lambda pr: pr.footer(end))
    return 0
