"""ggraph: ggml-style compute graphs in Python.

The IR (Tensor, Context, Graph, the ops in ggraph.ops) records metadata only; the reference
executor (ggraph.reference) runs any graph exactly in numpy; the allocator plans memory;
backends (ggraph.backends) run graphs inside planned buffers.
"""
import os as _os
import sys as _sys

# One numba cache for every entry point (ggraph run, the tests, the demo, benchmarks): in the
# user's cache directory beside the fetched models, never inside the source tree. Set before
# any backend imports numba, which reads it once (and into numba's config where a script
# imported numba before ggraph); NUMBA_CACHE_DIR set by the user wins.
_os.environ.setdefault("NUMBA_CACHE_DIR", _os.path.join(
    _os.environ.get("GGRAPH_CACHE") or _os.path.join(
        _os.environ.get("XDG_CACHE_HOME") or _os.path.expanduser("~/.cache"), "ggraph"),
    "numba"))
if "numba" in _sys.modules:  # a script imported numba first: its config read the environment
    _sys.modules["numba"].config.CACHE_DIR = _os.environ["NUMBA_CACHE_DIR"]

from ggraph.types import GGMLType, row_size  # noqa: E402
from ggraph.opkind import OpKind
from ggraph.tensor import Context, Tensor, Flag
from ggraph.graph import Graph, GraphCapacityError, GraphCycleError, build_graph
from ggraph import ops

__version__ = "0.1.0"

__all__ = ["GGMLType", "row_size", "OpKind", "Context", "Tensor", "Flag", "Graph",
           "GraphCapacityError", "GraphCycleError", "build_graph", "ops", "__version__"]
