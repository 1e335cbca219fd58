"""Counting numba compilations: what a run compiles because numba's on-disk cache did not have
it (a first run, or a kernel edited since), so callers can announce the compile and keep it
out of their timings. numba signals each compilation with a "numba:compile" event; a kernel
loaded from the cache signals nothing. A kernel compiles the helpers it calls inside its own
compilation (nested events): `count` counts every function, `kernels` and `seconds` only the
outermost compilations, so the seconds are wall time spent compiling, not counted twice.
Kernels that helper processes compiled for this one (backends/cpu/compile_ahead.py) are told
to the open counts by `note_elsewhere`; their seconds are the helpers' and overlap this
process's.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class Compiles:
    """Compilations seen so far inside `counting()`."""
    count: int = 0        # numba functions compiled, helpers inside a kernel included
    kernels: int = 0      # outermost compilations (what a caller asked for)
    seconds: float = 0.0  # wall time inside the outermost compilations
    # each outermost compilation in order: (its function's qualified name, seconds)
    each: list[tuple[str, float]] = field(default_factory=list)


@contextlib.contextmanager
def counting() -> Iterator[Compiles]:
    """Count the numba functions compiled (not loaded from the cache) while the block runs, in
    any thread (numba compiles under one global lock)."""
    from numba.core import event

    seen = Compiles()
    lock = threading.Lock()
    nest = threading.local()   # per thread: open compilations, when the outermost began

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            depth = getattr(nest, "depth", 0)
            if depth == 0:
                nest.t0 = time.perf_counter()
            nest.depth = depth + 1
            with lock:
                seen.count += 1
                seen.kernels += depth == 0

        def on_end(self, ev: event.Event) -> None:
            nest.depth = getattr(nest, "depth", 1) - 1
            if nest.depth == 0:
                d = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
                name = getattr(getattr(d, "py_func", None), "__qualname__", "?")
                dt = time.perf_counter() - nest.t0
                with lock:
                    seen.seconds += dt
                    seen.each.append((name, dt))

    with _OPEN_LOCK:
        _OPEN.append(seen)
    try:
        with event.install_listener("numba:compile", Listener()):
            yield seen
    finally:
        with _OPEN_LOCK:
            _OPEN.remove(seen)


# the counts open now: a kernel compiled by a helper process for this one
# (backends/cpu/compile_ahead.py) fires no event here, so it is told to each of them
_OPEN: list[Compiles] = []
_OPEN_LOCK = threading.Lock()


def note_elsewhere(name: str, seconds: float) -> None:
    """Count a kernel compiled for this process by another (its qualified name, the seconds
    it took there) in every `counting()` block now open."""
    with _OPEN_LOCK:
        for seen in _OPEN:
            seen.count += 1
            seen.kernels += 1
            seen.seconds += seconds
            seen.each.append((name, seconds))
