"""Executors: how a backend runs a bound graph, after ggml's backend proper (ggml-backend-
impl.h: graph_compute, synchronize): the context each run enters, the calls in order, the
groups of nodes it runs as one call, and waiting for queued work.

`Executor` runs calls one after the other in the calling thread and fuses nothing: what a
host backend without threads of its own needs. The CPU's (backends/cpu/executor.py) chooses
its threads and fuses norm chains; CUDA's (backends/cuda/executor.py) makes its GPU current,
replays captured graphs and waits on its stream.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Mapping

from ggraph.ir.tensor import Tensor


class Executor:
    def run_context(self, key: Any = None) -> Any:
        """Entered around each graph run; `key` names the graph when the same one runs
        again."""
        return contextlib.nullcontext()

    def run_calls(self, calls: list[Callable[[], None]]) -> None:
        """Run a bound graph's calls in order."""
        for call in calls:
            call()

    def loop(self, calls: list[Callable[[], None]]) -> Callable[[], None]:
        """What runs a bound graph's calls each time the graph runs (run_calls over them
        here; the CPU's makes them from machine code once the graph runs again)."""
        return partial(self.run_calls, calls)

    def prepare(self, calls: list[Callable[[], None]]) -> None:
        """Told a newly bound graph's calls before `direct` makes each (nothing here; the
        CPU's compiles the kernels they lack, partly in helper processes)."""

    def direct(self, call: Callable[[], None]) -> Callable[[], None]:
        """A bound call as this backend runs it each time (the call itself here; the CPU's
        skips numba's dispatch)."""
        return call

    def fuse(self, order: list[Tensor], session: Any,
             observed: frozenset[Tensor] = frozenset()) -> Mapping[Tensor, Any]:
        """Groups of consecutive nodes of a planned graph's `order` (bound by `session`, a
        backends/base.py Session) run as one call, keyed by each group's first node:
        backends/fusion_rules.py Groups (`nodes`, the group in order; `call`, zero arguments,
        computing them all; `held`, where it leaves values it does not write to memory).
        `observed`: nodes an observer reads after their group (backends/observe.py), which a
        group must write or hold. None by default."""
        return {}

    def synchronize(self) -> None:
        """Wait for queued work (nothing is queued here)."""
