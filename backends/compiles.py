"""Counting numba compilations: what a run compiles because numba's on-disk cache did not have
it (a first run, or a kernel edited since), so callers can announce the compile and keep it
out of their timings. numba signals each compilation with a "numba:compile" event; a kernel
loaded from the cache signals nothing.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator


@dataclass
class Compiles:
    """Compilations seen so far inside `counting()`."""
    count: int = 0


@contextlib.contextmanager
def counting() -> Iterator[Compiles]:
    """Count the numba functions compiled (not loaded from the cache) while the block runs, in
    any thread (numba compiles under one global lock)."""
    from numba.core import event

    seen = Compiles()
    lock = threading.Lock()

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            with lock:
                seen.count += 1

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", Listener()):
        yield seen
