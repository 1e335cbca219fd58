"""ggraph: ggml-style compute graphs in Python.

Layers, lowest first (docs/architecture.md): ggraph.ir (types, tensors, graphs: metadata
only), ggraph.codecs (quantizers, stored bytes), ggraph.ops (one record per op), ggraph.plan
(the allocator and scheduler), ggraph.check and ggraph.pictures (the reference executor and
conformance; drawings and reports), ggraph.backends (CPU, CUDA), ggraph.graphs (models, GGUF,
tokenizers, the engine) and ggraph.tools (the `ggraph` commands). Each imports only below it.
"""
import os as _os
import sys as _sys

# One numba cache for every entry point (ggraph run, the tests, the demo, benchmarks): in the
# user's cache directory beside the fetched models, never inside the source tree. Set before
# any backend imports numba, which reads it once (and into numba's config where a script
# imported numba before ggraph); NUMBA_CACHE_DIR set by the user wins.
from ggraph.config import numba_cache_dir as _numba_cache_dir  # noqa: E402

_os.environ["NUMBA_CACHE_DIR"] = _numba_cache_dir()
if "numba" in _sys.modules:  # a script imported numba first: its config read the environment
    _sys.modules["numba"].config.CACHE_DIR = _os.environ["NUMBA_CACHE_DIR"]

from ggraph.ir.types import GGMLType, row_size  # noqa: E402
import ggraph.codecs  # noqa: E402,F401  (completes every type record before any use)
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Context, Tensor, Flag
from ggraph.ir.graph import Graph, GraphCapacityError, GraphCycleError, build_graph
from ggraph import ops

__version__ = "0.1.0"

__all__ = ["GGMLType", "row_size", "OpKind", "Context", "Tensor", "Flag", "Graph",
           "GraphCapacityError", "GraphCycleError", "build_graph", "ops", "__version__"]
