"""Several GPUs in one process, under numba's CUDA simulator with a fake driver of two GPUs.

The simulator has one GPU; `runtime.device_list` is replaced by two fake contexts that record
which ordinal is current on the thread. Every allocation, upload, launch and copy of a backend
must happen with its own GPU current, and its launches must queue on its own stream: the
checks a second real GPU would otherwise be needed for (`--devices cuda,cuda`).
"""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from sim_guard import require_simulator  # noqa: E402

require_simulator()

from ggraph.backends.cuda import runtime as R  # noqa: E402

from ggraph.backends import BackendUnavailableError  # noqa: E402
from ggraph.backends.cuda import CUDABackend  # noqa: E402

pytestmark = pytest.mark.cudasim
sys.setswitchinterval(5e-4)


class FakeGPU:
    """A driver context for one ordinal: entering makes it current on this thread."""

    current = threading.local()

    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal

    def __enter__(self) -> "FakeGPU":
        stack = FakeGPU.current.__dict__.setdefault("stack", [])
        stack.append(self.ordinal)
        return self

    def __exit__(self, *exc) -> None:
        FakeGPU.current.stack.pop()

    @staticmethod
    def now() -> int | None:
        stack = getattr(FakeGPU.current, "stack", [])
        return stack[-1] if stack else None


@pytest.fixture
def two_gpus(monkeypatch):
    """Two fake GPUs; returns the log of (what, ordinal current at the time) and, for
    launches, the stream each was queued on."""
    monkeypatch.setattr(R, "device_list", lambda: [FakeGPU(0), FakeGPU(1)])
    log: list[tuple] = []
    alloc, upload, bound = R.alloc_bytes, R.upload_bytes, R.bound

    def rec_alloc(n):
        log.append(("alloc", FakeGPU.now()))
        return alloc(n)

    def rec_upload(h):
        log.append(("upload", FakeGPU.now()))
        return upload(h)

    def rec_bound(kernel, grid, block, *args):
        call = bound(kernel, grid, block, *args)
        if call is None:
            return None
        stream = R.current_device().stream

        def run():
            log.append(("launch", FakeGPU.now(), stream))
            call()
        return run

    monkeypatch.setattr(R, "alloc_bytes", rec_alloc)
    monkeypatch.setattr(R, "upload_bytes", rec_upload)
    monkeypatch.setattr(R, "bound", rec_bound)
    return log


def test_each_backend_keeps_to_its_gpu(two_gpus, tmp_path):
    """The tiny llama over `--devices cuda,cuda` (and the host CPU): the layers on GPU 1 are
    allocated, uploaded and launched with GPU 1 current, on backend 1's stream; the same
    logits and greedy tokens as the CPU alone."""
    from ggraph.check.conformance import nmse
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    p = write_tiny_llama(tmp_path / "t.gguf", TinyLlama(n_layer=2, n_embd=32, n_head=2,
                                                        n_head_kv=1, n_ff=48))
    cfg = dict(n_ctx=16, n_ubatch=4, reserve_outputs="last")
    cpu = Engine(str(p), EngineConfig(**cfg))
    two = Engine(str(p), EngineConfig(devices="cuda,cuda", n_gpu_layers=2, **cfg))
    b0, b1 = two.session.sessions[0].backend, two.session.sessions[1].backend
    assert (b0.device.index, b1.device.index) == (0, 1)
    assert b0.device.stream is not b1.device.stream
    assert two.device_names[:2] == ["CUDA0", "CUDA1"]
    a, b = cpu.eval([5, 6]), two.eval([5, 6])
    for _ in range(2):
        assert nmse(a, b) < 1e-6
        tok = int(np.argmax(a))
        assert tok == int(np.argmax(b))
        a, b = cpu.eval([tok]), two.eval([tok])
    launches = [e for e in two_gpus if e[0] == "launch"]
    assert {e[1] for e in launches} == {0, 1}, "both GPUs ran kernels"
    assert all(e[1] is not None for e in two_gpus), "nothing ran with no GPU current"
    for ordinal, backend in ((0, b0), (1, b1)):
        assert all(e[2] is backend.device.stream for e in launches if e[1] == ordinal)
    # every layer's cache sits on its own device, with that device's dummies
    sch = two.session.schedule(two.worst_case.graph)
    assert {two.device_names[s.device] for s in sch.splits} >= {"CUDA0", "CUDA1"}
    assert b0.device.dummies is not b1.device.dummies


def test_threads_do_not_share_the_current_gpu(two_gpus):
    """CUDA's current device is per thread: backend 1 used from a second thread while backend
    0 is active on the first still allocates on GPU 1."""
    b0, b1 = CUDABackend(device=0), CUDABackend(device=1)
    seen = []
    with b0.device.active():
        t = threading.Thread(target=lambda: (b1.buffers.alloc(64), seen.append(FakeGPU.now())))
        t.start()
        t.join()
        b0.buffers.alloc(64)
    assert [e for e in two_gpus if e[0] == "alloc"] == [("alloc", 1), ("alloc", 0)]
    assert seen == [None]  # the thread's own stack is empty again afterwards


def test_an_ordinal_the_machine_lacks_is_refused_in_one_line(two_gpus):
    with pytest.raises(BackendUnavailableError, match=r"CUDA device 2 requested.*has 2"):
        CUDABackend(device=2)
