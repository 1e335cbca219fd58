"""Every GGRAPH_* setting read from the environment, in one place (the bottom layer: it imports
nothing of ggraph). Each is read when its function is called, never when this module is
imported, and nothing here changes the environment; modules that fix a setting for their
lifetime (a compiled kernel's flags) call the function once when they load.

| variable | default | what it changes |
|---|---|---|
| GGRAPH_CACHE | $XDG_CACHE_HOME/ggraph or ~/.cache/ggraph | where fetched and synthetic models and numba's compiled kernels live |
| GGRAPH_ADAPTIVE_THREADS | 1 | 0: every CPU run uses all its threads (no governor) |
| GGRAPH_FUSE | 1 | 0: no fused node groups on either backend |
| GGRAPH_NUMBA_PARALLEL | 1 | 0: CPU kernels without numba's parallel loops |
| GGRAPH_PARALLEL_MIN_PRODUCT | 65536 | the smallest product a CPU kernel splits over threads |
| GGRAPH_EXACT_ACTIVATIONS | 0 | 1: mat-muls keep f32 activations (not ggml's vec_dot_type rounding) |
| GGRAPH_CPU_DIRECT_CALLS | 1 | 0: every CPU kernel call through numba's dispatcher |
| GGRAPH_CPU_NATIVE_LOOP | 1 | 0: each CPU kernel call made by Python, not from one native loop |
| GGRAPH_CPU_TEAM | 1 | 0: a native run's products forked and joined one by one, not by one team |
| GGRAPH_HUGEPAGES | 1 | 0: packed CPU weights on ordinary pages, not 2 MiB-aligned huge-page-advised mappings |
| GGRAPH_CUDA_FAST_LAUNCH | 1 | 0: every CUDA launch through numba's dispatcher |
| GGRAPH_CUDA_GRAPHS | 1 | 0: no CUDA graph capture of decode steps |
| GGRAPH_CUDA_TORCH | 1 | 0: no torch tensor-core GEMMs |
| GGRAPH_PTX_CACHE | 1 | 0: the PTX gate compiles and assembles every kernel variant afresh |
| GGRAPH_CUDASIM_GEOMETRY | small | gpu: the GPU's kernel geometry under numba's simulator |
| GGRAPH_LIBGGML | llama-cpp-python's build | the libggml the ggml comparisons load |
| GGRAPH_LLAMA_BIN | ~/.cache/llamacpp-tools/build/bin | the folder of llama.cpp's programs (llama-batched-bench) the benchmarks run as peers |
| GGRAPH_CHECK_TENSORS | 0 | 1: scan weights for inf/NaN at load (the test suite sets it) |
| GGRAPH_FUZZ_MEM_GB | 8 | each fuzzing child's address-space limit |

(The test suite's own switches, GGRAPH_CUDASIM_ALL, GGRAPH_CUDASIM_SUBSET and GGRAPH_DOT_OUT,
are read by tests/conftest.py and the tests that use them.)
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


def _flag(var: str, default: bool) -> bool:
    """A switch: "0" turns off a default-on setting, "1" turns on a default-off one."""
    v = os.environ.get(var)
    if v is None or v == "":
        return default
    return v != "0" if default else v == "1"


def _int(var: str, default: int) -> int:
    v = os.environ.get(var)
    if v is None or v.strip() == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"${var}={v[:40]!r} is not an integer") from None


# ---- the CPU backend -----------------------------------------------------------------------

def adaptive_threads() -> bool:
    """GGRAPH_ADAPTIVE_THREADS=0: every run uses all the backend's threads (no governor)."""
    return _flag("GGRAPH_ADAPTIVE_THREADS", True)


def direct_calls() -> bool:
    """GGRAPH_CPU_DIRECT_CALLS=0: bound CPU kernel calls go through numba's dispatcher."""
    return _flag("GGRAPH_CPU_DIRECT_CALLS", True)


def native_loop() -> bool:
    """GGRAPH_CPU_NATIVE_LOOP=0: a CPU graph's calls are made by Python each time, not from
    machine code once the graph runs again (backends/cpu/native_loop.py)."""
    return _flag("GGRAPH_CPU_NATIVE_LOOP", True)


def cpu_team() -> bool:
    """GGRAPH_CPU_TEAM=0: a native CPU run's parallel kernels fork and join numba's threads
    each, rather than one team of threads making the whole run (backends/cpu/team.py)."""
    return _flag("GGRAPH_CPU_TEAM", True)


