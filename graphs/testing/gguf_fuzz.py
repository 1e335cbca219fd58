"""A GGUF fuzzer: mutate a good file, run each mutant through the loader, the tokenizer, the
chat template and a few tokens of evaluation, and sort what happened.

Mutations, each from a fixed seed (case i of a run is the same mutant every time):
- `bitflip`: 1-4 bits flipped inside the header;
- `edge`: a count, length, type id, dimension or offset field of the header set to an edge value
  (0, 1, 2^31, 2^32-1, 2^62, 2^64-1, the file size, its old value +-1, ...);
- `typeid`: a value, element or tensor type id set to an unknown or another known id;
- `truncate`: the file cut short, mostly inside the header;
- `weights`: bytes of the tensor data section overwritten (0xFF bytes among them, which are
  NaN patterns in float and f16 scale fields).

Each mutant runs in a worker process (`python -m ggraph.graphs.testing.gguf_fuzz --worker`), with a
memory limit and a per-case timeout, so a crash or a hang is seen and counted, never inherited
(`Worker` and `serve`, which the structured fuzzer of graphs/testing/fuzz_structured.py uses too, as
it uses `byte_mutant` for its `bytes` mutations and `FuzzReport` for its tables).
Outcomes: `clean error` (GGUFError/ValueError with a one-line message), `same output` (logits
bit-equal to the unmutated file's), `different output`, and the three that must stay at 0:
`traceback` (any other exception, or a multi-line message), `signal` and `timeout`.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ggraph.graphs.gguf.gguf_reader import HeaderField, ValueType, read_header
from ggraph.graphs.gguf.gguf_writer import GGUFWriter
from ggraph import config

KINDS = ("bitflip", "edge", "typeid", "truncate", "weights")
OUTCOMES = ("clean error", "same output", "different output", "traceback", "signal",
            "timeout")
BAD_OUTCOMES = ("traceback", "signal", "timeout")


@dataclass(frozen=True)
class Mutant:
    index: int
    kind: str
    what: str          # which field or bytes, for the report
    data: bytes


@dataclass
class CaseResult:
    mutant: Mutant
    outcome: str
    detail: str = ""
    # structured cases (graphs/testing/fuzz_structured.py): the file it came from, the setting, the
    # way it ran ("api" or "cli") and a command that runs it again
    base: str = ""
    setting: str = ""
    via: str = ""
    repro: str = ""


def _by_kind(r: CaseResult) -> str:
    return r.mutant.kind


@dataclass
class FuzzReport:
    results: list[CaseResult] = field(default_factory=list)

    def counts(self, by: Callable[[CaseResult], str] = _by_kind) -> dict[str, Counter]:
        groups: dict[str, Counter] = {}
        for r in self.results:
            groups.setdefault(by(r), Counter())[r.outcome] += 1
        return groups

    def bad(self) -> list[CaseResult]:
        return [r for r in self.results if r.outcome in BAD_OUTCOMES]

    def table(self, by: Callable[[CaseResult], str] = _by_kind, title: str = "mutation"
              ) -> str:
        """A markdown table: group (the mutation kind unless `by` says) x outcome."""
        rows = [f"| {title} | cases | " + " | ".join(OUTCOMES) + " |",
                "|---|---:|" + "---:|" * len(OUTCOMES)]
        total: Counter = Counter()
        for kind, c in sorted(self.counts(by).items()):
            total.update(c)
            rows.append(f"| {kind} | {sum(c.values())} | " +
                        " | ".join(str(c[o]) for o in OUTCOMES) + " |")
        rows.append(f"| all | {sum(total.values())} | " +
                    " | ".join(str(total[o]) for o in OUTCOMES) + " |")
        return "\n".join(rows)


# -- mutations ----------------------------------------------------------------------------------

def _edge_values(f: HeaderField, file_size: int) -> list[int]:
    top = (1 << (8 * f.size)) - 1
    v = int(f.value) & top if isinstance(f.value, int) else 0
    vals = [0, 1, 2, 255, 256, 65535, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
            1 << 62, (1 << 63) - 1, 1 << 63, top, v - 1, v + 1, v * 2, v + 32, file_size,
            file_size - f.pos, file_size // 2]
    return sorted({x & top for x in vals if x >= 0})


@dataclass(frozen=True)
class ByteLayout:
    """Where a file's header fields are: what byte mutants aim at."""
    numeric: list[HeaderField]       # every fixed-size integer field of the header
    type_fields: list[HeaderField]   # those holding a value, element or tensor type id
    header_end: int                  # the data section's first byte


def byte_layout(base: bytes) -> ByteLayout:
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(base)
        f.flush()
        trace: list[HeaderField] = []
        hdr = read_header(f.name, trace)
        header_end = hdr.data_offset
    numeric = [t for t in trace if isinstance(t.value, int)]
    return ByteLayout(numeric, [t for t in numeric if "type" in t.what], header_end)


