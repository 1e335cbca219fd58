"""The real libggml as a reference, through cffi: run ggraph graphs on ggml's CPU backend and
ask ggml's own graph allocator (ggml_gallocr) how big a compute buffer a graph needs.

The library is located, loaded and checked by ggraph.check.ggml_cdefs (`load()`: $GGRAPH_LIBGGML,
else llama-cpp-python's build; declarations checked against the library, enum values read
from it).

A ggraph Graph becomes a ggml graph tensor by tensor, with the same types, ne, nb and view
offsets, in the same node order:
- mode "ops": every node through the matching ggml_* constructor with ggraph's params, and
  each result checked (type, ne, nb, view root and offset). This is what ggml itself builds.
- mode "raw" (allocator only): tensors created plainly and their op, src and nb fields written
  directly, for graphs whose ops ggml's constructors would refuse (random allocator DAGs with
  shape-free ops); ggml_gallocr reads nothing else.
A graph ggml cannot express (an op, type or param it lacks) raises GGMLUnsupported with the
reason. ggml reports a kernel it cannot run by aborting the process, so by default every ggml
call runs in a forked child (`isolate=True`); an abort becomes GGMLAborted with ggml's
assertion message.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import sys
import tempfile
import time
from typing import Any, Callable, TypeVar

import numpy as np

from ggraph.codecs import buffers
from ggraph.check.ggml_cdefs import (ENV_VAR, GGML, GGMLUnavailable, ensure_op,  # noqa: F401
                               find_libggml, load, new_context)
from ggraph.ir.graph import Graph
from ggraph.ops.registry import get_op
from ggraph.ir.tensor import Flag, Tensor

T = TypeVar("T")


class GGMLUnsupported(NotImplementedError, ValueError):
    """A graph that ggml cannot build or run; the message says why."""


class GGMLAborted(GGMLUnsupported):
    """ggml aborted (a GGML_ASSERT in a constructor or kernel) while handling a graph."""


# -- what ggml cannot express ------------------------------------------------------------

def unsupported_reason(lib: GGML, t: Tensor, kernels: bool = True) -> str | None:
    """Why ggml cannot build t with its constructor for t's op (or express t's params), or,
    with `kernels`, why ggml's CPU backend cannot run it; None when it can. The op's own
    record says what ggml lacks (GGMLMap.limits, .cpu_limits); nothing here names an op."""
    if t.op is None:
        return None if t.is_contiguous() else f"leaf {t.describe()} is not contiguous"
    ensure_op(lib, t.op)  # a record registered after load() is probed on first use
    if t.op in lib.missing:
        return lib.missing[t.op]
    if t.op not in lib.op:
        return f"ggml has no op for ggraph's {t.op}"
    ggml = get_op(t.op).ggml
    return ggml.reason(t, kernels) if ggml is not None else None


def graph_unsupported(graph: Graph, kernels: bool = True) -> str | None:
    """The first reason ggml cannot build (or, with `kernels`, run) graph; None if it can."""
    lib = load()
    for t in list(graph.leafs) + list(graph.nodes):
        why = unsupported_reason(lib, t, kernels)
        if why:
            return why
    return None


# -- translation ---------------------------------------------------------------------------

class _Translation:
    """ggml tensors and a ggml graph mirroring one ggraph Graph (see the module doc)."""

    def __init__(self, lib: GGML, graph: Graph, mode: str, plan_only: bool) -> None:
        if mode not in ("ops", "raw"):
            raise ValueError(f"mode must be 'ops' or 'raw', got {mode!r}")
        self.lib, self.graph, self.mode = lib, graph, mode
        self.T: dict[int, Any] = {}
        self.pre_ctx = self.pre_buf = self.buf = None
        b = lib.base
        tensors = list(graph.leafs) + list(graph.nodes)
        size = max(2048, len(graph.nodes), len(graph.leafs)) + 16
        self.ctx = new_context(lib, len(tensors), no_alloc=True, graph_size=size)
        try:
            if plan_only:  # weights, caches, leafs with data: memory outside the compute buffer
                pre = [t for t in graph.leafs if t.view_src is None and t.is_preallocated]
                if pre:
                    self.pre_ctx = new_context(lib, len(pre), no_alloc=True)
                    for t in pre:
                        self._leaf(t, self.pre_ctx)
                    buft = b.ggml_backend_cpu_buffer_type()
                    self.pre_buf = b.ggml_backend_alloc_ctx_tensors_from_buft(self.pre_ctx, buft)
            for t in graph.leafs:
                if id(t) not in self.T:
                    self._leaf(t, self.ctx)
            for t in graph.nodes:
                self.T[id(t)] = self._node(t)
                self._check(t)
            self.cgraph = b.ggml_new_graph_custom(self.ctx, size, False)
            for t in graph.nodes:
                b.ggml_build_forward_expand(self.cgraph, self.T[id(t)])
            n = b.ggml_graph_n_nodes(self.cgraph)
            if n != len(graph.nodes) or any(b.ggml_graph_node(self.cgraph, i) != self.T[id(t)]
                                            for i, t in enumerate(graph.nodes)):
                raise GGMLUnsupported(f"ggml's graph holds {n} nodes in another order than "
                                      f"ggraph's {len(graph.nodes)}")
            for t in tensors:
                if t.flags & Flag.INPUT:
                    b.ggml_set_input(self.T[id(t)])
                if t.flags & Flag.OUTPUT:
                    b.ggml_set_output(self.T[id(t)])
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        b = self.lib.base
        for buf in (self.buf, self.pre_buf):
            if buf is not None and buf != self.lib.ffi.NULL:
                b.ggml_backend_buffer_free(buf)
        for ctx in (self.ctx, self.pre_ctx):
            if ctx is not None:
                b.ggml_free(ctx)
        self.buf = self.pre_buf = self.ctx = self.pre_ctx = None

    def _leaf(self, t: Tensor, ctx: Any) -> None:
        if not t.is_contiguous():
            raise GGMLUnsupported(f"leaf {t.describe()} is not contiguous (nb={list(t.nb)})")
        g = self.lib.base.ggml_new_tensor_4d(ctx, int(t.type), *t.ne)
        self._name(g, t)
        self.T[id(t)] = g

    def _name(self, g: Any, t: Tensor) -> None:
        if t.name:
            self.lib.base.ggml_set_name(g, t.name.encode("utf-8", "replace")[:63])

    def _node(self, t: Tensor) -> Any:
        if self.mode == "raw":
            return self._raw(t)
        why = unsupported_reason(self.lib, t, kernels=False)
        if why:
            raise GGMLUnsupported(why)
        b, ffi, ctx = self.lib.base, self.lib.ffi, self.ctx
        S = [self.T[id(x)] if x is not None else ffi.NULL for x in t.src]
        g = get_op(t.op).ggml_build(b, ctx, t, S)  # each op record knows its ggml call
        self._name(g, t)
        return g

    def _raw(self, t: Tensor) -> Any:
        """A tensor with t's geometry whose op/src fields are written directly."""
        b, lib = self.lib.base, self.lib
        ensure_op(lib, t.op)
        if t.op not in lib.op:
            raise GGMLUnsupported(lib.missing.get(t.op, f"ggml has no op for {t.op}"))
        if t.view_src is not None:
            g = b.ggml_view_4d(self.ctx, self.T[id(t.view_src)], *t.ne, *t.nb[1:], t.view_offs)
        else:
            g = b.ggml_new_tensor_4d(self.ctx, int(t.type), *t.ne)
        for i in range(4):
            g.nb[i] = t.nb[i]
        g.op = lib.op[t.op]
        if t.op in lib.sub:
            g.op_params[0] = lib.sub[t.op]
        if len(t.src) > len(g.src):
            raise GGMLUnsupported(f"{t.describe()} has {len(t.src)} sources, ggml holds "
                                  f"{len(g.src)}")
        for i, s in enumerate(t.src):
            g.src[i] = self.T[id(s)] if s is not None else lib.ffi.NULL
        self._name(g, t)
        return g

    def _check(self, t: Tensor) -> None:
        g, ffi = self.T[id(t)], self.lib.ffi
        got = (int(g.type), tuple(g.ne), tuple(g.nb))
        want = (int(t.type), t.ne, t.nb)
        if got != want:
            raise GGMLUnsupported(f"ggml builds {t.op} {t.describe()} as type id {got[0]}, "
                                  f"ne={list(got[1])}, nb={list(got[2])}; ggraph has type id "
                                  f"{int(t.type)}, nb={list(t.nb)}")
        if t.view_src is not None:
            root = self.T[id(t.view_src)]
            if g.view_src != root or int(g.view_offs) != t.view_offs:
                raise GGMLUnsupported(f"ggml's {t.op} view of {t.describe()} does not alias "
                                      f"{t.view_src.describe()} at offset {t.view_offs}")
        elif g.view_src != ffi.NULL:
            raise GGMLUnsupported(f"ggml builds {t.op} {t.describe()} as a view (ggraph: not)")