def compile_ahead() -> bool:
    """GGRAPH_COMPILE_AHEAD=0: a graph's missing CPU kernels compile in this process only, not
    partly in helper processes (backends/cpu/compile_ahead.py)."""
    return _flag("GGRAPH_COMPILE_AHEAD", True)


def fuse() -> bool:
    """GGRAPH_FUSE=0: the backends run every node alone (no fused groups)."""
    return _flag("GGRAPH_FUSE", True)


def numba_parallel() -> bool:
    """GGRAPH_NUMBA_PARALLEL=0: the CPU kernels compile without numba's parallel loops."""
    return _flag("GGRAPH_NUMBA_PARALLEL", True)


def parallel_min_product() -> int:
    """GGRAPH_PARALLEL_MIN_PRODUCT: the smallest product (elements x work) a CPU kernel runs
    on several threads (default 65536)."""
    return _int("GGRAPH_PARALLEL_MIN_PRODUCT", 1 << 16)


def exact_activations() -> bool:
    """GGRAPH_EXACT_ACTIVATIONS=1: mat-muls use the f32 activations as they are, instead of
    rounding them to the weight's vec_dot_type as ggml's CPU does."""
    return _flag("GGRAPH_EXACT_ACTIVATIONS", False)


def hugepages() -> bool:
    """GGRAPH_HUGEPAGES=0: the CPU backend's packed weights in ordinary numpy arrays instead
    of mappings advised for 2 MiB pages (backends/cpu/hugepages.py)."""
    return _flag("GGRAPH_HUGEPAGES", True)


# ---- the CUDA backend ----------------------------------------------------------------------

def cuda_fast_launch() -> bool:
    """GGRAPH_CUDA_FAST_LAUNCH=0: every launch goes through numba's dispatcher."""
    return _flag("GGRAPH_CUDA_FAST_LAUNCH", True)


def cuda_graphs() -> bool:
    """GGRAPH_CUDA_GRAPHS=0: decode steps are not captured into CUDA graphs."""
    return _flag("GGRAPH_CUDA_GRAPHS", True)


def ptx_cache() -> bool:
    """GGRAPH_PTX_CACHE=0: the PTX gate keeps no PTX or ptxas figures on disk."""
    return _flag("GGRAPH_PTX_CACHE", True)


def cuda_torch() -> bool:
    """GGRAPH_CUDA_TORCH=0: no torch tensor-core GEMMs even where torch is installed."""
    return _flag("GGRAPH_CUDA_TORCH", True)


def cudasim_geometry() -> str:
    """GGRAPH_CUDASIM_GEOMETRY: "small" (the default) or "gpu", the kernel geometry the CUDA
    backend launches with under numba's simulator."""
    v = os.environ.get("GGRAPH_CUDASIM_GEOMETRY", "small") or "small"
    if v not in ("small", "gpu"):
        raise ValueError(f"$GGRAPH_CUDASIM_GEOMETRY={v[:40]!r}: expected small or gpu")
    return v


# ---- checks, models, tests -----------------------------------------------------------------

LIBGGML_VAR = "GGRAPH_LIBGGML"


def libggml() -> str | None:
    """GGRAPH_LIBGGML: a directory holding libggml-base and libggml-cpu for the comparisons
    with the real ggml (default: llama-cpp-python's build)."""
    return os.environ.get(LIBGGML_VAR) or None


def llama_bin() -> Path:
    """GGRAPH_LLAMA_BIN: the folder of llama.cpp's programs (default: where
    ../shared/tools/llamacpp-tools.sh builds them)."""
    v = os.environ.get("GGRAPH_LLAMA_BIN")
    return Path(v) if v else Path.home() / ".cache" / "llamacpp-tools" / "build" / "bin"


def check_tensors() -> bool:
    """GGRAPH_CHECK_TENSORS=1: scan every model's weights for inf/NaN at load (the test suite
    sets it; llama.cpp's --check-tensors)."""
    return _flag("GGRAPH_CHECK_TENSORS", False)


def fuzz_mem_bytes() -> int:
    """GGRAPH_FUZZ_MEM_GB: the address-space limit of each fuzzing child (default 8 GiB)."""
    return _int("GGRAPH_FUZZ_MEM_GB", 8) << 30
