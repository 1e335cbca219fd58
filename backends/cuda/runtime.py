"""CUDA runtime glue: which mode numba.cuda runs in, the shared math compiled for CUDA, kernel
launches, and device memory (byte arenas, tensor views at byte offsets, host<->device copies).

Three modes, one code path for kernels:
- "device": a real GPU. Arenas are numba DeviceNDArrays of bytes; a tensor's view is a
  DeviceNDArray over a sub-range of the arena's memory with the tensor's own strides.
- "sim": NUMBA_ENABLE_CUDASIM=1 (must be set before numba is imported). Kernels run as Python
  threads; arenas are the simulator's FakeCUDAArrays wrapping numpy, views wrap numpy views.
- "ptx": no GPU and no driver: every launch only compiles its kernel to PTX for one compute
  capability with libNVVM (tools/gpu_check.py --ptx), which proves that every kernel and the
  shared math it calls compile for real CUDA. Memory is plain numpy there.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from ggraph.codecs import buffers
from ggraph import config
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType
from ..shared.elementwise import unflatten_i32
from ..half import bf16_to_f32_hw, f32_to_bf16_hw, f32_to_half_hw, half_to_f32_hw
from ..jit import Compiler, Target
from . import ptx_cache
from .replay import PreparedLaunch

try:
    from numba.cuda.core import config as _config
    SIM = bool(_config.ENABLE_CUDASIM)
except ImportError:  # older numba-cuda keeps the flag in numba's own config
    SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

MODE = "sim" if SIM else "device"
# Kernel geometry (threads per block, tile sizes): the simulator runs one Python thread per CUDA
# thread and its barriers cost milliseconds, so it uses small blocks; the code is the same.
# GGRAPH_CUDASIM_GEOMETRY=gpu runs the simulator with the GPU's sizes (slow; for checking them).
SMALL = SIM and config.cudasim_geometry() != "gpu"
_PTX_CC: tuple[int, int] = (9, 0)


def _atomic_shared_arrays() -> None:
    """The simulator gives the threads of a block one shared array per `cuda.shared.array`
    call site, found or made in a dict by a check and then a set (numba-cuda's
    simulator/kernelapi.py, FakeCUDAShared.array). A thread switched out between the two makes
    its own array: its writes never reach the others (a product then read garbage: the suite's
    rare `MUL_MAT(type=q4_K,...,b=strided)` failure, nmse 0.23, reproduced every time with a
    sleep put between the two). The lookup here is the same, keyed by the calling line, with
    the check and the set under one lock; dynamic shared memory (shape 0) and alignment go to
    the simulator's own method as before."""
    from numba.core import types as nbtypes
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    own = shared.array
    if getattr(own, "ggraph_atomic", False):
        return
    lock = threading.Lock()

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        if shape == 0 or alignment is not None:
            return own(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        where = (frame.f_code.co_filename, frame.f_lineno)
        if isinstance(dtype, nbtypes.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            found = self._allocations.get(where)
            if found is None:
                found = self._allocations[where] = np.empty(shape, dtype)
        return found

    array.ggraph_atomic = True
    shared.array = array


if SIM:
    _atomic_shared_arrays()


@dataclass
class PtxVariant:
    """A kernel variant the PTX-only mode compiled: its PTX or the compiler's error, and the
    largest block it was launched with (backends/cuda/ptx.py judges them)."""
    kernel: str
    signature: tuple
    ptx: str = ""
    error: str = ""
    threads: int = 0


_PTX_DONE: dict[tuple, PtxVariant] = {}   # (kernel, signature) -> its variant
_LIBDEVICE = ""                           # the libdevice the PTX-only mode links


# -- the shared math, compiled for CUDA --------------------------------------------------------

def _rint(x):
    """np.rint (round half to even) for device code: numba-cuda has no `rint` ufunc, and the
    shared f16/bf16 encoders call np.rint (see make_target)."""
    f = float(math.floor(x))
    r = x - f
    if r > 0.5 or (r == 0.5 and math.fmod(f, 2.0) != 0.0):
        f += 1.0
    return f


def _mul_rn_gpu(a, b):
    """The shared mul_rn on a GPU: NVVM contracts a * b + c into one fma unless the product is
    libdevice's round-to-nearest multiply (__fmul_rn), which it never fuses."""
    return libdevice.fmul_rn(np.float32(a), np.float32(b))


def _roundf_gpu(x):
    """The shared roundf (C's, half away from zero) as libdevice's, in float32."""
    return libdevice.roundf(np.float32(x))


def make_target() -> Target:
    """The shared math (backends/shared) compiled with cuda.jit(device=True).

    The shared code reaches numpy as the global `np`; for CUDA that name is bound to a copy of
    the numpy module whose `rint` is a device function, because numba-cuda cannot lower the
    np.rint ufunc (found by compiling to PTX). Everything else is numpy itself."""
    # on a GPU the f16 conversions are one instruction each (cvt.f32.f16, cvt.rn.f16.f32) and
    # bf16's integer operations on the float's bits, bit for bit the shared ones, instead of
    # float64 arithmetic; the simulator runs Python, which has no LLVM instructions, and keeps
    # the shared versions
    target = Target("cuda", cuda.jit(device=True), overrides=None if SIM else {
        "half_to_f32": half_to_f32_hw, "f32_to_half": f32_to_half_hw,
        "bf16_to_f32": bf16_to_f32_hw, "f32_to_bf16": f32_to_bf16_hw,
        "mul_rn": _mul_rn_gpu, "roundf": _roundf_gpu,
        "unflatten": unflatten_i32})  # 32-bit divisions where they fit
    shim = types.ModuleType("numpy_for_cuda")
    shim.__dict__.update(np.__dict__)
    shim.rint = cuda.jit(device=True)(_rint)
    target.globals["np"] = shim  # helpers compile lazily, so they all see the shim
    if SIM:
        # the simulator runs the shared math as plain Python, where math.ldexp rejects the
        # numpy integer exponents that compiled code accepts
        pymath = types.ModuleType("math_for_cudasim")
        pymath.__dict__.update(math.__dict__)
        pymath.ldexp = lambda x, e: math.ldexp(x, int(e))
        target.globals["math"] = pymath
    return target


TARGET = make_target()


def kernel_decorator() -> Callable[[Callable], Any]:
    """How CUDA kernel templates are compiled (on-disk cache on a real GPU)."""
    if SIM:
        return Compiler(cuda.jit)
    return Compiler(cuda.jit, cache=True)


def device_decorator() -> Callable[[Callable], Any]:
    return Compiler(cuda.jit, device=True)


# -- PTX-only mode ---------------------------------------------------------------------------

def enable_ptx_check(cc: tuple[int, int] = (9, 0), libdevice: str | None = None) -> None:
    """Compile kernels to PTX at every launch instead of running them (no GPU needed).

    Needs libNVVM and libdevice (a CUDA toolkit, CUDA_HOME). numba-cuda asks NVRTC and the
    driver for the architecture list and the current device even when only compiling; both
    questions are answered here so that a machine without them can still compile."""
    global MODE, _PTX_CC, _LIBDEVICE
    if SIM:
        raise RuntimeError("the PTX check needs real numba.cuda, not the simulator")
    from numba.cuda import dispatcher
    from numba.cuda.cudadrv import libs, nvrtc, nvvm

    MODE, _PTX_CC = "ptx", cc
    nvrtc.get_supported_ccs = lambda: ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = libdevice or os.path.join(home, "nvvm", "libdevice", "libdevice.10.bc")
    if not os.path.exists(path):
        raise FileNotFoundError(f"libdevice not found at {path}; set CUDA_HOME")
    _LIBDEVICE = path
    libs.get_libdevice = lambda: path
    nvvm.get_libdevice = lambda: path
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=cc)


def ptx_results() -> list[PtxVariant]:
    return list(_PTX_DONE.values())


def _compile_only(kernel: Any, args: tuple, block: Any) -> None:
    from numba import typeof

    sig = tuple(typeof(a) for a in args)
    key = (kernel.py_func.__qualname__, sig)
    v = _PTX_DONE.get(key)
    if v is None:
        v = _PTX_DONE[key] = PtxVariant(*key)
        # a variant whose sources did not change since a gate compiled it: its PTX from disk
        cached = ptx_cache.variant_name(kernel, str(sig), _PTX_CC, _LIBDEVICE)
        v.ptx = ptx_cache.load_ptx(cached) or ""
        if not v.ptx:
            try:
                v.ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=_PTX_CC)
                ptx_cache.save_ptx(cached, v.ptx)
            except Exception as e:  # keep going: the check reports every kernel that fails
                v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    v.threads = max(v.threads, math.prod(block) if isinstance(block, tuple) else int(block))


