"""Running one structured fuzz case and sorting what happened: the settings a mutant runs at,
the case itself in a worker process (the Python API) or as `ggraph run` (the CLI), and the
rules that name its outcome.

A case is a file (a mutant of graphs/testing/gguf_mutate.py, or the base itself) run at one `Setting`:
n_ctx, n_ubatch, threads, flash attention, mmap, and a prompt kind: `short`, `long` (a prompt
that nearly fills the context, over several ubatches), `chat` (one message through the chat
template) or `cnv` (three turns, each rendered whole, generating with the context shift).
Through the API a case loads an Engine, decodes the vocabulary's first 4096 tokens, tokenizes
a probe text, renders and tokenizes the prompt, and generates greedily; the digest covers
every logit row sampled from, the tokens, their text and why generation stopped.

Outcomes, exactly:
- `clean error`: the API raised a ValueError (GGUFError, TooManyTokens, HostMemoryError and
  every other ggraph error derive from it) from ggraph's own code (the innermost frame of its
  traceback), but not from the graph machinery (op constructors, tensors, graphs, feeding
  inputs: an error there means a builder made a graph it should have refused to make), whose
  message is one non-empty line of at most MAX_MESSAGE characters; or `ggraph run` exited with
  status 1 (2: argparse's usage error for a flag value), with no traceback and exactly one
  `ggraph run: error: ...` line of at most MAX_MESSAGE characters on stderr;
- `same output` / `different output`: the case ran, and its digest (the CLI: its stdout) is or
  is not the base file's at the same setting and inputs;
- `traceback`: any other exception (another type, a ValueError from numpy, jinja, the Rust
  tokenizer, ggraph's ops or backends, a message of several lines or too long), any other
  exit status, or "Traceback" on the CLI's stderr;
- `signal`: the process was killed by a signal (SIGSEGV, SIGBUS, SIGABRT, the kernel's OOM
  SIGKILL); `timeout`: no answer within the case's time limit.
"""
from __future__ import annotations

from ggraph import config
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MAX_MESSAGE = 1000   # characters a clean error's message may have


@dataclass(frozen=True)
class Setting:
    name: str
    n_ctx: int
    n_ubatch: int
    threads: int
    flash_attn: bool
    prompt: str                  # short, long, chat, cnv
    n_predict: int
    n_keep: int | None = None    # None: generation stops when the context is full
    mmap: bool = True
    check_tensors: bool = True


SETTINGS: tuple[Setting, ...] = (
    Setting("c64 u16 t1 short", 64, 16, 1, False, "short", 3),
    Setting("c256 u16 t2 fa chat", 256, 16, 2, True, "chat", 3),
    Setting("c32 u4 t1 fa long", 32, 4, 1, True, "long", 2),
    Setting("c128 u32 t2 long", 128, 32, 2, False, "long", 2),
    Setting("c320 u64 t1 fa long", 320, 64, 1, True, "long", 2),     # attends past 256 cells
    Setting("c512 u64 t2 fa cnv", 512, 64, 2, True, "cnv", 4, n_keep=0),
    Setting("c24 u8 t1 shift", 24, 8, 1, False, "short", 40, n_keep=2, check_tensors=False),
    Setting("c192 u192 t2 no-mmap chat", 192, 192, 2, False, "chat", 3, mmap=False),
)
SETTING = {s.name: s for s in SETTINGS}

LONG_TEXT = " ".join(
    f"Section {i}: the quick brown fox jumps over the lazy dog, while {w} counts to {i * 7}; "
    f"nothing here is new, but the words differ a little each time ({w}-{i})."
    for i, w in enumerate(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta",
                           "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron",
                           "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi",
                           "omega"] * 2))
PROBE_TEXT = ("<|im_start|>user héllo wörld 世界 😀\n\t  123 <unk><s></s><bos> the thing "
              "<end_of_turn>\u2581x \x00 \ufffd")
