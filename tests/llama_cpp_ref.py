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
