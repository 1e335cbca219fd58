"""Training, in ggml-opt's spirit: a Trainer turns a forward graph (inputs -> outputs) and its
parameters into the graphs of one optimizer step (forward, backward from ggraph.autodiff, and
the optimizer as ops: opt_step_adamw / opt_step_sgd), keeps the parameters, their gradients'
accumulators and the optimizer's moments in session-owned memory across steps, and `fit`
runs epochs over a Dataset with a validation split, batches, gradient accumulation,
callbacks and a progress line.

The graphs:
- one step (`accumulate` = 1): forward, loss, backward, and each parameter's update, in one
  graph; the updates come after every read of the parameters.
- with accumulation: a graph per micro-batch that adds the gradients into accumulators (the
  first micro-batch copies them), and an update graph that reads the accumulators. The loss
  is scaled by 1 / accumulate, as ggml-opt does, so the sum is the mean gradient.
- evaluation: the forward graph and the loss only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ggraph import ops
from ggraph.autodiff import Gradients, grad
from ggraph.codecs import buffers
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType

F32 = GGMLType.F32


@dataclass(frozen=True)
class AdamW:
    """ggml's AdamW (opt_step_adamw); ggml-opt's defaults."""
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    wd: float = 0.0

    def values(self, step: int) -> np.ndarray:
        return ops.adamw_param_values(self.lr, self.beta1, self.beta2, self.eps, self.wd, step)


@dataclass(frozen=True)
class SGD:
    """Plain gradient descent with weight decay (opt_step_sgd)."""
    lr: float = 1e-3
    wd: float = 0.0

    def values(self, step: int) -> np.ndarray:
        return ops.sgd_param_values(self.lr, self.wd)


Optimizer = AdamW | SGD


@dataclass
class StepResult:
    """One optimizer step: the loss of each micro-batch and the outputs' correct count."""
    step: int
    losses: list[float]
    correct: int = 0
    seen: int = 0

    @property
    def loss(self) -> float:
        return float(np.mean(self.losses))


