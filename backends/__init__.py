"""ggraph.backends: devices that run graphs. `get_backend(name)` makes one by name (the device
registry, backends/registry.py, resolves every kind); each backend's kernel table says which
nodes it supports."""
from __future__ import annotations

from typing import Any

from .numba_cache import install as _install_cache_locator

# where numba caches the kernels (by package, not by folder), set before any is decorated
_install_cache_locator()

from .errors import BackendUnavailableError  # noqa: E402
from .registry import NAMES, make_backend  # noqa: E402

__all__ = ["BackendUnavailableError", "NAMES", "get_backend"]


def get_backend(name: str, **kw: Any) -> Any:
    """A backend of kind `name` (cpu, cuda, cuda:N; BackendUnavailableError where the machine
    cannot run it), made with the backend's keyword arguments."""
    return make_backend(name, **kw)
