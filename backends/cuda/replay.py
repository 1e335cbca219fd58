"""Replaying a bound graph's launches on a real GPU with less host work per token.

A decode step replays the same few hundred launches with the same arguments every token, and
numba's dispatcher spends 15-35 us of Python on each (typing every argument, finding the
overload, converting arrays to kernel parameters) before the driver sees it. Two cuts:

- `PreparedLaunch`: the first call goes through the dispatcher (which compiles); the second
  keeps what the dispatcher worked out (the compiled kernel, its flattened parameters, the
  launch configuration) and later calls hand them to cuda.core's launch directly, which is
  what numba's own `_Kernel.launch` does after its per-call work. Anything unexpected (a
  numba-cuda without these internals, a debug kernel, an argument numba would copy back)
  keeps the dispatcher path for that launch.
- `CallList` + `run_calls`: from a graph's third run, its launches are captured once into a
  CUDA graph on the backend's stream (cuStreamBeginCapture ... cuGraphInstantiate) and every
  later run is one cuGraphLaunch. Inputs are copied on the same stream before it, so the
  graph sees them. A capture that fails (a call that synchronizes or copies) ends the capture
  and the list runs launch by launch from then on.

Only in the "device" mode: the simulator and the PTX-only mode call launches as before.
GGRAPH_CUDA_FAST_LAUNCH=0 and GGRAPH_CUDA_GRAPHS=0 turn the two off.
"""
from __future__ import annotations

from ggraph import config
from functools import partial
from typing import Any, Callable

FAST_LAUNCH = config.cuda_fast_launch()
GRAPHS = config.cuda_graphs()
CAPTURE_AFTER = 2  # plain runs before capture: the first compiles, the second prepares


class PreparedLaunch:
    """kernel[grid, block, stream](*args), callable again and again."""

    __slots__ = ("kernel", "grid", "block", "stream", "args", "fast", "calls")

    def __init__(self, kernel: Any, grid: Any, block: Any, stream: Any, args: tuple) -> None:
        self.kernel, self.grid, self.block, self.stream, self.args = (kernel, grid, block,
                                                                      stream, args)
        self.fast: Callable[[], Any] | None = None
        self.calls = 0 if FAST_LAUNCH and stream else -1  # -1: dispatcher always

    def __call__(self) -> None:
        if self.fast is not None:
            if self.calls > 1:
                self.fast()
                return
            try:  # the first prepared launch proves the path; a failed one launched nothing
                self.fast()
                self.calls = 2
                return
            except Exception:  # noqa: BLE001 - keep the dispatcher for this launch
                self.fast, self.calls = None, -1
        self.kernel[self.grid, self.block, self.stream](*self.args)
        if self.calls >= 0:
            self.calls += 1
            if self.calls == 1:  # compiled by now: keep the dispatcher's work for next time
                self.fast = prepare(self.kernel, self.grid, self.block, self.stream, self.args)
                if self.fast is None:
                    self.calls = -1


def prepare(kernel: Any, grid: Any, block: Any, stream: Any, args: tuple
            ) -> Callable[[], Any] | None:
    """The launch with numba's per-call work done once, or None where that is not safe."""
    try:
        from numba.cuda import dispatcher as D

        cfg = kernel[grid, block, stream]
        sig = tuple(kernel.typeof_pyval(a) for a in args)
        k = kernel.overloads.get(sig)
        if k is None or getattr(k, "debug", False) or getattr(k, "extensions", None):
            return None
        params: list[Any] = []
        writeback: list[Any] = []
        for ty, val in zip(k.argument_types, args):
            k._prepare_args(ty, val, stream, writeback, params)
        if writeback:  # numba would copy a host array back after the kernel
            return None
        coop = {"is_cooperative" if D.CUDA_CORE_GE_1_0 else "cooperative_launch":
                getattr(k, "cooperative", False)}
        config = D.LaunchConfig(grid=cfg.griddim, block=cfg.blockdim, shmem_size=0, **coop)
        return partial(D.launch, stream, config, k._codelibrary.get_cufunc().kernel, *params)
    except Exception:  # noqa: BLE001 - internals of another numba-cuda: keep the dispatcher
        return None


class CallList(list):
    """A bound graph's calls, with its CUDA graph once captured."""

    def __init__(self, calls: list, stream: Any, capture: bool) -> None:
        super().__init__(calls)
        self.stream = stream
        self.runs = 0
        self.exec: Any = None
        self.capture = capture and GRAPHS and bool(stream)
        self.why_not = "" if self.capture else "off"

    def __del__(self) -> None:
        if self.exec is not None:
            try:
                _driver().cuGraphExecDestroy(self.exec)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


def _driver() -> Any:
    from cuda.bindings import driver as cu
    return cu


def _ok(result: Any, what: str) -> Any:
    """cuda.bindings returns (error, values...): the values, or RuntimeError."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def run_calls(calls: list) -> None:
    """Run a graph's calls: launch by launch, or as its captured CUDA graph."""
    if not isinstance(calls, CallList) or not calls.capture:
        for call in calls:
            call()
        return
    cu = _driver()
    if calls.exec is not None:
        _ok(cu.cuGraphLaunch(calls.exec, calls.stream.handle), "cuGraphLaunch")
        return
    calls.runs += 1
    if calls.runs <= CAPTURE_AFTER:
        for call in calls:
            call()
        return
    handle = calls.stream.handle
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    try:
        _ok(cu.cuStreamBeginCapture(handle, mode), "cuStreamBeginCapture")
    except Exception as e:  # noqa: BLE001 - no capture on this driver: run as before
        calls.capture, calls.why_not = False, str(e)
        run_calls(calls)
        return
    graph, failed = None, None
    try:
        for call in calls:
            call()
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured
        failed = e
    finally:
        try:
            graph = _ok(cu.cuStreamEndCapture(handle), "cuStreamEndCapture")
        except Exception as e:  # noqa: BLE001
            failed = failed or e
    if failed is None:
        try:
            calls.exec = _ok(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        except Exception as e:  # noqa: BLE001
            failed = e
    if failed is not None:
        calls.capture, calls.why_not = False, f"{type(failed).__name__}: {failed}"
        for call in calls:  # nothing ran during the capture: run this step now
            call()
        return
    _ok(cu.cuGraphLaunch(calls.exec, handle), "cuGraphLaunch")
