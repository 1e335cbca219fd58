"""Backward graphs: the gradient of a loss with respect to chosen parameters, recorded as
graph nodes, as ggml_build_backward_expand does.

Each op's record says how its gradient flows (ops/registry.py, OpDef.backward). `grad` walks
the forward graph from the loss back to the parameters, hands each node on the way its
gradient, and adds up the shares of a tensor that several nodes read (a residual stream, a
weight used twice). Only nodes between a parameter and the loss are differentiated, so frozen
weights, masks, positions and caches cost nothing.

Gradient checkpointing (`checkpoint=`) goes beyond ggml: the backward pass reads forward
activations (a softmax's output, a product's inputs), and without it every one of them stays
alive from the forward pass to its backward read. With it, only the chosen checkpoints stay;
the backward recomputes anything else it reads from them, just before the read, so the
planner (ggraph.plan) frees the originals after their forward use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ggraph.ir.graph import Graph
from ggraph.ir.opkind import OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType
from ggraph.ops.elementwise import add
from ggraph.ops.registry import get_op

# graphs of real models run to tens of thousands of nodes once the backward is added
MAX_NODES = 1 << 20

Checkpoint = Callable[[Tensor], bool]


@dataclass
class Gradients:
    """What `grad` built: each parameter's gradient (an F32 node of the parameter's ne), the
    seed it started from, and what checkpointing recomputed."""
    loss: Tensor
    seed: Tensor
    params: tuple[Tensor, ...]
    grads: dict[Tensor, Tensor]
    recomputed: tuple[Tensor, ...] = ()     # forward nodes the backward computes again
    nodes: int = 0                          # backward nodes recorded (recomputation included)

    def __getitem__(self, param: Tensor) -> Tensor:
        try:
            return self.grads[param]
        except KeyError:
            raise KeyError(f"{param.describe()} is not one of the {len(self.params)} "
                           f"parameters this backward graph was built for") from None

    def outputs(self) -> list[Tensor]:
        """The gradients, in the parameters' order."""
        return [self.grads[p] for p in self.params]

    def graph(self, *more: Tensor, capacity: int = MAX_NODES) -> Graph:
        """The forward and backward graph: the loss first (the forward pass runs before any
        gradient), then every gradient (marked outputs, so the planner keeps them), then
        `more` (optimizer steps, which must come after every read of the parameters)."""
        g = Graph(capacity)
        g.build_forward_expand(self.loss.set_output())
        for t in self.outputs():
            g.build_forward_expand(t.set_output())
        for t in more:
            g.build_forward_expand(t)
        return g


def forward_order(*outputs: Tensor) -> list[Tensor]:
    """The nodes the outputs depend on, sources first (ggml's post-order)."""
    g = Graph(MAX_NODES)
    for t in outputs:
        g.build_forward_expand(t)
    return g.nodes


def _find_params(loss: Tensor, order: list[Tensor]) -> tuple[Tensor, ...]:
    seen: dict[Tensor, None] = {}
    for node in order:
        for s in node.src:
            if s is not None and s.is_leaf and s.is_param:
                seen[s] = None
    return tuple(seen)


def _check_params(params: Sequence[Tensor]) -> None:
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"autodiff: parameters are Tensors, got {type(p).__name__}")
        if not p.is_leaf or p.is_view:
            raise ValueError(f"autodiff: parameter {p.describe()} is computed by {p.op}; "
                             f"parameters are leafs that own their memory")
        if p.type != GGMLType.F32:
            raise ValueError(f"autodiff: parameter {p.describe()} is {p.type}; only F32 "
                             f"tensors train (quantized weights stay frozen: train an "
                             f"adapter beside them)")


def _seed(loss: Tensor, seed: Tensor | None) -> Tensor:
    if seed is None:
        if loss.nelements != 1:
            raise ValueError(f"autodiff: the loss {loss.describe()} is not a scalar; reduce "
                             f"it (ops.sum, ops.mean) or give the seed gradient")
        seed = loss.ctx.new_tensor(GGMLType.F32, loss.ne, name="loss grad")
        seed.set_data(np.ones(seed.shape))
    elif seed.ne != loss.ne or seed.type != GGMLType.F32:
        raise ValueError(f"autodiff: the seed {seed.describe()} must be F32 with the loss's "
                         f"ne {list(loss.ne)}")
    return seed


