"""Speed measurements in llama-bench's terms: the tests (pp N, tg N, pp N+tg M), the cartesian
product of settings that makes them, and their repeated timing on ggraph's Engine and, as a
peer, on llama-cpp-python in the same process.

A test times, from an empty KV cache, the evaluation of N random tokens in batches of n_batch
(pp), M single-token decode steps (tg), or both one after the other (pg); tokens/s is the
tokens evaluated over the seconds taken. As llama-bench does, each test is run once untimed
first (the whole prompt for pp, one token for tg: numba compiles ggraph's kernels there) and
then `reps` times; a sample's random tokens start with BOS where the model adds one. With a
peer, the engines take turns within each repetition (and swap who goes first every
repetition) so that whatever else loads the machine weighs on both alike.

At a depth (llama-bench's -d, "pp512 @ d4096"), n_depth random tokens are already in the
cache when the timing starts, and the context holds depth + test tokens. Differences from
llama-bench, the same on every engine: the prefix is evaluated once per test and engine
(untimed), and each repetition cuts the cache back to it (ggraph: Engine.truncate;
llama-cpp-python: llama_memory_seq_rm and Llama.n_tokens), where llama-bench restores a saved
state (older versions evaluated the prefix before every repetition); and the warmup runs at
the depth, so that kernels a long cache needs compile there. A sliding-window cache that no
longer holds the window before the depth once a long test ran (ggraph refuses the cut) gets
its prefix evaluated again, untimed.

n_gpu_layers and devices are llama-bench's -ngl and ggraph's --devices: the last
n_gpu_layers layers go to the offload devices ("cuda", "cuda,cuda", or "cpu": a second CPU
backend standing in for one), the output layer too once n_gpu_layers exceeds the layer count
(llama.cpp's rule, graphs/deploy/placement.py; -1: all). llama-cpp-python
gets n_gpu_layers too; a build without GPU offload (this project's CPU machines) ignores it.

This file owns the measuring and the result records; tools/bench.py owns the command line
and the output formats.
"""
from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Protocol, Sequence

import numpy as np

GGRAPH = "ggraph"
LLAMA_CPP = "llama.cpp"
PEERS = (LLAMA_CPP,)