# -- devices ---------------------------------------------------------------------------------

def device_list() -> Any:
    """numba's list of GPUs (one fake GPU in the simulator; tests put a fake driver's here)."""
    return cuda.gpus


_ACTIVE = threading.local()  # .device: the CudaDevice this thread's launches and copies use


@dataclass(eq=False)
class CudaDevice:
    """One GPU as a backend holds it: its ordinal, the stream its launches and copies queue
    on, and its stand-ins for absent sources. CUDA's current device is per thread: `active()`
    makes this one current for a block of work, so two backends on GPUs 0 and 1 (or two
    threads) never launch on each other's device."""
    index: int
    stream: Any = None
    dummies: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def active(self) -> Any:
        was = getattr(_ACTIVE, "device", None)
        if was is self:
            yield self
            return
        if MODE == "ptx":  # no driver: nothing to make current
            ctx = contextlib.nullcontext()
        else:
            ctx = device_list()[self.index]
        with ctx:
            _ACTIVE.device = self
            try:
                yield self
            finally:
                _ACTIVE.device = was


def open_device(index: int) -> CudaDevice:
    """GPU `index` with a stream of its own; ValueError in one line for an ordinal this
    machine does not have."""
    if MODE != "ptx":
        n = len(device_list())
        if not 0 <= index < n:
            raise ValueError(f"CUDA device {index} requested, but this machine has {n} "
                             f"(ordinals 0..{n - 1})")
    dev = CudaDevice(index)
    if MODE != "ptx":
        with dev.active():
            dev.stream = cuda.stream()
    return dev


