"""Settings read from the environment, in one place (the bottom layer: imports nothing of
ggraph). Each is read when asked for, never at import, and nothing here changes the
environment.

GGRAPH_CACHE is the folder of fetched models, synthetic models and numba's compiled kernels
(default: $XDG_CACHE_HOME/ggraph, else ~/.cache/ggraph).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The folder for fetched and synthetic models and the numba cache (GGRAPH_CACHE)."""
    base = os.environ.get("GGRAPH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ggraph")
    return Path(base)


def numba_cache_dir() -> str:
    """Where numba keeps compiled kernels: NUMBA_CACHE_DIR if the user set it, else the
    `numba` folder of cache_dir() (never inside the source tree)."""
    return os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "numba")
