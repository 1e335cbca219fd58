"""Test-suite settings: every Engine scans its weights for inf/NaN at load (llama.cpp's
--check-tensors), so a corrupted model file fails loudly in any test that loads one.

The CUDA simulator's suite runs in a process of its own
(tests/backends/cuda/test_cudasim_suite.py). It is started as soon as collection finds its
test, so it runs on one core beside the CPU tests (which spend most of their time compiling,
single-threaded), and its test is moved last, where it waits for the process: the two halves
overlap instead of adding up. The PTX gate (tests/backends/cuda/test_ptx_gate.py, ~2.5 minutes
of NVVM compiling where a CUDA toolkit is present) runs the same way, on the same core after
the simulator's processes, and so do BESIDE_MODULES after it (tests/test_beside.py): a cold
run (CI's: numba compiles every kernel) otherwise leaves that core idle for its last minutes."""
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

os.environ.setdefault("GGRAPH_CHECK_TENSORS", "1")

CUDASIM_TEST = "test_cudasim_suite.py::test_cuda_backend_under_simulator"
PTX_TEST = "test_ptx_gate.py::test_every_kernel_variant_the_checks_launch_passes_the_gate"
BESIDE_TEST = "test_beside.py::test_modules_run_beside_pass"
HERE = Path(__file__).parent
# CPU modules that compile many kernels of their own (the ggml-exact variants, every packed
# product and integer dot: 123 + 115 + 41 s of a cold run, measured): in a whole run they go to
# the background chain's process once the simulator and the PTX gate are done, where a core is
# free while this process still compiles alone (tests/test_beside.py waits for them); named on
# their own they run here
BESIDE_MODULES = ("backends/cpu/test_ggml_exact.py", "backends/cpu/test_qpack.py",
                  "backends/shared/test_qdot.py")


def cudasim_files() -> list[str]:
    """The modules the simulator's process runs: the CUDA backend's and gpu_check's."""
    return sorted(str(p) for p in (*HERE.rglob("test_cuda_*.py"), *HERE.rglob("test_gpu_*.py")))