# the last turn holds a lone surrogate: a byte that was not UTF-8, as Python decodes argv
TURNS = ("Hi!", "Tell me more.", "Caf\udce9, bye.")
SYSTEM = "Be brief."


# -- a case through the API, in the worker ------------------------------------------------------

class _HashSampler:
    """Greedy sampling that hashes each logit row it samples from; `on_first` runs between
    the prompt's evaluation and the first generated token's."""

    def __init__(self, h: Any, on_first: Any = None) -> None:
        self.h, self.on_first = h, on_first

    def accept_many(self, tokens: Any) -> None:
        pass

    def sample(self, logits: np.ndarray) -> int:
        self.h.update(np.asarray(logits, np.float32).tobytes())
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            first()
        return int(np.argmax(logits))


def change_file(path: str, action: str, arg: int) -> None:
    """What happens to the model file after loading (gguf_mutate.m_after_load)."""
    if action == "truncate":
        os.truncate(path, arg)
    elif action == "append":
        with open(path, "ab") as f:
            f.write(b"\x7f" * arg)
    elif action == "zero_tail":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(max(size - arg, 0))
            f.write(bytes(min(arg, size)))
    elif action == "touch":
        os.utime(path)
    elif action == "poke_keep_mtime":   # same size and time: the change is not seen
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(min(arg, st.st_size - 1))
            f.write(b"\xff")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif action == "replace":
        tmp = path + ".new"
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read()[::-1])
        os.replace(tmp, path)
    elif action == "unlink":
        os.unlink(path)
    elif action == "truncate_restore":  # shrink, then grow back to the size seen at load
        size = os.path.getsize(path)
        os.truncate(path, arg)
        os.truncate(path, size)
    else:
        raise AssertionError(f"unknown after-load action {action!r}")


def run_case(path: str, s: Setting, run: dict[str, Any]) -> str:
    """Run one case through the API; its digest. Errors propagate."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.gguf_mutate_inputs import text_of

    cfg = EngineConfig(n_ctx=s.n_ctx, n_ubatch=s.n_ubatch, flash_attn=s.flash_attn,
                       n_threads=s.threads, adaptive_threads=False,
                       check_tensors=s.check_tensors, use_mmap=s.mmap)
    for k, v in run.get("config", {}).items():
        setattr(cfg, k, v)
    after = run.get("after_load")
    eng = Engine(path, cfg)
    pending = [after] if after else []   # the change happens once, whatever runs first

    def change() -> None:
        if pending:
            a = pending.pop()
            change_file(path, a["action"], a["arg"])

    if after and after["when"] == "load":
        change()
    h = hashlib.sha256()
    tok = eng.tokenizer
    h.update(tok.decode(range(min(tok.n_vocab, 4096))).encode("utf-8", "replace"))
    h.update(np.asarray(tok.encode(PROBE_TEXT), np.int64).tobytes())
    n_ctx = eng.cfg.n_ctx
    n_predict = run.get("n_predict", s.n_predict)
    n_keep = run.get("n_keep", s.n_keep)
    limit = run.get("max_gen_ctx", 0) * n_ctx

    def generate(ids: Any) -> list[int]:
        out: list[int] = []
        for t in eng.generate(ids, n_predict, sampler=_HashSampler(h, change if pending else None),
                                  n_keep=n_keep):
            out.append(t)
            if limit and len(out) >= limit:
                break
        h.update(np.asarray(out, np.int64).tobytes() + eng.stop_reason.encode())
        h.update(tok.decode(out).encode("utf-8", "replace"))
        return out

    if "ids" in run:
        generate(run["ids"])
    elif "n_past" in run:
        eng.eval(tok.encode("Hello") or [0])
        eng.eval([0], n_past=run["n_past"])
    elif s.prompt == "cnv" and "text" not in run:
        messages = [{"role": "system", "content": SYSTEM}]
        for user in TURNS:
            messages.append({"role": "user", "content": user})
            text = tok.render(messages, max_chars=tok.chars_for(n_ctx) * len(messages))
            eng.reset()
            answer = generate(tok.encode(text, max_tokens=n_ctx - 4))
            messages.append({"role": "assistant", "content": tok.decode(answer)})
        h.update(tok.render(messages, add_generation_prompt=False,
                            max_chars=tok.chars_for(n_ctx) * len(messages)).encode(
            "utf-8", "surrogatepass"))
    else:
        if "text" in run:
            text = text_of(run["text"])
        elif s.prompt == "chat":
            text = tok.chat(TURNS[0], SYSTEM, max_chars=tok.chars_for(n_ctx))
        else:
            text = LONG_TEXT if s.prompt == "long" else "Hello"
        if s.prompt == "long" and "text" not in run:
            ids = tok.encode(text)[:max(n_ctx - 4 - n_predict, 1)]
        else:
            ids = tok.encode(text, max_tokens=n_ctx - 4)
        generate(ids)
    return h.hexdigest()


def _packages() -> tuple[str, ...]:
    """ggraph's package folders (an editable install maps graphs/, ops/, backends/, tools/)."""
    import importlib

    return tuple(os.path.dirname(os.path.abspath(importlib.import_module(m).__file__ or ""))
                 + os.sep for m in ("ggraph", "ggraph.graphs", "ggraph.ops", "ggraph.backends",
                                    "ggraph.tools"))


