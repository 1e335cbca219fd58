"""The CUDA executor (backends/executor.py): every run with its GPU current, a graph's calls
replayed as one captured CUDA graph from its third run (replay.py), the CUDA fusion pass, and
waiting on the GPU's stream."""
from __future__ import annotations

from typing import Any

from ggraph.ir.tensor import Tensor
from ..base import Session
from ..executor import Executor
from . import runtime as R
from .replay import run_calls


class CUDAExecutor(Executor):
    def __init__(self, device: Any) -> None:
        self.device = device

    def run_context(self, key: Any = None) -> Any:
        return self.device.active()

    def run_calls(self, calls: list) -> None:
        run_calls(calls)

    def fuse(self, order: list[Tensor], session: Session,
             observed: frozenset[Tensor] = frozenset()) -> Any:
        from .fusion import fuse

        return fuse(order, session, observed)

    def synchronize(self) -> None:
        with self.device.active():
            R.synchronize()