@dataclass(frozen=True)
class BenchTest:
    """One test instance: a model and one value of every setting."""
    model: str                 # GGUF path
    n_prompt: int = 0
    n_gen: int = 0
    n_batch: int = 2048
    n_ubatch: int = 512
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    n_threads: int = 1
    n_depth: int = 0           # tokens already in the cache when the timing starts
    n_gpu_layers: int = -1     # layers on the offload devices (-1: all of them)
    devices: str = ""          # ggraph's offload devices ("": none, the host CPU only)

    def __post_init__(self) -> None:
        if self.n_prompt < 0 or self.n_gen < 0 or self.n_prompt + self.n_gen == 0:
            raise ValueError(f"a test evaluates tokens: n_prompt={self.n_prompt}, "
                             f"n_gen={self.n_gen}")
        for name in ("n_batch", "n_ubatch", "n_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_depth < 0:
            raise ValueError(f"n_depth must be >= 0, got {self.n_depth}")
        if self.n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be >= -1 (-1: all), got {self.n_gpu_layers}")
        if self.n_gpu_layers > 0 and not self.devices:
            raise ValueError(f"n_gpu_layers={self.n_gpu_layers} offloads layers: it needs "
                             f"offload devices (cuda, or cpu standing in for one)")

    @property
    def name(self) -> str:
        """llama-bench's test name: pp512, tg128 or pp512+tg128, then " @ d4096" at a
        depth."""
        if self.n_gen == 0:
            name = f"pp{self.n_prompt}"
        elif self.n_prompt == 0:
            name = f"tg{self.n_gen}"
        else:
            name = f"pp{self.n_prompt}+tg{self.n_gen}"
        return f"{name} @ d{self.n_depth}" if self.n_depth else name

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def n_ctx(self) -> int:
        # llama-bench's context: exactly what a test needs, its depth included
        return self.n_depth + self.n_prompt + self.n_gen


def expand(models: Sequence[str], n_prompt: Sequence[int] = (512,),
           n_gen: Sequence[int] = (128,), n_pg: Sequence[tuple[int, int]] = (),
           n_batch: Sequence[int] = (2048,), n_ubatch: Sequence[int] = (512,),
           type_k: Sequence[str] = ("f16",), type_v: Sequence[str] = ("f16",),
           flash_attn: Sequence[bool] = (False,), n_threads: Sequence[int] = (1,),
           n_depth: Sequence[int] = (0,), n_gpu_layers: Sequence[int] = (-1,),
           devices: str = "") -> list[BenchTest]:
    """Every combination of the settings, in llama-bench's order: per model, per setting
    combination (ngl, batch, ubatch, type_k, type_v, fa, threads, depth, the last varying
    fastest), the pp tests, then tg, then pg. Sizes of 0 are skipped, as llama-bench skips
    them."""
    tests = []
    for m in models:
        for ngl, nb, nub, tk, tv, fa, nt, nd in itertools.product(
                n_gpu_layers, n_batch, n_ubatch, type_k, type_v, flash_attn, n_threads,
                n_depth):
            kw = dict(model=m, n_batch=nb, n_ubatch=nub, type_k=tk, type_v=tv,
                      flash_attn=bool(fa), n_threads=nt, n_depth=nd, n_gpu_layers=ngl,
                      devices=devices)
            sizes = ([(p, 0) for p in n_prompt if p] + [(0, g) for g in n_gen if g]
                     + [(p, g) for p, g in n_pg if p or g])
            tests += [BenchTest(n_prompt=p, n_gen=g, **kw) for p, g in sizes]
    return tests


def mean(v: Sequence[float]) -> float:
    return sum(v) / len(v) if v else 0.0


def stddev(v: Sequence[float]) -> float:
    """The sample standard deviation (n - 1 in the denominator), 0 for fewer than two values,
    as llama-bench computes it."""
    if len(v) < 2:
        return 0.0
    m = mean(v)
    return math.sqrt(max(0.0, sum((x - m) ** 2 for x in v) / (len(v) - 1)))


@dataclass(frozen=True)
class ModelInfo:
    """What llama-bench prints of a model, and the bytes of weights a generated token reads
    (every tensor but the token embeddings, of which it reads one row, unless the output
    layer multiplies by them too: the share of the read bandwidth a tg figure is)."""
    path: str
    model_type: str      # "{arch} {size label} {file type}", like llama_model_desc
    size: int            # bytes of the tensors
    n_params: int
    token_bytes: int = 0

    @property
    def filename(self) -> str:
        return os.path.basename(self.path)


def file_type_name(v: Any) -> str:
    """general.file_type as llama.cpp names it: Q4_1, Q4_K - Medium, all F32 (? if absent)."""
    import gguf

    try:
        name = gguf.LlamaFileType(int(v)).name
    except (TypeError, ValueError):
        return "?"
    if name == "ALL_F32":
        return "all F32"
    name = name.removeprefix("MOSTLY_")
    for suffix, word in (("_S", "Small"), ("_M", "Medium"), ("_L", "Large")):
        if "_K" in name and name.endswith(suffix):
            return f"{name[:-len(suffix)]} - {word}"
    return name


def model_info(path: str) -> ModelInfo:
    """Read a GGUF's header: its description, tensor bytes and parameter count."""
    from ggraph.graphs.gguf.gguf_file import load_gguf

    f = load_gguf(path, with_data=False)
    n_params = sum(math.prod(t.ne) for t in f.tensors.values())
    label = f.metadata.get("general.size_label")
    if not isinstance(label, str) or not label:
        label = (f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else
                 f"{n_params / 1e6:.0f}M" if n_params >= 1e6 else f"{n_params / 1e3:.0f}K")
    desc = f"{f.arch} {label} {file_type_name(f.metadata.get('general.file_type'))}"
    embd = "token_embd.weight"
    tied = "output.weight" not in f.tensors
    token = f.tensor_bytes - (f.tensor_size(embd) if embd in f.tensors and not tied else 0)
    return ModelInfo(path=str(path), model_type=desc, size=f.tensor_bytes, n_params=n_params,
                     token_bytes=token)


@dataclass(frozen=True)
class MachineInfo:
    """The CPU the figures were measured on."""
    cpu: str
    n_cpus: int
    avx512: bool
    avx2: bool
    amx: bool

    @property
    def line(self) -> str:
        yes = {True: "yes", False: "no"}
        return (f"{self.cpu} ({self.n_cpus} CPUs; AVX-512: {yes[self.avx512]}, "
                f"AVX2: {yes[self.avx2]}, AMX: {yes[self.amx]})")


def machine_info(cpuinfo: str = "/proc/cpuinfo") -> MachineInfo:
    """The CPU's model name and vector flags from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    name, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return MachineInfo(cpu=name, n_cpus=n or 1, avx512="avx512f" in flags,
                       avx2="avx2" in flags, amx="amx_tile" in flags)


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS does not report them)."""
    try:
        return os.getloadavg()
    except (OSError, AttributeError):
        return (0.0, 0.0, 0.0)


@dataclass
class BenchResult:
    """One engine's samples of one test."""
    test: BenchTest
    engine: str                  # "ggraph" or a peer ("llama.cpp")
    version: str                 # the engine's version
    model: ModelInfo
    backend: str = "CPU"
    devices: str = "CPU"         # where it ran: ggraph's runner names ("CPU1/CPU"), or CPU
    samples_ns: list[int] = field(default_factory=list)
    test_time: str = ""          # when the test started (ISO 8601, UTC)
    load_avg: tuple[float, float, float] = (0.0, 0.0, 0.0)   # when it ended
    # per sample, the machine's read bandwidth at the test's threads beside it (the higher of
    # the reads just before and just after its run: run_test's `read`); empty: none read
    sample_reads_gbs: list[float] = field(default_factory=list)

    @property
    def read_gbs(self) -> float:
        """The median of the samples' reads (0.0: none read)."""
        return median(self.sample_reads_gbs) if self.sample_reads_gbs else 0.0

    @property
    def bw_share(self) -> float | None:
        """A generation test's weights read per second over the read bandwidth: the median of
        the samples' own shares (None for tests with a prompt, or without a read beside
        every sample)."""
        reads = self.sample_reads_gbs
        if self.test.n_prompt or not reads or len(reads) != len(self.samples_ns) \
                or not all(reads):
            return None
        return median(self.model.token_bytes * ts / (g * 1e9)
                      for ts, g in zip(self.samples_ts, reads))

    @property
    def samples_ts(self) -> list[float]:
        """tokens/s of each sample."""
        return [self.test.n_tokens * 1e9 / ns for ns in self.samples_ns]

    @property
    def avg_ns(self) -> float:
        return mean(self.samples_ns)

    @property
    def stddev_ns(self) -> float:
        return stddev(self.samples_ns)

    @property
    def avg_ts(self) -> float:
        return mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return stddev(self.samples_ts)

    def record(self, machine: MachineInfo) -> dict[str, Any]:
        """The flat record of llama-bench's csv/json output, with the engine and the load."""
        t = self.test
        return dict(engine=self.engine, version=self.version, cpu_info=machine.line,
                    load_avg=list(self.load_avg), model_filename=self.model.filename,
                    model_type=self.model.model_type, model_size=self.model.size,
                    model_n_params=self.model.n_params, backends=self.backend,
                    n_threads=t.n_threads, n_batch=t.n_batch, n_ubatch=t.n_ubatch,
                    type_k=t.type_k, type_v=t.type_v, n_gpu_layers=t.n_gpu_layers,
                    flash_attn=t.flash_attn, devices=self.devices, n_prompt=t.n_prompt,
                    n_gen=t.n_gen, n_depth=t.n_depth, test=t.name,
                    test_time=self.test_time, avg_ns=round(self.avg_ns),
                    stddev_ns=round(self.stddev_ns), avg_ts=self.avg_ts,
                    stddev_ts=self.stddev_ts, samples_ns=list(self.samples_ns),
                    samples_ts=self.samples_ts, weights_per_token=self.model.token_bytes,
                    read_gbs=self.read_gbs or None,
                    sample_reads_gbs=list(self.sample_reads_gbs) or None,
                    bw_share=self.bw_share)


class Bencher(Protocol):
    """One engine loaded for one test: it evaluates token lists from an empty cache."""
    engine: str
    version: str
    n_vocab: int
    backend: str
    devices: str

    def reset(self) -> None:
        """Empty the KV cache."""
        ...

    def cut(self, n: int) -> bool:
        """Cut the sequence back to its first n tokens; False where the cache cannot (the
        sequence is then unchanged)."""
        ...

    def eval(self, tokens: list[int]) -> None:
        """Append tokens to the sequence."""
        ...


class GgraphBencher:
    """ggraph's Engine on one test's settings (its own warmup off: the test warms up)."""
    engine = GGRAPH

    def __init__(self, test: BenchTest) -> None:
        from ggraph import __version__ as version

        from ggraph.graphs.runtime.engine import Engine, EngineConfig

        # only the last token's logits are read: the worst case need not hold n_ubatch rows;
        # exactly -t threads, as llama-bench runs (no governor trials of fewer threads)
        cfg = EngineConfig(n_ctx=test.n_ctx, n_ubatch=test.n_ubatch, type_k=test.type_k,
                           type_v=test.type_v, flash_attn=test.flash_attn,
                           n_threads=test.n_threads, warmup=False, reserve_outputs="last",
                           adaptive_threads=False, devices=test.devices,
                           n_gpu_layers=test.n_gpu_layers)
        self.eng = Engine(test.model, cfg)
        self.version = version
        self.n_vocab = self.eng.model.hp.n_vocab
        names = self.eng.device_names
        self.devices = "/".join(names)
        # llama-bench's backends column: the kinds of device beside the host CPU
        kinds = [n.rstrip("0123456789") for n in names]
        self.backend = ",".join(dict.fromkeys(k for k in kinds if k != "CPU")) or "CPU"

    def reset(self) -> None:
        self.eng.reset()

    def cut(self, n: int) -> bool:
        try:
            self.eng.truncate(n)
        except ValueError:   # a sliding-window ring that lost the window before n
            return False
        return True

    def eval(self, tokens: list[int]) -> None:
        self.eng.eval(tokens)


class LlamaCppBencher:
    """llama-cpp-python's Llama on one test's settings, in this process."""
    engine = LLAMA_CPP

    def __init__(self, test: BenchTest) -> None:
        # libgomp reads its spin defaults once, when the first of the two libraries that use
        # it loads (numba's threads or libggml-cpu): set them before either
        from ggraph.backends.cpu.threads import configure_openmp

        configure_openmp()
        try:
            import llama_cpp
        except ImportError as e:
            raise ValueError(f"--vs llama.cpp needs llama-cpp-python (pip install "
                             f"llama-cpp-python): {e}") from None
        from ggraph.ir.types import GGMLType

        self.llm = llama_cpp.Llama(
            model_path=test.model, n_ctx=test.n_ctx, n_batch=test.n_batch,
            n_ubatch=test.n_ubatch, n_threads=test.n_threads, n_threads_batch=test.n_threads,
            flash_attn=test.flash_attn, type_k=int(GGMLType.parse(test.type_k)),
            type_v=int(GGMLType.parse(test.type_v)), swa_full=False, verbose=False,
            n_gpu_layers=test.n_gpu_layers)
        self._llama_cpp = llama_cpp
        self.version = llama_cpp.__version__
        self.n_vocab = int(self.llm.n_vocab())
        # a build without GPU offload runs every layer on the CPU whatever n_gpu_layers says
        self.backend = "GPU" if llama_cpp.llama_supports_gpu_offload() else "CPU"
        self.devices = "auto" if llama_cpp.llama_supports_gpu_offload() else "CPU"

    def reset(self) -> None:
        self.llm.reset()

    def cut(self, n: int) -> bool:
        # the cells from n on leave the cache now, outside the timing (Llama.eval would
        # remove them itself from n_tokens on, inside it); a sliding-window cache never
        # refuses: cells of the window that a long test overwrote are simply gone
        lc = self._llama_cpp
        lc.llama_memory_seq_rm(lc.llama_get_memory(self.llm.ctx), 0, n, -1)
        self.llm.n_tokens = n
        return True

    def eval(self, tokens: list[int]) -> None:
        self.llm.eval(tokens)

    def close(self) -> None:
        self.llm.close()


def peer_available(peer: str) -> bool:
    """Whether `peer` can be measured here (its package is installed)."""
    import importlib.util

    return peer == LLAMA_CPP and importlib.util.find_spec("llama_cpp") is not None


def bench_tokens(rng: np.random.Generator, n: int, n_vocab: int, bos: int | None) -> list[int]:
    """n random token ids, the first BOS where the model adds one (as llama-bench does)."""
    toks = [int(x) for x in rng.integers(0, n_vocab, size=n)]
    if bos is not None and toks:
        toks[0] = bos
    return toks


def run_once(b: Bencher, test: BenchTest, prompt: list[int], gen: list[int],
             start: Callable[[Bencher], None] | None = None) -> int:
    """One timed sample in nanoseconds. Outside the timing the cache is emptied first, or
    `start(b)` brings it to the test's depth."""
    if start is None:
        b.reset()
    else:
        start(b)
    t0 = time.perf_counter_ns()
    for i in range(0, len(prompt), test.n_batch):
        b.eval(prompt[i:i + test.n_batch])
    for tok in gen:
        b.eval([tok])
    return time.perf_counter_ns() - t0


def bos_token(path: str) -> int | None:
    """The BOS id where the model's tokenizer adds one at the start."""
    from ggraph.graphs.gguf.gguf_file import load_gguf

    md = load_gguf(path, with_data=False).metadata
    bos = md.get("tokenizer.ggml.bos_token_id")
    add = md.get("tokenizer.ggml.add_bos_token", False)
    return int(bos) if add and isinstance(bos, int) else None


class Depth:
    """A test's depth prefix: evaluated once per engine from an empty cache (untimed, in
    n_batch pieces, saying how far it got every few seconds), then restored before each
    sample by cutting the cache back to it."""

    PROGRESS_S = 5.0   # seconds between progress lines

    def __init__(self, test: BenchTest, tokens: list[int],
                 progress: Callable[[str], None] | None = None) -> None:
        self.test, self.tokens, self.progress = test, tokens, progress

    def fill(self, b: Bencher) -> None:
        b.reset()
        n, t0 = len(self.tokens), time.perf_counter()
        last = t0
        for i in range(0, n, self.test.n_batch):
            b.eval(self.tokens[i:i + self.test.n_batch])
            now = time.perf_counter()
            done = min(i + self.test.n_batch, n)
            if self.progress and (now - last >= self.PROGRESS_S or done == n):
                last = now
                self.progress(f"depth {done}/{n} tokens on {b.engine} ({now - t0:.1f} s)")

    def start(self, b: Bencher) -> None:
        if not b.cut(len(self.tokens)):
            self.fill(b)   # the cache could not keep the prefix: evaluate it again


def run_test(test: BenchTest, reps: int = 5, peers: Sequence[str] = (), warmup: bool = True,
             seed: int = 0, model: ModelInfo | None = None,
             progress: Callable[[str], None] | None = None,
             read: Callable[[], float] | None = None) -> list[BenchResult]:
    """Measure `test` on ggraph and on each peer: the depth prefix and a warmup run (twice)
    each, then `reps` samples, the engines taking turns within each repetition. Results in
    engine order (ggraph first). `progress` gets a line now and then while a depth prefix runs.
    `read` (the machine's read bandwidth, GB/s) runs before the first sample and after every
    sample; each sample keeps the higher of the reads on either side of it
    (BenchResult.sample_reads_gbs): a shared host's bandwidth moves within seconds, so a
    figure taken minutes from a sample may belong to another state of the machine."""
    if reps < 1:
        raise ValueError(f"repetitions must be >= 1, got {reps}")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}")
    model = model or model_info(test.model)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    benchers: list[Bencher] = [GgraphBencher(test)]
    try:
        benchers += [LlamaCppBencher(test) for p in peers if p == LLAMA_CPP]
        n_vocab = min(b.n_vocab for b in benchers)
        bos = bos_token(test.model)
        rng = np.random.default_rng(seed)
        depth = (Depth(test, bench_tokens(rng, test.n_depth, n_vocab, bos), progress)
                 if test.n_depth else None)
        start = depth.start if depth else None
        for b in benchers:
            if depth:
                depth.fill(b)
            if warmup:
                # llama-bench's warmup (the whole prompt, or one generated token), here at
                # the depth: what a long cache compiles is compiled before the timing. Run
                # twice, by every engine: ggraph's CPU lays a graph's calls out for its native
                # loop on the graph's second run (backends/cpu/native_loop.py), a one-time
                # cost like a compile
                toks = bench_tokens(rng, test.n_prompt or 1, n_vocab, bos)
                for _ in range(2):
                    run_once(b, test, toks if test.n_prompt else [],
                             [] if test.n_prompt else toks, start)
        results = [BenchResult(test=test, engine=b.engine, version=b.version, model=model,
                               backend=b.backend, devices=b.devices, test_time=started)
                   for b in benchers]
        last = read() if read else 0.0
        for r in range(reps):
            prompt = bench_tokens(rng, test.n_prompt, n_vocab, bos)
            gen = bench_tokens(rng, test.n_gen, n_vocab, None if test.n_prompt else bos)
            order = range(len(benchers)) if r % 2 == 0 else reversed(range(len(benchers)))
            for i in order:
                results[i].samples_ns.append(run_once(benchers[i], test, prompt, gen, start))
                if read:
                    now = read()
                    results[i].sample_reads_gbs.append(max(last, now))
                    last = now
        for res in results:
            res.load_avg = load_average()
        return results
    finally:
        for b in benchers:
            close = getattr(b, "close", None)   # llama.cpp frees its context at once
            if close is not None:
                close()