def _graph_machinery() -> tuple[str, ...]:
    """Where a ValueError means ggraph built a graph it should have refused to build: the op
    constructors' shape and type rules, tensors and views, graphs and the feeding of their
    inputs (path prefixes)."""
    import ggraph
    import ggraph.ops

    root = os.path.dirname(os.path.abspath(ggraph.__file__))
    ops = os.path.dirname(os.path.abspath(ggraph.ops.__file__))
    return (ops + os.sep,) + tuple(os.path.join(root, f) for f in (
        "tensor.py", "graph.py", "buffers.py", "reference.py", "opkind.py"))


_FUZZER = ("fuzz_cases.py", "fuzz_structured.py", "gguf_fuzz.py", "gguf_mutate.py",
           "gguf_mutate_inputs.py", "gguf_edit.py")


def clean_message(e: BaseException) -> str | None:
    """The message of a clean error (see the module's docstring), else None."""
    if not isinstance(e, ValueError):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    where = os.path.abspath(frames[-1].filename) if frames else ""
    if not where.startswith(_packages()) or where.startswith(_graph_machinery()) or \
            os.path.basename(where) in _FUZZER:
        return None
    msg = str(e).strip()
    if not msg or "\n" in msg or len(msg) > MAX_MESSAGE:
        return None
    return msg


def answer(line: str) -> tuple[str, str]:
    """The worker's answer to one JSON request: ("ok", digest), ("error", message) or
    ("traceback", what and where)."""
    req = json.loads(line)
    try:
        return "ok", run_case(req["path"], Setting(**req["setting"]), req.get("run", {}))
    except Exception as e:  # noqa: BLE001 - sorting these is the point
        msg = clean_message(e)
        if msg is not None:
            return "error", msg
        where = "".join(traceback.format_tb(e.__traceback__)[-3:])
        text = str(e)
        return "traceback", f"{type(e).__name__}: {text[:300]!r}{'...' if len(text) > 300 else ''}" \
            f" ({len(text)} chars, {text.count(chr(10)) + 1} lines)\n{where[-900:]}"


# -- a case through the CLI, from the parent -----------------------------------------------------

