"""Watching a graph run node by node: ggml's scheduler eval callback
(ggml_backend_sched_eval_callback, its ask/receive pair) for ggraph's runners.

An `Observer` pairs two functions:

- `ask(node) -> bool`: whether the observer wants `node`'s value. A run consults it once per
  node of the graph, in execution order, when it binds the graph for the observed run (before
  any kernel runs): ggml's callback with ask=true.
- `receive(node, value) -> bool | None`: the value of a node asked for, handed as soon as the
  call computing it is done, in execution order (a fused group's members one after the
  other, after the group's call; a view at its place in the order, computing nothing). Return
  False to stop the run there (the calls after it do not run: the graph's outputs, and a KV
  cache it writes, are then partly computed); True or None to go on. ggml's ask=false.

- `hand(node)` (optional): the nodes an asked node stands for, handed instead of it: ggml's
  callback reads an asked node's sources in place (llama-imatrix reads a product's
  activations); here the product names them and they are handed when computed.

`value` is a fresh numpy array, the receiver's to keep: the node's values in numpy order
(ne3, ne2, ne1, ne0), float32 for float and quantized types (decoded as Session.read decodes
them), the integer dtype for integer types. It is copied out of the node's memory while that
memory still holds the node (the planner may give it to a later node afterwards), so
nothing about the plan changes.

`runner.run(graph, inputs, observe=Observer(ask, receive))` (backends/base.py Session,
backends/multi.py MultiSession) runs observed; without `observe` a run is what it was. Both
functions are called in the run's thread while it holds the runner's lock (another thread's
run, read or write waits for the observed run to end); an observed run binds the graph's
calls again (the plain calls stay bound for the next unobserved run), so it is slower. An
asked node is never fused away: a fusion pass writes an asked intermediate to its memory, or
keeps the node apart (the norm chain: bit for bit the same), or hands its value from host
memory the group fills (the CPU's fused prompt attention, whose unfused nodes round
differently). The graph's outputs are bit for bit those of an unobserved run.

This module owns the Observer record and the schedule of an observed run: `ObservedStep`s
(a call, then the `Handoff`s of the values valid right after it), made from a runner's bound
groups (`schedule`) and walked by `run_steps`. Runners bind and read; nothing here imports
numba.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from ggraph.ir.tensor import Tensor
from .fusion_rules import Group

Ask = Callable[[Tensor], bool]
Receive = Callable[[Tensor, np.ndarray], "bool | None"]


def _everything(node: Tensor) -> bool:
    return True


@dataclass(frozen=True)
class Observer:
    """What an observed run asks and hands over (see the module's docstring): `ask(node)`
    once per node when the run binds, `receive(node, value)` for each node asked, in
    execution order; receive returning False stops the run."""
    ask: Ask
    receive: Receive
    # which nodes an asked node stands for (default: itself). ggml hands the callback the
    # node, whose sources it reads in place; here `hand` names them instead, e.g. a product's
    # activations (`lambda n: (n.src[1],)`): each is handed once, when it is computed, however
    # many asked nodes name it. Leaves (weights, inputs) are never handed.
    hand: Callable[[Tensor], Iterable[Tensor]] | None = None

    def wanted(self, order: Sequence[Tensor]) -> list[Tensor]:
        """The nodes of `order` to hand over, in order: ask consulted once for each node."""
        picked: set[Tensor] = set()
        for n in order:
            if self.ask(n):
                picked.update(self.hand(n) if self.hand is not None else (n,))
        return [n for n in order if n in picked]

    @classmethod
    def every(cls, receive: Receive) -> "Observer":
        """Every node of the graph."""
        return cls(_everything, receive)

    @classmethod
    def named(cls, pattern: str | re.Pattern[str], receive: Receive) -> "Observer":
        """The nodes whose name `pattern` finds (re.search: anchor it with ^ or $)."""
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        return cls(lambda node: rx.search(node.name or "") is not None, receive)

    @classmethod
    def of(cls, nodes: Iterable[Tensor], receive: Receive) -> "Observer":
        """These nodes (by identity)."""
        wanted = frozenset(nodes)
        return cls(lambda node: node in wanted, receive)


@dataclass
class Recorder:
    """An observer that keeps what it receives: `values` (node -> value) and `order` (the
    nodes in the order they came), for the nodes `ask` wants (all by default). `stop_after`:
    stop the run once that node is received."""
    ask: Ask = _everything
    stop_after: Tensor | None = None
    values: dict[Tensor, np.ndarray] = field(default_factory=dict)
    order: list[Tensor] = field(default_factory=list)

    @property
    def observer(self) -> Observer:
        return Observer(self.ask, self.receive)

    def receive(self, node: Tensor, value: np.ndarray) -> bool:
        self.values[node] = value
        self.order.append(node)
        return node is not self.stop_after


# -- the schedule of an observed run ------------------------------------------------------------

@dataclass(frozen=True)
class Handoff:
    """One asked node's value at one point of an observed run: `node` is what the caller's
    graph holds (what ask and receive see), `local` the tensor the runner computes (a
    device's clone, or the node itself), `held` the host bytes of local's owner where the
    call leaves its value outside memory (Group.held), else None: it is read from memory."""
    node: Tensor
    local: Tensor
    held: np.ndarray | None = None


@dataclass(frozen=True)
class ObservedStep:
    """A call (None: nothing runs, a view is handed at its place) and the values valid right
    after it."""
    call: Callable[[], None] | None
    handoffs: tuple[Handoff, ...]


def schedule(order: Sequence[Tensor], groups: Sequence[Group], asked: Collection[Tensor],
             shown: Mapping[Tensor, Tensor] | None = None) -> list[ObservedStep]:
    """The steps running `groups` (bound for `order`, a runner's nodes in execution order:
    each group at its first node) with a handoff of each node of `asked` where its value is
    ready: after the call of its group, or, for a node no call computes (a view), at its
    place in `order`; a view of a value a group holds outside memory goes with that group
    (the group's host arrays may serve the next group of its kind). `shown` maps a local
    tensor to the caller's node (identity without)."""
    asked = frozenset(asked)
    first = {g.nodes[0]: g for g in groups}
    inside = {n for g in groups for n in g.nodes}
    holder = {o: g for g in groups for o in g.held}    # owner -> the group holding its bytes
    with_group: dict[int, list[Tensor]] = {}           # id(group) -> views handed with it
    for n in order:
        if n in asked and n not in inside and n.owner is not n and n.owner in holder:
            with_group.setdefault(id(holder[n.owner]), []).append(n)
    steps: list[ObservedStep] = []

    def hand(t: Tensor, held: Mapping[Tensor, np.ndarray]) -> Handoff:
        return Handoff(shown.get(t, t) if shown is not None else t, t, held.get(t.owner))

    for n in order:
        g = first.get(n)
        if g is not None:
            mine = [m for m in g.nodes if m in asked] + with_group.get(id(g), [])
            steps.append(ObservedStep(g.call, tuple(hand(m, g.held) for m in mine)))
        elif n not in inside and n in asked and n.owner not in holder:
            steps.append(ObservedStep(None, (hand(n, {}),)))
    return steps


def run_steps(steps: Sequence[ObservedStep], value: Callable[[Handoff], np.ndarray],
              receive: Receive) -> bool:
    """Run the steps, handing each value (`value(handoff)`: a copy) to `receive`; False as
    soon as receive returns False (the remaining steps do not run)."""
    for st in steps:
        if st.call is not None:
            st.call()
        for h in st.handoffs:
            if receive(h.node, value(h)) is False:
                return False
    return True
