"""ggraph: ggml-style compute graphs in Python.

The IR (Tensor, Context, Graph, the ops in ggraph.ops) records metadata only; the reference
executor (ggraph.reference) runs any graph exactly in numpy; the allocator plans memory;
backends (ggraph.backends) run graphs inside planned buffers.
"""
from ggraph.types import GGMLType, row_size
from ggraph.opkind import OpKind
from ggraph.tensor import Context, Tensor, Flag
from ggraph.graph import Graph, GraphCapacityError, GraphCycleError, build_graph
from ggraph import ops

__version__ = "0.1.0"

__all__ = ["GGMLType", "row_size", "OpKind", "Context", "Tensor", "Flag", "Graph",
           "GraphCapacityError", "GraphCycleError", "build_graph", "ops", "__version__"]
