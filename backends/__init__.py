"""ggraph.backends: devices that run graphs. `get_backend(name)` makes one by name; each
backend's kernel table says which nodes it supports."""
from __future__ import annotations

from typing import Any

from .errors import BackendUnavailableError

NAMES = ("cpu", "cuda")




def get_backend(name: str, **kw: Any) -> Any:
    name = name.strip().lower()
    if name == "cpu":
        from .cpu import CPUBackend

        return CPUBackend(**kw)
    if name == "cuda":
        from .cuda import CUDABackend

        return CUDABackend(**kw)  # BackendUnavailableError without a usable GPU
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(NAMES)}")
