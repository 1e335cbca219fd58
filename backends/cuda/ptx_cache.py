"""The PTX gate's disk cache (`ggraph gpu-check --ptx`, backends/cuda/ptx.py): a kernel
variant's PTX, and ptxas's figures for a PTX text, kept in cache_dir()/ptx, so that a gate
over kernels that did not change skips libNVVM (~1-3 s a variant) and ptxas.

A variant's PTX is found by its bound kernel's name, which ends in the key of every source
file and value it is compiled from (backends/jit.py), its argument types, the compute
capability, numba-cuda's version, the libdevice it links and runtime.py (whose device
helpers the key does not cover); kernels not bound through
Target.bind (no such key) compile every time, and so does a variant that failed to compile
(its error is reported afresh). ptxas's figures are found by the PTX text's own sha1, the
architecture and ptxas's version line. GGRAPH_PTX_CACHE=0 turns both off.

Entries are small files written whole (a temporary file renamed), so two gates at once, or
one killed midway, leave no half-written entry; one that does not parse is compiled again.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ggraph import config
from ..jit import file_hash


def folder() -> Path:
    return config.cache_dir() / "ptx"


def _name(*parts: Any) -> str:
    return hashlib.sha1("|".join(str(p) for p in parts).encode()).hexdigest()


def _read(name: str | None) -> bytes | None:
    if not name or not config.ptx_cache():
        return None
    try:
        return (folder() / name).read_bytes()
    except OSError:
        return None


def _write(name: str, data: bytes) -> None:
    if not config.ptx_cache():
        return
    d = folder()
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, d / name)
    except OSError:   # a read-only or full cache only costs the next gate its time
        pass


def variant_name(kernel: Any, signature: tuple, cc: tuple[int, int], libdevice: str
                 ) -> str | None:
    """The cache entry of one kernel variant's PTX (None: a kernel without a derived key)."""
    key = getattr(kernel, "ggraph_key", None)
    if key is None:
        return None
    import numba_cuda

    # runtime.py too: the device versions of shared helpers it binds (np.rint's, mul_rn's)
    # are not among the sources the key covers
    return _name("ptx", kernel.py_func.__qualname__, key, signature, cc,
                 numba_cuda.__version__, file_hash(libdevice),
                 file_hash(Path(__file__).with_name("runtime.py"))) + ".ptx.gz"


def load_ptx(name: str | None) -> str | None:
    data = _read(name)
    if data is None:
        return None
    try:
        return gzip.decompress(data).decode()
    except (OSError, EOFError, UnicodeDecodeError):
        return None


def save_ptx(name: str | None, ptx: str) -> None:
    if name and ptx:
        _write(name, gzip.compress(ptx.encode(), 6))


@functools.lru_cache(maxsize=None)
def ptxas_version(ptxas: str) -> str:
    """ptxas's last --version line (its release and build)."""
    try:
        out = subprocess.run([ptxas, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = out.strip().splitlines()
    return lines[-1] if lines else ""


def figures_name(ptxas: str, ptx: str, cc: tuple[int, int]) -> str | None:
    """The cache entry of ptxas's figures for this PTX text (None: ptxas's version unknown)."""
    version = ptxas_version(ptxas)
    if not version:
        return None
    return _name("ptxas", hashlib.sha1(ptx.encode()).hexdigest(), cc, version) + ".json"


def load_figures(name: str | None) -> dict[str, int] | None:
    data = _read(name)
    if data is None:
        return None
    try:
        got = json.loads(data)
    except ValueError:
        return None
    return got if isinstance(got, dict) and all(isinstance(v, int) for v in got.values()) \
        else None


def save_figures(name: str | None, figures: dict[str, int]) -> None:
    if name:
        _write(name, json.dumps(figures, sort_keys=True).encode())