@dataclass
class EpochResult:
    """Loss (mean and its standard error, as ggml-opt prints it) and accuracy of one pass."""
    losses: list[float] = field(default_factory=list)
    correct: int = 0
    seen: int = 0

    @property
    def loss(self) -> float:
        return float(np.mean(self.losses)) if self.losses else float("nan")

    @property
    def loss_unc(self) -> float:
        n = len(self.losses)
        return float(np.std(self.losses, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.seen if self.seen else float("nan")


@dataclass
class History:
    """What `fit` measured: per epoch, training and validation results; every step's loss."""
    train: list[EpochResult] = field(default_factory=list)
    val: list[EpochResult] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


Callback = Callable[["Trainer", str, int, EpochResult], Any]


class Trainer:
    """Trains `params` (F32 leafs; default: the leafs marked set_param) so that `outputs`,
    computed from `inputs`, fit the labels under cross-entropy (labels: a probability per
    output row, the shape of `outputs`), or minimises `loss` when given instead.

    `feeds`: other leafs each run needs (positions, masks), given per call to `step`.
    `checkpoint`: what the backward keeps (ggraph.autodiff.grad); `accumulate`: micro-batches
    per optimizer step. The parameters' current values stay in the session: read them with
    `values()`, set them with `set_values()`."""

    def __init__(self, outputs: Tensor | None, params: Sequence[Tensor] | None = None, *,
                 loss: Tensor | None = None, optimizer: Optimizer | None = None,
                 accumulate: int = 1, backend: Any = "cpu",
                 checkpoint: Iterable[Tensor] | Callable[[Tensor], bool] | None = None
                 ) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} must be at least 1")
        if (outputs is None) == (loss is None):
            raise ValueError("Trainer: give outputs (cross-entropy against labels) or loss, "
                             "not both")
        self.optimizer = optimizer or AdamW()
        self.accumulate = int(accumulate)
        self.outputs = outputs
        ctx = (outputs if outputs is not None else loss).ctx
        self.labels: Tensor | None = None
        if outputs is not None:
            if outputs.type != F32:
                raise ValueError(f"Trainer: outputs {outputs.describe()} must be F32")
            self.labels = ctx.new_tensor(F32, outputs.ne, name="labels").set_input()
            loss = ops.cross_entropy_loss(outputs, self.labels, name="loss")
            outputs.set_output()
        self.loss = loss
        scaled = loss if self.accumulate == 1 else ops.scale(loss, 1.0 / self.accumulate)
        self.grads: Gradients = grad(scaled, params, checkpoint=checkpoint)
        self.params = self.grads.params
        self.hparams = ctx.new_tensor(F32, (len(self.optimizer.values(1)),),
                                      name="optimizer params").set_input()
        self.state: dict[Tensor, tuple[Tensor, ...]] = {}
        for p in self.params:
            n = 2 if isinstance(self.optimizer, AdamW) else 0
            st = tuple(_static(ctx, p, f"{p.name or 'param'} {w}") for w in ("m", "v")[:n])
            self.state[p] = st
        if self.accumulate == 1:
            self.step_graph = self.grads.graph(*self._updates(self.grads.outputs()))
            self.micro_graphs: tuple[Graph, ...] = ()
        else:
            accs = [_static(ctx, p, f"{p.name or 'param'} grad acc") for p in self.params]
            first = [ops.cpy(g, a) for g, a in zip(self.grads.outputs(), accs)]
            more = [ops.cpy(ops.add(a, g), a) for g, a in zip(self.grads.outputs(), accs)]
            self.micro_graphs = (self.grads.graph(*first), self.grads.graph(*more))
            self.step_graph = Graph(len(self.params) * 2 + 16)
            for u in self._updates(accs):
                self.step_graph.build_forward_expand(u)
        self.eval_graph = Graph(len(self.step_graph.nodes) + 4096)
        self.eval_graph.build_forward_expand(loss.set_output())
        from ggraph.backends import get_backend

        # backend None: the graphs only (planning, `ggraph report`), nothing runs
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.session = self.backend.session() if self.backend is not None else None
        self.steps = 0
        self._owned = False

    def _updates(self, grads: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for p, g in zip(self.params, grads):
            if isinstance(self.optimizer, AdamW):
                m, v = self.state[p]
                out.append(ops.opt_step_adamw(p, g, m, v, self.hparams))
            else:
                out.append(ops.opt_step_sgd(p, g, self.hparams))
        return out

    # -- parameters ---------------------------------------------------------------------------
    def _own_params(self) -> None:
        """The session's own copy of every parameter (the optimizer writes them in place;
        the caller's arrays and a mapped file are never written)."""
        if self._owned:
            return
        if self.session is None:
            raise ValueError("Trainer: made without a backend (graphs only): nothing runs")
        for p in self.params:
            if p.data is None and p.buffer is None:
                raise ValueError(f"Trainer: parameter {p.describe()} has no initial values "
                                 f"(set_data, or set_values before training)")
            if p.data is not None:  # a write makes the session's copy of the leaf's bytes
                self.session.write(p, buffers.read(np.asarray(p.data).view(np.uint8)
                                                   .reshape(-1), 0, p))
        self._owned = True

    def values(self, p: Tensor) -> np.ndarray:
        """Parameter p's current values."""
        self._own_params()
        with self.session:
            return self.session.read(p)

    def set_values(self, p: Tensor, values: np.ndarray) -> None:
        self.session.write(p, values)

    # -- running ------------------------------------------------------------------------------
    def _feeds(self, feeds: Mapping[Tensor | str, np.ndarray], labels: np.ndarray | None
               ) -> dict[Tensor | str, np.ndarray]:
        out = dict(feeds)
        if self.labels is not None:
            if labels is None:
                raise ValueError("Trainer: this trainer fits outputs to labels: give labels")
            out[self.labels] = labels
        return out

    def _count(self, result: StepResult | EpochResult, labels: np.ndarray | None) -> None:
        if self.outputs is None or labels is None:
            return
        out = self.session.read(self.outputs).reshape(-1, self.outputs.ne[0])
        lab = np.asarray(labels).reshape(-1, self.outputs.ne[0])
        result.correct += int(np.sum(out.argmax(-1) == lab.argmax(-1)))
        result.seen += len(lab)

    def step(self, batches: Sequence[tuple[Mapping[Tensor | str, np.ndarray],
                                           np.ndarray | None]]) -> StepResult:
        """One optimizer step over `accumulate` micro-batches, each (feeds, labels)."""
        if len(batches) != self.accumulate:
            raise ValueError(f"Trainer.step: {len(batches)} micro-batches for accumulate="
                             f"{self.accumulate}")
        self._own_params()
        self.steps += 1
        hp = {self.hparams: self.optimizer.values(self.steps)}
        res = StepResult(self.steps, [])
        with self.session:
            if self.accumulate == 1:
                feeds, labels = batches[0]
                self.session.run(self.step_graph, {**self._feeds(feeds, labels), **hp})
                res.losses.append(float(self.session.read(self.loss).reshape(-1)[0]))
                self._count(res, labels)
                return res
            for i, (feeds, labels) in enumerate(batches):
                self.session.run(self.micro_graphs[min(i, 1)], self._feeds(feeds, labels))
                res.losses.append(float(self.session.read(self.loss).reshape(-1)[0]))
                self._count(res, labels)
            self.session.run(self.step_graph, hp)
        return res

    def evaluate(self, feeds: Mapping[Tensor | str, np.ndarray], labels: np.ndarray | None,
                 into: EpochResult | None = None) -> float:
        """The loss on one batch, without training (counted into `into` where given)."""
        self._own_params()
        with self.session:
            self.session.run(self.eval_graph, self._feeds(feeds, labels))
            loss = float(self.session.read(self.loss).reshape(-1)[0])
            if into is not None:
                into.losses.append(loss)
                self._count(into, labels)
        return loss


def _static(ctx: Any, like: Tensor, name: str) -> Tensor:
    """An F32 leaf shaped like `like` in memory the session keeps across runs, zeroed."""
    t = ctx.new_tensor(F32, like.ne, name=name)
    t.buffer = "train"
    return t