# -- running in a child process -------------------------------------------------------------

def isolated(fn: Callable[[], T], timeout: float = 600.0) -> T:
    """Run fn in a forked child (ggml aborts the process on what it cannot do); its result or
    exception comes back through a pipe; an abort raises GGMLAborted with ggml's message, a
    child still running after `timeout` seconds is killed (TimeoutError)."""
    if not hasattr(os, "fork"):
        return fn()
    sys.stdout.flush()
    sys.stderr.flush()
    rfd, wfd = os.pipe()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(rfd)
            os.environ["GGML_NO_BACKTRACE"] = "1"  # ggml would attach gdb before aborting
            faulthandler.disable()  # an abort is an answer here, not a crash to report
            os.dup2(err.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                out: tuple = ("ok", fn())
            except GGMLUnsupported as e:
                out = ("unsupported", str(e))
            except BaseException as e:  # noqa: BLE001 - sent to the parent
                out = ("error", f"{type(e).__name__}: {e}")
            with os.fdopen(wfd, "wb") as f:
                f.write(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(rfd, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([f], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"the ggml child process ran past {timeout:.0f} s; killed")
            chunk = f.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    data = b"".join(chunks)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    log = err.read().decode("utf-8", "replace")
    err.close()
    if not data:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
        msg = next((ln for ln in lines if "GGML_ASSERT" in ln or "GGML_ABORT" in ln
                    or "error" in ln.lower()), lines[0] if lines else "no message")
        msg = msg.split("/")[-1] if "/ggml" in msg else msg
        raise GGMLAborted(f"ggml aborted (signal {sig}): {msg}")
    kind, value = pickle.loads(data)
    if kind == "ok":
        return value
    if kind == "unsupported":
        raise GGMLUnsupported(value)
    raise RuntimeError(f"in the ggml child process: {value}")


def _maybe_isolated(isolate: bool, fn: Callable[[], T]) -> T:
    return isolated(fn) if isolate else fn()


# -- computing -----------------------------------------------------------------------------

def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def run_graph(graph: Graph, outputs: list[Tensor], n_threads: int | None = None
              ) -> list[np.ndarray]:
    """Compute graph on ggml's CPU backend (in this process); values of `outputs` in numpy
    order (float32 for float and quantized types, ints as is).

    n_threads > 1 makes ggml run an OpenMP team (llama-cpp-python builds ggml with OpenMP);
    libgomp hangs in a forked child whose parent already started a team (numba's omp
    threading layer does), so isolated runs use one thread."""
    lib = load()
    b, ffi = lib.base, lib.ffi
    tr = _Translation(lib, graph, "ops", plan_only=False)
    backend = None
    try:
        tr.buf = b.ggml_backend_alloc_ctx_tensors_from_buft(tr.ctx,
                                                             b.ggml_backend_cpu_buffer_type())
        if tr.buf == ffi.NULL:
            raise MemoryError("ggml could not allocate the tensors of the graph")
        b.ggml_backend_buffer_clear(tr.buf, 0)  # caches without data start at zero
        for t in graph.leafs:
            if t.data is not None and t.view_src is None:
                data = np.ascontiguousarray(t.data)
                b.ggml_backend_tensor_set(tr.T[id(t)], ffi.from_buffer(data), 0, data.nbytes)
        backend = lib.cpu.ggml_backend_cpu_init()
        lib.cpu.ggml_backend_cpu_set_n_threads(backend, n_threads or default_threads())
        for t in graph.nodes:
            if t.op is not None and not t.op.is_view and not b.ggml_backend_supports_op(
                    backend, tr.T[id(t)]):
                raise GGMLUnsupported(f"ggml's CPU backend does not support {t.describe()}")
        status = b.ggml_backend_graph_compute(backend, tr.cgraph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute: "
                               f"{lib.s(b.ggml_status_to_string(status))}")
        out = []
        for t in outputs:
            root = t.owner
            raw = np.empty(root.nbytes, np.uint8)
            b.ggml_backend_tensor_get(tr.T[id(root)], ffi.from_buffer(raw), 0, raw.nbytes)
            out.append(buffers.read(raw, t.view_offs, t))
        return out
    finally:
        if backend is not None:
            b.ggml_backend_free(backend)
        tr.free()


class GGMLReference:
    """The real ggml as the conformance oracle: `run(graph, out)` -> out's values (numpy order,
    float32 / ints); `supports(graph)` -> (bool, reason)."""

    def __init__(self, isolate: bool = True) -> None:
        self.lib = load()
        self.isolate = isolate

    def describe(self) -> str:
        return self.lib.describe()

    def supports(self, graph: Graph) -> tuple[bool, str]:
        why = graph_unsupported(graph)
        return (why is None, why or "")

    def run(self, graph: Graph, out: Tensor) -> np.ndarray:
        why = graph_unsupported(graph)
        if why:
            raise GGMLUnsupported(why)
        ggml = get_op(out.op).ggml if out.op is not None else None
        canonical = ggml.canonical if ggml is not None else None
        # an op whose ggml result is put in ggraph's form reads its sources' values too
        outs = [out] + ([x for x in out.src if x is not None] if canonical else [])
        vals = (isolated(lambda: run_graph(graph, outs, n_threads=1)) if self.isolate
                else run_graph(graph, outs))
        return canonical(out, vals[0], vals[1:]) if canonical else vals[0]


# -- the allocator ---------------------------------------------------------------------------

def _gallocr_size(graph: Graph, mode: str) -> int:
    lib = load()
    b, ffi = lib.base, lib.ffi
    tr = _Translation(lib, graph, mode, plan_only=True)
    galloc = None
    try:
        galloc = b.ggml_gallocr_new(b.ggml_backend_cpu_buffer_type())
        if not b.ggml_gallocr_reserve(galloc, tr.cgraph):
            raise MemoryError("ggml_gallocr_reserve failed to allocate the compute buffer")
        return int(b.ggml_gallocr_get_buffer_size(galloc, 0))
    finally:
        if galloc is not None and galloc != ffi.NULL:
            b.ggml_gallocr_free(galloc)
        tr.free()


def ggml_gallocr_size(graph: Graph, alignment: int | None = None, mode: str = "ops",
                      isolate: bool = True) -> int:
    """Bytes of the compute buffer ggml_gallocr reserves for `graph` on the CPU buffer type.

    The same INPUT/OUTPUT flags are set; pre-allocated tensors (weights, KV caches, leafs
    with data) get memory from a separate buffer first, so gallocr skips them as ggraph's
    planner does. `alignment` must be the CPU buffer type's (None: take it); mode "ops" builds
    nodes through ggml's constructors, "raw" writes op/src fields (see the module doc)."""
    lib = load()
    if alignment is not None and alignment != lib.alignment:
        raise ValueError(f"ggml's CPU buffer type aligns to {lib.alignment} bytes in this build; "
                         f"ggml_gallocr cannot be asked for alignment {alignment}")
    if mode == "ops":
        why = graph_unsupported(graph, kernels=False)
        if why:
            raise GGMLUnsupported(why)
    return _maybe_isolated(isolate, lambda: _gallocr_size(graph, mode))


__all__ = ["GGMLReference", "GGMLUnavailable", "GGMLUnsupported", "GGMLAborted", "GGML",
           "load", "find_libggml", "ggml_gallocr_size", "run_graph", "graph_unsupported",
           "unsupported_reason", "isolated", "ENV_VAR"]