def mutants(base: bytes, n: int, seed: int = 0, kinds: tuple[str, ...] = KINDS
            ) -> Iterator[Mutant]:
    """n mutants of the GGUF bytes `base`, case i drawn from seed (seed, i)."""
    layout = byte_layout(base)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        kind = kinds[int(rng.integers(len(kinds)))]
        yield byte_mutant(base, rng, kind, layout, i)


def byte_mutant(base: bytes, rng: np.random.Generator, kind: str,
                layout: ByteLayout | None = None, index: int = 0) -> Mutant:
    """One byte mutant of `base` of the given kind, drawn from rng."""
    layout = layout or byte_layout(base)
    header_end = layout.header_end
    buf = bytearray(base)
    if kind == "bitflip":
        bits = rng.integers(0, 8 * header_end, size=int(rng.integers(1, 5)))
        for b in bits:
            buf[b // 8] ^= 1 << (b % 8)
        what = f"bits {sorted(int(b) for b in bits)}"
    elif kind in ("edge", "typeid"):
        pool = layout.numeric if kind == "edge" else layout.type_fields
        fld = pool[int(rng.integers(len(pool)))]
        if kind == "edge":
            choices = _edge_values(fld, len(base))
        else:  # known and unknown ids: value types 0..12, ggml types 0..39
            choices = list(range(0, 42)) + [255, 1 << 16, (1 << 32) - 1]
        v = choices[int(rng.integers(len(choices)))]
        buf[fld.pos:fld.pos + fld.size] = int(v).to_bytes(fld.size, "little")
        what = f"{fld.what} @{fld.pos}: {fld.value} -> {v}"
    elif kind == "truncate":
        cut = int(rng.integers(0, header_end + 64)) if rng.random() < 0.8 else \
            int(rng.integers(header_end, len(base)))
        del buf[cut:]
        what = f"cut at {cut} of {len(base)}"
    else:  # weights
        k = int(rng.integers(1, 17))
        at = rng.integers(header_end, len(base), size=k)
        for a in at:
            buf[a] = 0xFF if rng.random() < 0.3 else int(rng.integers(256))
        what = f"{k} data bytes from {int(at.min())}"
    return Mutant(index, kind, what, bytes(buf))


# -- hand-made hostile files --------------------------------------------------------------------

def rewrite_gguf(src: str | os.PathLike, dst: str | os.PathLike,
                 set_kv: dict[str, tuple[Any, ValueType, ValueType | None]] | None = None,
                 drop_kv: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = ()) -> str:
    """Copy a GGUF with metadata replaced (key -> (value, GGUF type, element type for arrays)),
    keys or tensors dropped: a valid file whose content says what a test wants."""
    hdr = read_header(src)
    set_kv = dict(set_kv or {})
    arch_kv = set_kv.pop("general.architecture", None)
    arch = arch_kv[0] if arch_kv else hdr.metadata.get("general.architecture", "llama")
    # a source's own general.alignment is written by the writer, right after the architecture
    w = GGUFWriter(dst, arch, alignment=hdr.alignment)
    for k, v in hdr.metadata.items():
        if k in drop_kv or k in set_kv or k in ("general.architecture", "general.alignment"):
            continue
        t = hdr.kv_types[k]
        w.add(k, v, t.type, t.element)
    for k, (v, vt, et) in set_kv.items():
        w.add(k, v, vt, et)
    data = np.frombuffer(hdr.mm, np.uint8)
    for info in hdr.tensors:
        if info.name in drop_tensors:
            continue
        start = hdr.data_offset + info.offset
        w.add_tensor(info.name, info.ne, info.type_id, data[start:start + info.nbytes])
    return w.write()


def patch_field(path: str | os.PathLike, match: str, value: int | Callable[[int], int],
                nth: int = 0) -> HeaderField:
    """Overwrite, in place, the nth fixed-size header field whose description contains
    `match` (e.g. "'blk.0.attn_q.weight': the data offset") with `value` (or value(old));
    the field as it was."""
    trace: list[HeaderField] = []
    read_header(path, trace)
    hits = [f for f in trace if match in f.what]
    if len(hits) <= nth:
        raise KeyError(f"no header field matching {match!r} (#{nth})")
    f = hits[nth]
    if callable(value):
        value = value(f.value)
    with open(path, "r+b") as fh:
        fh.seek(f.pos)
        fh.write(int(value).to_bytes(f.size, "little", signed=value < 0))
    return f


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")


def fuzz_bases(dirpath: Path) -> list[tuple[str, str, float]]:
    """(name, path, share of the cases) of the tiny files a fuzz run starts from: a Q4_1 llama
    with a chat template (so templates are fuzzed too) and a DeepSeek2 (MLA, MoE)."""
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama
    from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2

    llama = write_tiny_llama(dirpath / "llama_plain.gguf", TinyLlama(weight_type="q4_1"))
    llama = rewrite_gguf(llama, dirpath / "llama.gguf",
                         {"tokenizer.chat_template": (CHATML_TEMPLATE, ValueType.STRING, None)})
    return [("tiny llama", llama, 0.6), ("tiny deepseek2", write_tiny_deepseek2(
        dirpath / "deepseek2.gguf"), 0.3)]


# -- one case, in a worker -----------------------------------------------------------------------

def evaluate(path: str) -> tuple[str, str]:
    """(kind, detail) of running the file: ("ok", digest) or ("error", message) or
    ("traceback", text). Loads, tokenizes (through the chat template when the file has one)
    and evaluates a short prompt and two greedy tokens."""
    import hashlib
    import traceback

    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    try:
        eng = Engine(path, EngineConfig(n_ctx=64, n_ubatch=16, check_tensors=True))
        tok = eng.tokenizer
        text = tok.chat("Hi!") if tok.template else "Hello"
        ids = tok.encode(text)[-24:] or [0]
        logits = eng.eval(ids)
        h = hashlib.sha256(np.asarray(logits, np.float32).tobytes())
        for _ in range(2):
            t = int(np.argmax(logits))
            h.update(t.to_bytes(4, "little"))
            tok.decode([t])
            logits = eng.eval([t])
            h.update(np.asarray(logits, np.float32).tobytes())
        return "ok", h.hexdigest()
    except ValueError as e:  # GGUFError and every user-facing error derive from it
        msg = str(e)
        if msg and "\n" not in msg.strip():
            return "error", msg
        return "traceback", f"{type(e).__name__} with a multi-line message: {msg[:300]}"
    except Exception as e:  # noqa: BLE001 - counting these is the point
        tb = traceback.format_exc(limit=-3)
        return "traceback", f"{type(e).__name__}: {e}"[:300] + "\n" + tb[-700:]


def serve(answer: Callable[[str], tuple[str, str]]) -> None:
    """A worker's loop: read one request per line on stdin, write answer(request) as one JSON
    line on stdout, under a memory limit (GGRAPH_FUZZ_MEM_GB, default 8)."""
    import resource

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing else may write to the answer channel
    limit = config.fuzz_mem_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for line in sys.stdin:
        kind, detail = answer(line.rstrip("\n"))
        out.write(json.dumps({"kind": kind, "detail": detail}) + "\n")


def worker() -> None:
    """Read one file path per line on stdin, answer one JSON line per path on stdout."""
    serve(lambda line: evaluate(line.strip()))


class Worker:
    """A worker process that answers one JSON line per request line, within a timeout; a
    worker that dies or hangs is seen (signal, timeout) and must be replaced."""

    def __init__(self, module: str = "ggraph.graphs.testing.gguf_fuzz") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1)

    def ask(self, request: str, timeout: float) -> tuple[str, str]:
        """(kind, detail) of one request line (a path, or a JSON case)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            return "timeout", f"no answer within {timeout:.0f} s"
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            sig = -rc if rc < 0 else 0
            return ("signal", f"worker killed by {signal.Signals(sig).name}") if sig else \
                ("traceback", f"worker exited with status {rc}")
        ans = json.loads(line)
        return ans["kind"], ans["detail"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def fuzz(base_path: str | os.PathLike, n: int, seed: int = 0, timeout: float = 60.0,
         kinds: tuple[str, ...] = KINDS, progress: bool = False) -> FuzzReport:
    """Run n mutants of the file at base_path; the unmutated file must run cleanly."""
    base = Path(base_path).read_bytes()
    tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else None
    report = FuzzReport()
    w = Worker()
    try:
        with tempfile.TemporaryDirectory(dir=tmpdir) as d:
            path = os.path.join(d, "mutant.gguf")
            # the first case compiles kernels (or loads them from the cache): no timeout
            kind, good = w.ask(os.fspath(base_path), 600.0)
            if kind != "ok":
                raise RuntimeError(f"the unmutated file does not run: {kind}: {good}")
            items = mutants(base, n, seed, kinds)
            if progress:
                from tqdm import tqdm

                items = tqdm(items, total=n, desc="fuzzing", unit="case")
            for m in items:
                Path(path).write_bytes(m.data)
                kind, detail = w.ask(path, timeout)
                if kind in ("timeout", "signal", "traceback") and w.proc.poll() is not None:
                    w = Worker()
                outcome = {"ok": "same output" if detail == good else "different output",
                           "error": "clean error"}.get(kind, kind)
                # keep what the case was, not its bytes (SmolLM2 mutants are 90 MB each)
                report.results.append(CaseResult(replace(m, data=b""), outcome, detail))
    finally:
        w.close()
    return report


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
