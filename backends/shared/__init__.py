"""Math shared by the CPU and CUDA backends, written once as plain Python.

Nothing here imports numba: ggraph.backends.jit compiles these functions for a target
(numba.njit for the CPU, numba.cuda.jit(device=True) for CUDA), binding the free names each
function calls to that target's compiled versions.
"""
