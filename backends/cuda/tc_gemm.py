"""Tensor-core matrix products for prompts through torch, when torch with CUDA is installed (an
optional peer library; ggraph never needs it).

A mul_mat with more than MV_NMAX columns on a real GPU: a quantized weight is dequantized to
F16 by ggraph's own chunk decoder (k_copy_chunks) into a scratch buffer the session shares
between its products (grown to the largest weight), the F32 activations are rounded to F16,
and cuBLAS multiplies them on tensor cores through torch.matmul, as llama.cpp's cuBLAS path
does; F16 and BF16 weights are used as stored, F32 ones in F32. Arena memory is wrapped
zero-copy through `__cuda_array_interface__`, and torch runs on the backend's own stream.

Only in the "device" mode (the simulator's arrays are numpy); GGRAPH_CUDA_TORCH=0 turns it
off. Without torch, products take the tiled kernel (templates_mm.k_mul_mat_tiled).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ggraph.ir.tensor import Tensor
from ggraph import config
from ggraph.ir.types import GGMLType as T
from . import runtime as R

ENABLED = config.cuda_torch()
_torch: Any = None  # the module once found usable, False once found missing


def torch_cuda() -> Any:
    """torch, when it is installed with CUDA and a GPU is in use; else None."""
    global _torch
    if _torch is None:
        _torch = False
        if R.MODE == "device" and ENABLED:
            try:
                import torch

                if torch.cuda.is_available():
                    _torch = torch
            except Exception:  # noqa: BLE001 - any broken install: the tiled kernel
                pass
    return _torch or None


def accepts(a: Tensor, b: Tensor, d: Tensor) -> bool:
    """One weight for all batch slices, F32 activations and output with packed rows, and a
    weight the chunk decoder reads whole chunks of."""
    if a.ne[2] != 1 or a.ne[3] != 1 or b.type != T.F32 or d.type != T.F32:
        return False
    if not (b.rows_contiguous() and d.rows_contiguous() and a.rows_contiguous()):
        return False
    return a.type in (T.F32, T.F16, T.BF16) or (a.type.is_quantized and a.ne[0] % 32 == 0)


@dataclass
class Scratch:
    """The session's F16 copy of one dequantized weight at a time."""
    need: int = 0
    buf: Any = None


def bind(node: Tensor, s: Any, decode: Callable[[Any, Any], Callable[[], None] | None]
         ) -> Callable[[], None]:
    """The launch of `node` = a . b through torch; `decode(A, W16)` binds the chunk decoder of
    a's type writing the F16 copy W16 (kernels.py)."""
    torch = torch_cuda()
    a, b = node.src
    A, B, D = s.arr(a), s.arr(b), s.arr(node)
    m, k = a.ne[1], a.ne[0]
    scratch = s.tc_scratch  # shared by every product of the session (one runs at a time)
    scratch.need = max(scratch.need, m * k * 2)
    dev = s.backend.device
    stream = torch.cuda.ExternalStream(int(dev.stream.handle), device=dev.index)
    state: dict[str, Any] = {}

    def weight() -> Any:
        if a.type in (T.F32, T.BF16, T.F16):
            w = torch.as_tensor(A, device=f"cuda:{dev.index}")
            return w.view(torch.float16) if a.type == T.F16 else \
                (w.view(torch.bfloat16) if a.type == T.BF16 else w)
        if scratch.buf is None or scratch.buf.nbytes < scratch.need:
            scratch.buf = R.alloc_bytes(scratch.need)  # first run: never inside a capture
        if state.get("buf") is not scratch.buf:
            from numba.cuda.cudadrv.devicearray import DeviceNDArray

            w16 = DeviceNDArray((1, 1, m, k), (m * k * 2, m * k * 2, k * 2, 2),
                                np.dtype(np.uint16),
                                gpu_data=scratch.buf.gpu_data.view(0, m * k * 2))
            state.update(buf=scratch.buf, w16=w16, dec=decode(A, w16))
        state["dec"]()  # queued on the same stream, before the product
        return torch.as_tensor(state["w16"], device=f"cuda:{dev.index}").view(torch.float16)

    def run() -> None:
        with torch.cuda.device(dev.index), torch.cuda.stream(stream):
            w = weight()[0, 0]                                   # (M, K)
            x = torch.as_tensor(B, device=f"cuda:{dev.index}")   # (B3, B2, N, K) float32
            out = torch.as_tensor(D, device=f"cuda:{dev.index}")
            if w.dtype != torch.float32:
                x = x.to(w.dtype)
            out.copy_(torch.matmul(x, w.t()))
    return run