def cli_command(path: str, s: Setting, run: dict[str, Any], workdir: str
                ) -> tuple[list[str], bytes | None]:
    """`ggraph run`'s argv and stdin for a case (None when it has no CLI form)."""
    if any(k in run for k in ("ids", "n_past", "after_load")):
        raise ValueError("no CLI form")
    from ggraph.graphs.testing.gguf_mutate_inputs import text_of

    cfg = run.get("config", {})
    flags = {"n_ctx": "-c", "n_ubatch": "-ub", "type_k": "-ctk", "type_v": "-ctv",
             "amb_mib": "-amb", "n_threads": "-t", "reserve_outputs": "--reserve-outputs",
             "strategy": "--strategy"}
    n_predict = run.get("n_predict", s.n_predict)
    n_keep = run.get("n_keep", s.n_keep)
    if run.get("max_gen_ctx"):
        n_predict = run["max_gen_ctx"] * cfg.get("n_ctx", s.n_ctx)
    argv = [sys.executable, "-m", "ggraph.cli", "run", path, "-n", str(n_predict), "-c",
            str(s.n_ctx), "-ub", str(s.n_ubatch), "-t", str(s.threads), "-fa",
            "on" if s.flash_attn else "off", "--temp", "0", "--seed", "1"]
    argv += ["--check-tensors"] if s.check_tensors else []
    argv += [] if s.mmap else ["--no-mmap"]
    argv += ["--no-context-shift"] if n_keep is None else ["--keep", str(n_keep)]
    for k, v in cfg.items():
        if k in flags:
            argv += [flags[k], str(v)]
        elif k == "ggml_exact" and v:
            argv.append("--ggml-exact")
        elif k == "warmup" and not v:
            argv.append("--no-warmup")
    stdin = None
    if s.prompt == "cnv":   # the turns as bytes: the last is not UTF-8 (a stray \xe9)
        argv += ["-cnv", "-sys", SYSTEM]
        stdin = "".join(t + "\n" for t in TURNS).encode("utf-8", "surrogateescape")
    if "text" in run:       # the prompt (or -cnv's first turn) from a file
        prompt_file = os.path.join(workdir, "prompt.txt")
        with open(prompt_file, "wb") as f:
            text = text_of(run["text"])
            try:
                f.write(text.encode("utf-8", "surrogateescape"))
            except UnicodeEncodeError:
                f.write(text.encode("utf-8", "surrogatepass"))
        argv += ["-f", prompt_file]
    elif s.prompt == "chat":
        argv += ["--chat", "-sys", SYSTEM, "-p", TURNS[0]]
    elif s.prompt != "cnv":
        argv += ["-p", LONG_TEXT[:s.n_ctx // 2] if s.prompt == "long" else "Hello"]
    return argv, stdin


def run_cli(argv: list[str], stdin: bytes | None, timeout: float) -> tuple[str, str]:
    """("ok", stdout) / ("error", message) / ("traceback" | "signal" | "timeout", detail) of
    one `ggraph run`, under the workers' memory limit."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    limit = config.fuzz_mem_bytes()
    try:
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (limit, limit))
    except (ProcessLookupError, PermissionError):
        pass
    try:
        out, err = proc.communicate(stdin or b"", timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "timeout", f"ggraph run gave no answer within {timeout:.0f} s"
    text = err.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if proc.returncode < 0:
        return "signal", f"ggraph run killed by {signal.Signals(-proc.returncode).name}: " \
            f"{' | '.join(lines[-3:])[:500]}"
    if "Traceback (most recent call last)" in text:
        return "traceback", f"ggraph run printed a traceback: {' | '.join(lines[-4:])[:700]}"
    if proc.returncode == 0:
        return "ok", hashlib.sha256(out).hexdigest()
    errors = [ln for ln in lines if ln.startswith("ggraph run: error: ")]
    if proc.returncode in (1, 2) and len(errors) == 1 and len(errors[0]) <= MAX_MESSAGE:
        return "error", errors[0]
    return "traceback", f"ggraph run exited with status {proc.returncode}: " \
        f"{' | '.join(lines[-3:])[:500]}"


def request(path: str, s: Setting, run: dict[str, Any]) -> str:
    """The worker's request line for a case."""
    return json.dumps({"path": path, "setting": asdict(s), "run": run})


def worker() -> None:
    from ggraph.graphs.testing.gguf_fuzz import serve

    serve(answer)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    worker()