class BackgroundRun:
    """Processes run one after the other in a thread (after another BackgroundRun's, if
    given), their output in a temporary file, waited for by the test that owns them."""

    def __init__(self, runs: list, after: "BackgroundRun | None" = None) -> None:
        self.out = tempfile.TemporaryFile(mode="w+")
        self.runs = runs
        self.after = after
        self.proc: subprocess.Popen | None = None
        self.rc = 0
        self.thread = threading.Thread(target=self._run_all, daemon=True)
        self.thread.start()

    def _run_all(self) -> None:
        if self.after is not None:
            self.after.thread.join()
        for cmd, env in self.runs:
            where = (f"{env.get('GGRAPH_CUDASIM_GEOMETRY', 'small')} geometry"
                     if env.get("NUMBA_ENABLE_CUDASIM") == "1" else "no simulator")
            self.out.write(f"$ {' '.join(cmd[3:])}  ({where})\n")
            self.out.flush()
            self.proc = subprocess.Popen(cmd, env=env, stdout=self.out,
                                         stderr=subprocess.STDOUT, text=True)
            self.rc = self.proc.wait() or self.rc

    def result(self, timeout: float) -> tuple[int, str]:
        """(exit status, output) once the processes end; killed after `timeout` seconds."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.runs.clear()
            if self.proc is not None:
                self.proc.kill()
            self.thread.join()
            self.rc = self.rc or -9
        self.out.seek(0)
        return self.rc, self.out.read()


class CudasimRun(BackgroundRun):
    """The simulator suite's processes: the CUDA modules at the simulator's small geometry,
    then a subset of conformance cases (every op, float and quantized) at the GPU's block and
    tile sizes (GGRAPH_CUDASIM_GEOMETRY=gpu; all of them: scripts/cudasim_gpu_geometry.sh)."""

    def __init__(self) -> None:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        pytest_ = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                   "cudasim"]
        super().__init__([
            (pytest_ + cudasim_files(), env),
            (pytest_ + [str(HERE / "backends" / "cuda" / "test_cuda_sim.py"),
                        "-k", "conformance_case"],
             dict(env, GGRAPH_CUDASIM_GEOMETRY="gpu", GGRAPH_CUDASIM_SUBSET="geometry")),
        ])


class PtxRun(BackgroundRun):
    """`ggraph gpu-check --ptx` over every kernel variant, its JSON in a temporary folder (a
    process of its own, not under the simulator: the PTX-only mode patches numba-cuda's
    device queries)."""

    def __init__(self, after: BackgroundRun | None = None) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.json = os.path.join(self.dir.name, "ptx.json")
        super().__init__([([sys.executable, "-m", "ggraph.tools.gpu_check", "--ptx", "--json",
                            self.json], dict(os.environ))], after=after)


class BesideRun(BackgroundRun):
    """BESIDE_MODULES in a pytest process of their own (no simulator)."""

    def __init__(self, after: BackgroundRun | None = None) -> None:
        super().__init__([([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *(str(HERE / m) for m in BESIDE_MODULES)], dict(os.environ))],
                         after=after)


_RUN = pytest.StashKey[CudasimRun]()
_PTX = pytest.StashKey[PtxRun]()
_BESIDE = pytest.StashKey[BesideRun]()


def _move_last(items: list, nodeid_end: str):
    """The collected test whose id ends so, moved to the end of the run (None if absent)."""
    found = next((it for it in items if it.nodeid.endswith(nodeid_end)), None)
    if found is not None:
        items.remove(found)
        items.append(found)
    return found


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: no process for a test that won't run
def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    if _move_last(items, CUDASIM_TEST) is not None:
        config.stash[_RUN] = CudasimRun()
    ptx = _move_last(items, PTX_TEST)
    if ptx is not None and ptx.module.toolkit_missing() is None:
        config.stash[_PTX] = PtxRun(after=config.stash.get(_RUN, None))
    if _move_last(items, BESIDE_TEST) is not None:
        beside = [it for it in items if any(it.nodeid.startswith(f"tests/{m}") or
                                            it.nodeid.startswith(m) for m in BESIDE_MODULES)]
        if beside:
            for it in beside:
                items.remove(it)
            config.hook.pytest_deselected(items=beside)
            config.stash[_BESIDE] = BesideRun(
                after=config.stash.get(_PTX, None) or config.stash.get(_RUN, None))


class TinyModels:
    """The tiny GGUFs of a session (graphs/testing's tiny writers), each written once:
    `made(writer, *args, **kw)` calls writer(path, *args, **kw) the first time and returns
    that path for the same writer and arguments after. The files are shared: a test that
    changes one works on a copy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[tuple, str] = {}

    def made(self, writer, *args, **kw) -> str:
        key = (writer.__module__, writer.__qualname__, repr(args), repr(sorted(kw.items())))
        if key not in self.paths:
            self.paths[key] = str(writer(self.root / f"m{len(self.paths)}.gguf", *args, **kw))
        return self.paths[key]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_models) -> str:
    """A tiny llama GGUF of the writer's defaults (graphs/testing/tiny.py); a test module that
    needs another shape defines its own `tiny` from `tiny_models`."""
    from ggraph.graphs.testing.tiny import write_tiny_llama

    return tiny_models.made(write_tiny_llama)


@pytest.fixture
def cudasim_run(request) -> CudasimRun:
    """The simulator suite's process started at collection (a fresh one if it was not)."""
    return request.config.stash.get(_RUN, None) or CudasimRun()


@pytest.fixture
def ptx_run(request) -> PtxRun:
    """The PTX gate's process started at collection (a fresh one if it was not)."""
    return request.config.stash.get(_PTX, None) or PtxRun()


@pytest.fixture
def beside_run(request) -> BesideRun | None:
    """BESIDE_MODULES' process started at collection (None: they ran in this process)."""
    return request.config.stash.get(_BESIDE, None)


def pytest_unconfigure(config):
    for key in (_BESIDE, _PTX, _RUN):  # the run ended early: no orphan
        run = config.stash.get(key, None)
        if run is not None:
            run.runs.clear()
            if run.proc is not None and run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()
