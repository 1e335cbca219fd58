"""ggraph.autodiff: gradients as graphs. `grad(loss, params)` records the backward pass of a
loss from the backward rules in the op records (ops/registry.py, OpDef.backward), with
optional gradient checkpointing; `ggraph.check.grad_check` checks those rules against finite
differences."""
from .backward import Gradients, forward_order, grad

__all__ = ["Gradients", "forward_order", "grad"]
