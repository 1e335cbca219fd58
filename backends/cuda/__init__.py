"""The numba.cuda backend (runs under NUMBA_ENABLE_CUDASIM=1 without a GPU).

runtime.py: modes (GPU, simulator, PTX-only), the shared math compiled for CUDA, launches and
device memory; templates.py / templates_mm.py: kernel templates; kernels.py: the kernel table;
backend.py: CUDABackend.
"""
from .backend import CUDABackend

__all__ = ["CUDABackend"]
