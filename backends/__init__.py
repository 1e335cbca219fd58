"""ggraph.backends: devices that run graphs. `get_backend(name)` makes one by name; each
backend's kernel table says which nodes it supports."""
from __future__ import annotations

from typing import Any

NAMES = ("cpu", "cuda")


class BackendUnavailableError(ValueError):
    """A backend this machine cannot run (no CUDA driver or GPU). A ValueError with a one-line
    message, so callers (the scheduler, Engine, the `ggraph` commands) report it as a user
    error rather than a traceback."""


def get_backend(name: str, **kw: Any) -> Any:
    name = name.strip().lower()
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend(**kw)
    if name == "cuda":
        from .cuda import CUDABackend

        return CUDABackend(**kw)  # BackendUnavailableError without a usable GPU
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(NAMES)}")
