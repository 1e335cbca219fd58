"""The runner interface: what a caller (the Engine) needs to run graphs, whether they run on
one backend (backends.base.Session) or are scheduled across several (backends.multi.
MultiSession).

A runner places pre-allocated tensors (weights, caches) on its devices, reserves every
device's compute buffer on a worst-case graph, runs graphs, reads and writes tensor values,
and returns its memory figures (MemoryFigures: bytes per device and buffer), which the model
side words as llama.cpp does (graphs/runtime/memory_words.py). Devices are indexed in priority
order with the host last; a single-backend runner has one device, index 0, which is its host.

This file owns the Protocol and the small records passed through it; the implementations
stay with their classes, so that a one-backend Session needs nothing from the scheduler.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor

if TYPE_CHECKING:
    from ggraph.plan.alloc import Plan
    from .observe import Observer


class ThreadGuard:
    """What makes a runner safe to share between threads: run/read/write serialise on one
    re-entrant lock (`with runner:` holds it across several calls), and a read from a thread
    other than the one whose run left the current values is refused, since that thread's
    next run may replace them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._run_thread: int | None = None       # thread whose run left the current values

    def __enter__(self) -> "ThreadGuard":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def mark_run(self) -> None:
        """The calling thread's run now owns the values in memory."""
        self._run_thread = threading.get_ident()

    def check_reader(self, t: Tensor) -> None:
        """RuntimeError unless the calling thread made the last run (or none was made)."""
        if self._run_thread is not None and self._run_thread != threading.get_ident():
            name = type(self).__name__
            raise RuntimeError(f"cannot read {t.describe()}: the last run on this {name} was "
                               f"made by another thread; use one {name} per thread or hold "
                               f"`with session:` around run and read")


@dataclass(frozen=True)
class ComputeBuffer:
    """One device's compute buffer as reserve() sized it: the device's name and its Plan."""
    device: str
    plan: Plan

    @property
    def size(self) -> int:
        return self.plan.size

    @property
    def baseline_size(self) -> int | None:
        """ggml-alloc's own size for the same graph where the chosen plan differs from it."""
        base = self.plan.baseline
        return base.size if base is not None and base.size != self.size else None


class LayerCounts(Protocol):
    """Where a model's layers run (graphs.placement.LayerMap): a device index per repeating
    layer and the output layer's device. Only the offload line of a multi-device runner
    reads it; a protocol keeps backends/ free of imports from graphs/."""
    layers: tuple[int, ...]
    output: int

    def count(self, device: int) -> int: ...


@dataclass(frozen=True)
class ModelMemory:
    """What the runner cannot know about the model when it counts its memory."""
    graph: Graph                   # the worst-case graph that reserve() sized the buffers on
    mapped_bytes: int              # every weight's bytes (the file's tensor data, mapped)
    kv: frozenset[Tensor]          # the KV cache tensors, told apart from the weights
    layers: LayerCounts            # the layer placement the weights were placed with


@dataclass(frozen=True)
class Offload:
    """Where the repeating layers went (a runner of several devices)."""
    offloaded: int                 # repeating layers not on the host
    total: int                     # repeating layers
    per_device: tuple[tuple[str, int], ...]   # (device, layers) in device order, host last
    output: str                    # the device of the output layer


@dataclass(frozen=True)
class MemoryFigures:
    """A runner's memory for one model, in bytes by device and buffer: figures, not words (the
    model side prints them in llama.cpp's wording: graphs/runtime/memory_words.py)."""
    mapped: tuple[tuple[str, int], ...]        # weights mapped from the file, by device
    model: tuple[tuple[str, int], ...]         # weight buffers by name (CPU_REPACK, CUDA0)
    kv: tuple[tuple[str, int], ...]            # KV cache bytes by device (several devices)
    compute: tuple[ComputeBuffer, ...]         # compute buffers as reserve() sized them
    nodes: int                                 # the worst-case graph's nodes
    splits: int | None = None                  # its splits across devices (several devices)
    offload: Offload | None = None             # where the layers went (several devices)
    baseline: bool = False                     # show ggml-alloc's size beside a plan's own


@runtime_checkable
class Runner(Protocol):
    """Runs graphs on one device or many; shared between threads as a Session is (run, read
    and write serialise on its lock, `with runner:` holds it across a run and its reads)."""

    @property
    def names(self) -> list[str]:
        """Device names in device-index order, the host last (["CPU"] for one CPU)."""
        ...

    @property
    def placement(self) -> Mapping[Tensor, int]:
        """Device index of every tensor placed so far."""
        ...

    def place(self, t: Tensor, device: int) -> None:
        """Put pre-allocated tensor `t` (a weight, a cache) on `device`."""
        ...

    def reserve(self, graph: Graph) -> list[ComputeBuffer]:
        """Size every device's compute buffer on this worst-case graph (host last)."""
        ...

    @property
    def plans(self) -> list[ComputeBuffer]:
        """What the last reserve() returned (empty before any)."""
        ...

    def run(self, graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None,
            observe: Observer | None = None) -> Runner:
        """Feed `inputs` and run `graph`; with `observe` (backends/observe.py: ggml's eval
        callback), the nodes its `ask` wants are handed to its `receive` as they are
        computed, in execution order (receive returning False stops the run)."""
        ...

    def read(self, t: Tensor) -> np.ndarray: ...

    def write(self, t: Tensor, values: np.ndarray) -> None: ...

    def synchronize(self) -> None: ...

    def memory_figures(self, model: ModelMemory) -> MemoryFigures:
        """Model, KV and compute buffer bytes per device, and the graph's figures."""
        ...

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...


def check_device(t: Tensor, device: int, names: Sequence[str]) -> None:
    """ValueError unless `device` indexes `names` (both runners' place())."""
    if not 0 <= device < len(names):
        raise ValueError(f"tensor {t.describe()} placed on device {device}; there are "
                         f"{len(names)} ({', '.join(names)})")
