"""llama.cpp as the reference, live or recorded.

A test that compares ggraph with llama.cpp asks `live()` for llama-cpp-python; where it is not
installed (CI's clean clone) it reads what llama.cpp answered on the same inputs, recorded by
scripts/record_llama_cpp.py under tests/data/llama_cpp/ (`recorded(name, ...)`). A recording
made from another model file than the one the test has (size, or sha256 for the small files
the tests write) is not used: the test skips, saying why, as it does when neither exists.
Arrays are stored as base64 of their little-endian bytes (`encode_array` / `array`)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

DATA = Path(__file__).parent / "data" / "llama_cpp"
RECORD = "python scripts/record_llama_cpp.py"
MIN_MARGIN = 0.5  # a greedy step whose top-2 logits are closer may go either way across builds


def live() -> Any:
    """The llama_cpp module, or None where llama-cpp-python cannot be imported."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_info(path: str | os.PathLike, exact: bool = True) -> dict:
    """What a recording says of the model file it was made from."""
    info = {"file": Path(path).name, "size": os.path.getsize(path)}
    if exact:
        info["sha256"] = sha256_file(path)
    return info


def recorded(name: str, model: str | os.PathLike | None = None, exact: bool = False,
             case: str | None = None) -> dict:
    """tests/data/llama_cpp/<name>.json (its entry `case` of "cases" if given). Skips when it
    is absent, or when `model` is not the file it (or the case) was recorded from: compared by
    size, and by sha256 too when `exact`."""
    path = DATA / f"{name}.json"
    where = f"tests/data/llama_cpp/{name}.json" + ("" if case is None else f" ({case!r})")
    if not path.exists():
        pytest.skip(f"llama-cpp-python is not installed and {where} is not recorded ({RECORD} "
                    "writes it)")
    rec = json.loads(path.read_text(encoding="utf-8"))
    if case is not None:
        if case not in rec["cases"]:
            pytest.skip(f"llama-cpp-python is not installed and {where} is not recorded "
                        f"({RECORD} writes it)")
        rec = rec["cases"][case]
    if model is not None:
        want = rec["model"]
        if os.path.getsize(model) != want["size"] or (
                exact and sha256_file(model) != want["sha256"]):
            pytest.skip(f"llama-cpp-python is not installed and {where} was recorded from "
                        f"another {want['file']} than {model} ({RECORD} records it again)")
    return rec


def encode_array(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(
        d["shape"]).copy()


def sure_steps(margins: list[float], min_margin: float = MIN_MARGIN) -> int:
    """How many greedy steps of a recording are safe to compare: those before the first whose
    top-2 logit margin is below `min_margin`."""
    return next((i for i, m in enumerate(margins) if m < min_margin), len(margins))


def llama_cpp_script(llama_cpp: Any, path: str, script: list[tuple], n_ctx: int,
                     n_seq_max: int, n_ubatch: int = 512, flash: bool = False,
                     unified: bool = True) -> list[np.ndarray]:
    """Run a script of batches and sequence operations through llama.cpp's low-level API
    (llama_decode on a llama_batch, llama_memory_seq_*), one unified KV cache or a stream per
    sequence (kv_unified false): the logits of each decode's flagged tokens. Steps: ("decode", tokens, seq_ids, pos, logits),
    ("rm", s, p0, p1), ("cp", src, dst, p0, p1), ("keep", s), ("add", s, p0, p1, delta)."""
    from llama_cpp._utils import suppress_stdout_stderr

    lc = llama_cpp
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    with suppress_stdout_stderr(disable=False):
        return _script(lc, path, script, n_ctx, n_seq_max, n_ubatch, flash, unified, mp)


def _script(lc: Any, path: str, script: list[tuple], n_ctx: int, n_seq_max: int,
            n_ubatch: int, flash: bool, unified: bool, mp: Any) -> list[np.ndarray]:
    model = lc.llama_model_load_from_file(path.encode(), mp)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_ctx, n_ubatch, n_seq_max
    cp.kv_unified = unified
    cp.flash_attn_type = 1 if flash else 0
    cp.n_threads = cp.n_threads_batch = 2
    ctx = lc.llama_init_from_model(model, cp)
    mem = lc.llama_get_memory(ctx)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    out: list[np.ndarray] = []
    try:
        for step in script:
            op, args = step[0], step[1:]
            if op == "decode":
                toks, seqs, pos, flags = args
                b = lc.llama_batch_init(len(toks), 0, n_seq_max)
                b.n_tokens = len(toks)
                for i, (t, ids, p, f) in enumerate(zip(toks, seqs, pos, flags)):
                    b.token[i], b.pos[i], b.logits[i] = t, p, bool(f)
                    b.n_seq_id[i] = len(ids)
                    for j, s in enumerate(ids):
                        b.seq_id[i][j] = s
                rc = lc.llama_decode(ctx, b)
                lc.llama_batch_free(b)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
                for i, f in enumerate(flags):
                    if f:
                        row = lc.llama_get_logits_ith(ctx, i)
                        out.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
            elif op == "rm":
                lc.llama_memory_seq_rm(mem, *args)
            elif op == "cp":
                lc.llama_memory_seq_cp(mem, *args)
            elif op == "keep":
                lc.llama_memory_seq_keep(mem, *args)
            elif op == "add":
                lc.llama_memory_seq_add(mem, *args)
            else:
                raise ValueError(f"unknown step {op!r}")
    finally:
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return out
