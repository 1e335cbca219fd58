"""A multi-layer perceptron classifier as a ggraph graph: the model the training docs, tests
and the digits benchmark fit. Layers are mul_mat + bias, SiLU between them; weights are
initialised as torch.nn.Linear's default (uniform in ±1/sqrt(fan_in)) so a torch twin can
start from the very same values."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ggraph import ops
from ggraph.ir.tensor import Context, Tensor
from ggraph.ir.types import GGMLType


@dataclass
class MLP:
    """The graph's input leaf (ne [n_in, batch]), its logits (ne [n_out, batch]) and the
    parameters, weight then bias per layer (weights ne [fan_in, fan_out], numpy shape
    (fan_out, fan_in) as torch's Linear.weight)."""
    inputs: Tensor
    logits: Tensor
    params: list[Tensor]

    def initial_values(self) -> list[np.ndarray]:
        from ggraph.codecs.buffers import read

        return [read(np.asarray(p.data).view(np.uint8).reshape(-1), 0, p) for p in self.params]


def mlp(sizes: Sequence[int], batch: int, seed: int = 0, ctx: Context | None = None) -> MLP:
    """An MLP with layer sizes `sizes` (n_in, hidden..., n_out) for batches of `batch`."""
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes) or batch < 1:
        raise ValueError(f"mlp: sizes {list(sizes)} need an input and an output size, all "
                         f"positive, and batch {batch} must be positive")
    ctx = ctx or Context("mlp")
    rng = np.random.default_rng(seed)
    x = ctx.new_tensor(GGMLType.F32, (sizes[0], batch), name="inputs").set_input()
    cur, params = x, []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / np.sqrt(fan_in)
        w = ctx.new_tensor(GGMLType.F32, (fan_in, fan_out), name=f"w{i}")
        b = ctx.new_tensor(GGMLType.F32, (fan_out, 1), name=f"b{i}")
        w.set_data(rng.uniform(-bound, bound, w.shape)).set_param()
        b.set_data(rng.uniform(-bound, bound, b.shape)).set_param()
        params += [w, b]
        cur = ops.add(ops.mul_mat(w, cur), b, name=f"layer{i}")
        if i < len(sizes) - 2:
            cur = ops.silu(cur, name=f"act{i}")
    return MLP(x, cur.set_name("logits"), params)
