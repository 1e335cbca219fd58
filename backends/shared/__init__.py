"""Code shared by the CPU and CUDA backends, written once as plain Python.

numeric, codecs and elementwise are the math inside kernels. Nothing in them imports numba:
ggraph.backends.jit compiles their functions for a target (numba.njit for the CPU,
numba.cuda.jit(device=True) for CUDA), binding the free names each function calls to that
target's compiled versions. kernel_args is host-side: the numbers each kernel is called with,
taken from its node.
"""
