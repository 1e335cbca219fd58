"""The numba.cuda backend (runs under NUMBA_ENABLE_CUDASIM=1 without a GPU).

runtime.py: modes (GPU, simulator, PTX-only), devices, the shared math compiled for CUDA,
launches and device memory; templates.py / templates_mm.py / templates_attn.py: kernel
templates (element-wise and rows / products / flash attention); kernels.py: the kernel table;
fusion.py: launches that run several nodes; replay.py: prepared launches and CUDA graphs;
tc_gemm.py: tensor-core products through torch; ptx.py: the PTX gate; buffers.py: device
memory, uploads and copies (the buffer type); executor.py: running on one GPU; backend.py:
CUDABackend.
Overview: docs/cuda.md.
"""
from .backend import CUDABackend

__all__ = ["CUDABackend"]
