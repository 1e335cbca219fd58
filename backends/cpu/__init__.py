"""The numba CPU backend."""
from .backend import CPUBackend

__all__ = ["CPUBackend"]
