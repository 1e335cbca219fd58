"""The reference executor: runs any graph exactly in numpy, node by node.

It is the oracle the numba backends and the conformance tests are judged against. Every root
tensor gets its own zeroed byte buffer (no sharing, no planning), views see their root's bytes
through their own strides, values are computed in float64 by each op's reference and stored in
the node's type exactly as ggml converts (through f32, quantizing where the type is blocked).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ggraph.codecs import buffers
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from ggraph.ops.registry import get_op


class ReferenceExecutor:
    """Holds the memory of one run; `read(t)` gives any tensor's values afterwards."""

    def __init__(self, inputs: Mapping[Tensor | str, np.ndarray] | None = None) -> None:
        self._mem: dict[int, np.ndarray] = {}
        self._inputs = dict(inputs or {})

    # -- memory ---------------------------------------------------------------------------
    def _buffer(self, t: Tensor) -> np.ndarray:
        root = t.owner
        buf = self._mem.get(id(root))
        if buf is None:
            buf = np.zeros(root.nbytes, dtype=np.uint8)
            if root.data is not None:
                if root.data.nbytes != root.nbytes:
                    raise ValueError(f"tensor {root.describe()} carries {root.data.nbytes} bytes "
                                     f"of data, expected {root.nbytes}")
                buf[:] = root.data
            self._mem[id(root)] = buf
        return buf

    def read(self, t: Tensor) -> np.ndarray:
        return buffers.read(self._buffer(t), t.view_offs, t)

    def write(self, t: Tensor, values: np.ndarray) -> None:
        buffers.write(self._buffer(t), t.view_offs, t, values)

    def write_rows(self, t: Tensor, index: tuple[np.ndarray, np.ndarray, np.ndarray],
                   values: np.ndarray) -> None:
        """Write values[i3, i2, r] into row (index[0], index[1], index[2]) of t, in t's type."""
        raw = buffers.raw_view(self._buffer(t), t.view_offs, t)
        raw[index] = buffers.encode_rows(t.type, values)

    # -- running --------------------------------------------------------------------------
    def run(self, graph: Graph) -> "ReferenceExecutor":
        buffers.feed_inputs(graph, self._inputs, self.write)
        for node in graph.nodes:
            opdef = get_op(node.op)
            if opdef.reference is None:  # a view: nothing to compute
                continue
            try:
                result = opdef.reference(node, self)
            except ValueError:
                raise
            except Exception as e:  # name the node, keep the cause
                raise RuntimeError(f"reference {node.op} failed on {node.describe()}: {e}") from e
            if result is not None:
                self.write(node, result.reshape(node.shape) if result.size == node.nelements
                           else result)
        return self


def run_reference(graph: Graph, inputs: Mapping[Tensor | str, np.ndarray] | None = None
                  ) -> ReferenceExecutor:
    """Run `graph` in the reference executor; inputs map tensors (or names) to values."""
    return ReferenceExecutor(inputs).run(graph)
