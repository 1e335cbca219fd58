"""The type combinations the kernels accept, per op, as every backend's kernel table starts
from them (a backend may add its own limits, e.g. shared-memory sizes on CUDA), so the
backends cannot drift apart on what "supported" means. The rules live in the op records;
this module only reads them, with the element-wise groups whose op codes the shared kernels
use (backends/shared)."""
from __future__ import annotations

from typing import Callable

from ggraph.ir.opkind import OpKind
from ggraph.ops.registry import REGISTRY, ops_where
from ggraph.ir.tensor import Tensor

UNARY_OPS = ops_where(lambda d: d.elementwise == "unary")
BINARY_OPS = ops_where(lambda d: d.elementwise == "binary")
VIEW_OPS = ops_where(lambda d: d.kind.is_view)

Rule = tuple[Callable[[Tensor], bool], str]

# every op's rule, from its record (ops/<module>.py declares what its kernels accept)
RULES: dict[OpKind, Rule] = {k: (d.accepts, d.accepts_why) for k, d in REGISTRY.items()}


def rule(op: OpKind, extra: Callable[[Tensor], bool] | None = None, why: str = "") -> Rule:
    """The shared rule of `op`, narrowed by a backend's own limit `extra` (stated in `why`)."""
    base, base_why = RULES[op]
    if extra is None:
        return base, base_why
    return (lambda n: base(n) and extra(n)), why or base_why
