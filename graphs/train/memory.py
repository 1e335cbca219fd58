"""What one training step holds in memory: the compute buffer the planner gives the step's
graph (forward, backward and optimizer), and beside it the persistent buffers (parameters,
optimizer moments, gradient accumulators) and a count, tensor by tensor, of the forward
activations the backward pass reads: the least any plan must keep alive across the turn
from forward to backward. `ggraph report MODEL --train-lora` prints it with and without
gradient checkpointing."""
from __future__ import annotations

from dataclasses import dataclass

from ggraph.autodiff import forward_order
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from ggraph.plan.alloc import GraphAllocator
from .trainer import Trainer

MIB = 1 << 20


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of one step: `compute` is the planned buffer (every intermediate, gradients
    included); `held` the forward activations the backward reads (`held_n` tensors, the
    largest `held_top`); `params`, `optimizer` and `accumulators` the persistent buffers."""
    compute: int
    held: int
    held_n: int
    held_top: tuple[tuple[str, int], ...]
    params: int
    optimizer: int
    accumulators: int
    gradients: int
    recomputed: int
    nodes: int

    def lines(self, label: str) -> list[str]:
        top = ", ".join(f"{n} {b / MIB:.2f}" for n, b in self.held_top)
        return [f"{label}: compute buffer {self.compute / MIB:8.2f} MiB ({self.nodes} nodes, "
                f"{self.recomputed} recomputed)",
                f"  held for the backward: {self.held / MIB:8.2f} MiB in {self.held_n} "
                f"forward tensors (largest, MiB: {top})",
                f"  gradients {self.gradients / MIB:.2f} MiB (in the compute buffer); "
                f"persistent: parameters {self.params / MIB:.2f} MiB, optimizer moments "
                f"{self.optimizer / MIB:.2f} MiB, accumulators {self.accumulators / MIB:.2f} "
                f"MiB"]


def held_for_backward(graph: Graph, forward: set[Tensor]) -> list[Tensor]:
    """The roots of forward activations (computed, not preallocated) that a backward node of
    `graph` reads: each must stay alive from its forward computation to that read."""
    held: dict[Tensor, None] = {}
    for node in graph.nodes:
        if node in forward:
            continue
        for s in node.src:
            if s is None:
                continue
            r = s.owner
            if r in forward and r.op is not None and not r.is_preallocated:
                held[r] = None
    return list(held)


def step_memory(trainer: Trainer, alignment: int = 32) -> TrainingMemory:
    """Plan the trainer's step graph and count what it holds."""
    graph = trainer.micro_graphs[0] if trainer.micro_graphs else trainer.step_graph
    plan = GraphAllocator(alignment=alignment).reserve(graph)
    held = held_for_backward(graph, set(forward_order(trainer.loss)))
    top = sorted(held, key=lambda t: -t.nbytes)[:4]
    state = [t for ts in trainer.state.values() for t in ts]
    grads = trainer.grads.outputs()
    return TrainingMemory(
        compute=plan.size, held=sum(t.nbytes for t in held), held_n=len(held),
        held_top=tuple((t.name or str(t.op), t.nbytes) for t in top),
        params=sum(p.nbytes for p in trainer.params),
        optimizer=sum(t.nbytes for t in state),
        accumulators=sum(p.nbytes for p in trainer.params) if trainer.micro_graphs else 0,
        gradients=sum(g.nbytes for g in grads), recomputed=len(trainer.grads.recomputed),
        nodes=len(graph.nodes))