class _Recompute:
    """Forward nodes made again for the backward pass, from the kept tensors."""

    def __init__(self, keep: Checkpoint | None) -> None:
        self.keep = keep
        self.memo: dict[Tensor, Tensor] = {}

    def can(self, t: Tensor) -> bool:
        # a node that writes memory it does not own (set_rows into a cache, cpy into a
        # leaf) must not run twice; pure views of a recomputed node are recomputed with it
        return (t.op is not None and not t.is_output and not self.keep(t)
                and (t.view_src is None or t.op.is_view))

    def __call__(self, t: Tensor) -> Tensor:
        if self.keep is None or t is None or not self.can(t):
            return t
        done = self.memo.get(t)
        if done is not None:
            return done
        stack = [t]  # iterative: a chain of recomputed nodes can be a whole layer deep
        while stack:
            x = stack[-1]
            todo = [s for s in x.src if s is not None and self.can(s) and s not in self.memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            if x not in self.memo:
                self.memo[x] = self._clone(x)
        return self.memo[t]

    def _clone(self, x: Tensor) -> Tensor:
        src = tuple(None if s is None else self.memo.get(s, s) for s in x.src)
        name = f"{x.name} (recomputed)" if x.name else ""
        if x.view_src is None:
            return Tensor(x.ctx, x.type, x.ne, x.nb, op=x.op, params=x.params, src=src,
                          name=name)
        s0 = x.src[0]  # a view's first source is the tensor it views
        offs = x.view_offs - (s0.view_offs if s0.view_src is not None else 0)
        return Tensor(x.ctx, x.type, x.ne, x.nb, op=x.op, params=x.params, src=src,
                      view_src=src[0], view_offs=offs, name=name)


def _as_predicate(checkpoint: Iterable[Tensor] | Checkpoint | None) -> Checkpoint | None:
    if checkpoint is None or callable(checkpoint):
        return checkpoint
    kept = frozenset(checkpoint)
    return kept.__contains__


def grad(loss: Tensor, params: Sequence[Tensor] | None = None, *, seed: Tensor | None = None,
         checkpoint: Iterable[Tensor] | Checkpoint | None = None,
         skip_unreached: bool = False) -> Gradients:
    """The gradient of `loss` with respect to each of `params` (default: every leaf marked
    with set_param that the loss depends on), recorded as nodes.

    `seed`: the gradient of the loss itself (default: 1 for a scalar loss); any F32 tensor of
    the loss's ne, which gives the gradient of sum(loss * seed). `checkpoint`: the forward
    tensors the backward reads as they are (a collection, or a predicate on tensors); every
    other forward node it reads is recomputed from them. None keeps every activation.
    Raises ValueError naming the op when a parameter's path to the loss crosses an op without
    a backward rule, and the parameter when it does not reach the loss at all or no gradient
    reaches it (the rules on its way give none: a mask's); with `skip_unreached`, such
    parameters are left out of the result instead."""
    order = forward_order(loss)
    params = tuple(params) if params is not None else _find_params(loss, order)
    if not params:
        raise ValueError(f"autodiff: no parameters: mark leafs with set_param() or pass "
                         f"params= (the loss is {loss.describe()})")
    _check_params(params)
    seed = _seed(loss, seed)
    # which tensors depend on a parameter: only those are differentiated
    needs: set[Tensor] = set(params)
    via: dict[Tensor, Tensor] = {p: p for p in params}  # a parameter each one depends on
    for node in order:
        for s in node.src:
            if s is not None and s in needs:
                needs.add(node)
                via.setdefault(node, via[s])
                break
    missing = [p for p in params if p is not loss and not any(p in n.src for n in order)]
    if missing and skip_unreached:
        params = tuple(p for p in params if p not in missing)
    elif missing:
        raise ValueError(f"autodiff: parameter {missing[0].describe()} does not reach the "
                         f"loss {loss.describe()}")
    recompute = _Recompute(_as_predicate(checkpoint))
    grads: dict[Tensor, Tensor] = {loss: seed}
    count = 0
    for node in reversed(order):
        g = grads.get(node)
        if g is None or node not in needs:
            continue
        rule = get_op(node.op).backward
        if rule is None:
            raise ValueError(_no_rule(node, via[node]))
        wants = tuple(s is not None and s in needs for s in node.src)
        shares = list(rule(recompute(node), g, wants))
        if len(shares) != len(node.src):
            raise ValueError(f"autodiff: {node.op}'s backward rule gave {len(shares)} "
                             f"gradients for {len(node.src)} sources")
        for s, share, want in zip(node.src, shares, wants):
            if share is None or not want:
                continue
            if share.ne != s.ne or share.type != GGMLType.F32:
                raise ValueError(f"autodiff: {node.op}'s backward rule gave {share.describe()} "
                                 f"as the gradient of {s.describe()} (it must be F32 of the "
                                 f"source's ne)")
            have = grads.get(s)
            grads[s] = share if have is None else add(have, share)
            count += 1
    out: dict[Tensor, Tensor] = {}
    if skip_unreached:
        params = tuple(p for p in params if p in grads)
    for p in params:
        g = grads.get(p)
        if g is None:
            raise ValueError(f"autodiff: no gradient reached parameter {p.describe()}")
        if not g.name:
            g.name = f"grad {p.name}" if p.name else ""
        out[p] = g
    # clones a rule did not read never enter the graph: count the ones the gradients reach
    made = set(recompute.memo.values())
    reached = tuple(n for n in forward_order(*out.values()) if n in made)
    return Gradients(loss, seed, params, out, reached, count + len(reached))


def _no_rule(node: Tensor, param: Tensor) -> str:
    hint = ""
    if node.op == OpKind.FLASH_ATTN_EXT:
        hint = ("; flash attention has no backward (neither has ggml's): build the graph "
                "with flash attention off, the unfused path")
    return (f"autodiff: gradients cannot flow through {node.op} ({node.describe()}), on the "
            f"path from parameter {param.describe()} to the loss{hint}")