def current_device() -> CudaDevice | None:
    return getattr(_ACTIVE, "device", None)


def _stream() -> Any:
    dev = current_device()
    return dev.stream if dev is not None else 0


# -- launches --------------------------------------------------------------------------------

# Grid caps: kernels loop grid-stride, so any cap is correct. The simulator starts one Python
# thread per CUDA thread, so it gets few blocks (which also exercises the grid-stride loops).
MAX_BLOCKS = 4 if SMALL else 65535


def blocks_for(work: int, per_block: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-work // per_block)))


def bound(kernel: Any, grid: Any, block: int, *args: Any) -> Callable[[], None] | None:
    """A zero-argument launch of kernel[grid, block](*args) to run (and rerun) later; None
    for an empty grid. The launch is configured at call time: the simulator keeps one
    configuration per kernel object, which another node using the same kernel would change."""
    dims = grid if isinstance(grid, tuple) else (grid,)
    if any(g <= 0 for g in dims):
        return None
    if MODE == "ptx":
        return lambda: _compile_only(kernel, args, block)
    stream = _stream()  # the stream of the device active while binding (its backend's)
    if MODE == "device":  # numba's dispatch done once (replay.py)
        return PreparedLaunch(kernel, grid, block, stream, args)
    return lambda: kernel[grid, block, stream](*args)


def launch(kernel: Any, grid: Any, block: int, *args: Any) -> None:
    """kernel[grid, block](*args); nothing for an empty grid; compile only in PTX mode."""
    dims = grid if isinstance(grid, tuple) else (grid,)
    if any(g <= 0 for g in dims):
        return
    if MODE == "ptx":
        _compile_only(kernel, args, block)
        return
    kernel[grid, block, _stream()](*args)


# -- memory ----------------------------------------------------------------------------------

def alloc_bytes(nbytes: int) -> Any:
    if MODE == "ptx":
        return np.zeros(max(nbytes, 1), np.uint8)
    return cuda.device_array(max(nbytes, 1), dtype=np.uint8)


def upload_bytes(host: np.ndarray) -> Any:
    host = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
    if MODE == "ptx":
        return host.copy()
    return cuda.to_device(host, stream=_stream())


def to_host(buf: Any, start: int = 0, stop: int | None = None) -> np.ndarray:
    stop = buf.nbytes if stop is None else stop
    if MODE == "ptx":
        return np.array(buf[start:stop])
    stream = _stream()
    out = buf[start:stop].copy_to_host(stream=stream)
    if stream:  # queued behind the stream's kernels: wait for the copy itself
        stream.synchronize()
    return out


def from_host(buf: Any, start: int, host: np.ndarray) -> None:
    if host.nbytes == 0:
        return
    if MODE == "ptx":
        buf[start:start + host.nbytes] = host
        return
    # queued on the stream: pageable host memory is staged before the call returns, so the
    # caller may reuse `host` at once, and the kernels queued after it see the new bytes
    buf[start:start + host.nbytes].copy_to_device(np.ascontiguousarray(host), stream=_stream())


_HOST_DUMMIES: dict[str, Any] = {}  # PTX mode's (no device to hold them)


def dummy(dtype: Any) -> Any:
    """A (1, 1, 1, 1) array standing in for an absent optional source (mask, sinks, ...),
    in the memory of the active device (device memory is not shared between GPUs)."""
    dev = current_device()
    key = f"{MODE}:{np.dtype(dtype).str}"
    memo = dev.dummies if dev is not None and MODE != "ptx" else _HOST_DUMMIES
    arr = memo.get(key)
    if arr is None:
        host = np.zeros((1, 1, 1, 1), dtype)
        arr = memo[key] = host if MODE == "ptx" else cuda.to_device(host)
    return arr


def synchronize() -> None:
    """Wait for the active device's stream (every device's work without one)."""
    if MODE == "ptx":
        return
    stream = _stream()
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


def layout(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype]:
    """Shape, byte strides and dtype of a kernel's view of `t` (as buffers.raw_view with
    half_bits): elements in numpy order, F16/BF16 as uint16 bits, quantized rows as bytes."""
    tr = t.type.traits
    ne3, ne2, ne1, ne0 = t.shape
    nb0, nb1, nb2, nb3 = t.nb
    if tr.numpy_dtype is not None:
        dt = np.dtype(np.uint16 if t.type == GGMLType.F16 else tr.numpy_dtype)
        return (ne3, ne2, ne1, ne0), (nb3, nb2, nb1, nb0), dt
    if nb0 != tr.type_size:
        raise ValueError(f"tensor {t.describe()}: the blocks of a quantized row must be packed "
                         f"(nb0 = {tr.type_size}), got nb0 = {nb0}")
    return (ne3, ne2, ne1, t.row_bytes), (nb3, nb2, nb1, 1), np.dtype(np.uint8)


def view(buf: Any, offset: int, t: Tensor) -> Any:
    """A kernel's view of `t` at byte `offset` of `buf`, with t's strides (zero-copy)."""
    if MODE == "ptx":
        return buffers.raw_view(buf, offset, t, half_bits=True)
    if MODE == "sim":
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(buffers.raw_view(buf._ary, offset, t, half_bits=True))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    shape, strides, dtype = layout(t)
    if offset < 0 or offset + t.nbytes > buf.nbytes:
        raise ValueError(f"tensor {t.describe()} at offset {offset} spans {t.nbytes} bytes, "
                         f"past the end of its device buffer of {buf.nbytes} bytes")
    if t.nelements == 0:
        return DeviceNDArray(shape, strides, dtype)
    return DeviceNDArray(shape, strides, dtype,
                         gpu_data=buf.gpu_data.view(offset, offset + t.nbytes))


def unavailable_reason() -> str | None:
    """Why numba.cuda cannot run kernels on this machine, in one line; None when it can (and
    always in the simulator and the PTX-only mode, which need no GPU). numba raises a
    CudaSupportError with a multi-line message at the first driver call instead."""
    if MODE != "device" or cuda.is_available():
        return None
    from numba.cuda.cudadrv import driver as _driver

    hint = ("(the CUDA backend needs an NVIDIA GPU and driver; use --backend cpu, or "
            "NUMBA_ENABLE_CUDASIM=1 for the simulator)")
    try:
        err = _driver.driver.initialization_error
    except Exception as e:  # noqa: BLE001 - a driver that fails to load says so here
        err = str(e)
    if err:
        detail = " ".join(line.strip() for line in str(err).splitlines()
                          if line.strip() and line.strip() != ":")
        detail = detail.removeprefix("Error at driver init:").strip()
        if "cannot be found" in detail or "error occurred during load" in detail:
            return f"no CUDA driver found: {detail} {hint}"
        return f"CUDA is not usable: {detail} {hint}"
    return (f"CUDA is not usable: the driver works but libNVVM (the CUDA toolkit's compiler "
            f"library) was not found; install the CUDA toolkit or set CUDA_HOME {hint}")


def device_name() -> str:
    if MODE == "sim":
        return "numba CUDA simulator"
    if MODE == "ptx":
        return f"PTX only (sm_{_PTX_CC[0]}{_PTX_CC[1]}, no GPU)"
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    return f"{name} (cc {dev.compute_capability[0]}.{dev.compute_capability[1]})"
