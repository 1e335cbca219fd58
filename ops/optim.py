"""Optimizer steps as ops: opt_step_adamw and opt_step_sgd (ggml's), and the helpers that make
their parameter tensors' values.

Each step updates the parameter `a` in place: the node is a view of `a` (as set_rows is of its
destination), so reading the node reads the updated weights and the planner orders later
readers of `a` after it. AdamW also updates its moments `m` and `v` in place; they are leafs
the caller keeps across runs (or pre-allocated buffers), read by nothing else in the graph (the
planner does not see those two writes). The hyper-parameters travel in a small F32 tensor
(7 values for AdamW, 2 for SGD) written before each run, so the learning rate and the step
count change without rebuilding the graph.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor
from ggraph.ir.types import GGMLType as T
from .case import TOL_DEFAULT, Case, CaseBuilder, case
from .registry import GGMLMap, OpDef, ggml_fn, new_view, register, require, require_type, types_ok
from .views import cont

OPT_STEP_ADAMW = OpKind.define("opt_step_adamw", Family.ARITHMETIC)
OPT_STEP_SGD = OpKind.define("opt_step_sgd", Family.ARITHMETIC)

ADAMW_PARAMS = 7  # alpha, beta1, beta2, eps, wd, beta1h, beta2h
SGD_PARAMS = 2    # alpha, wd


def adamw_param_values(lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                       wd: float = 0.0, step: int = 1) -> np.ndarray:
    """The 7 F32 values of opt_step_adamw's params tensor for optimizer step `step` (1 for the
    first): lr, the betas, eps, the decoupled weight decay wd, and the bias corrections
    1/(1 - beta1^step), 1/(1 - beta2^step) (torch.optim.AdamW's)."""
    if step < 1:
        raise ValueError(f"adamw_param_values: step counts from 1, got {step}")
    return np.array([lr, beta1, beta2, eps, wd, 1.0 / (1.0 - beta1 ** step),
                     1.0 / (1.0 - beta2 ** step)], np.float32)


def sgd_param_values(lr: float, wd: float = 0.0) -> np.ndarray:
    """The 2 F32 values of opt_step_sgd's params tensor: lr and the decoupled weight decay."""
    return np.array([lr, wd], np.float32)


def _check_step(op: str, a: Tensor, params: Tensor, n_params: int, **same: Tensor) -> None:
    require_type(op, "a", a, (T.F32,))
    for role, t in same.items():
        require_type(op, role, t, (T.F32,))
        require(t.ne == a.ne, op, f"{role} must have a's ne", a=a, **{role: t})
    # the kernels walk every tensor with a's element order (ggml: with a's strides)
    for role, t in dict(a=a, **same).items():
        require(t.is_contiguous(), op, f"{role} must be contiguous", **{role: t})
    require_type(op, "params", params, (T.F32,))
    require(params.ne == (n_params, 1, 1, 1) and params.is_contiguous(), op,
            f"params must be a 1-D tensor of {n_params} contiguous F32 values", params=params)


def opt_step_adamw(a: Tensor, grad: Tensor, m: Tensor, v: Tensor, adamw_params: Tensor,
                   name: str = "") -> Tensor:
    """One AdamW step on a, in place (ggml_opt_step_adamw): m = b1 m + (1-b1) g,
    v = b2 v + (1-b2) g^2, a = a (1 - alpha wd) - alpha (m b1h) / (sqrt(v b2h) + eps);
    adamw_params holds (alpha, b1, b2, eps, wd, b1h, b2h) (adamw_param_values)."""
    _check_step("opt_step_adamw", a, adamw_params, ADAMW_PARAMS, grad=grad, m=m, v=v)
    return new_view(OpKind.OPT_STEP_ADAMW, a, a.ne, a.nb, 0, srcs=(a, grad, m, v, adamw_params),
                    name=name or (f"{a.name} (adamw)" if a.name else ""))


def opt_step_sgd(a: Tensor, grad: Tensor, sgd_params: Tensor, name: str = "") -> Tensor:
    """One SGD step on a, in place (ggml_opt_step_sgd): a = a (1 - alpha wd) - alpha g;
    sgd_params holds (alpha, wd) (sgd_param_values)."""
    _check_step("opt_step_sgd", a, sgd_params, SGD_PARAMS, grad=grad)
    return new_view(OpKind.OPT_STEP_SGD, a, a.ne, a.nb, 0, srcs=(a, grad, sgd_params),
                    name=name or (f"{a.name} (sgd)" if a.name else ""))


def _ref_adamw(node: Tensor, ex) -> np.ndarray:
    a, grad, m, v, p = node.src
    alpha, b1, b2, eps, wd, b1h, b2h = ex.read(p).reshape(-1)
    W, G, M, V = (ex.read(t).astype(np.float64) for t in (a, grad, m, v))
    M = M * b1 + G * (1.0 - b1)
    V = V * b2 + G * G * (1.0 - b2)
    ex.write(m, M)
    ex.write(v, V)
    return W * (1.0 - alpha * wd) - alpha * (M * b1h) / (np.sqrt(V * b2h) + eps)


def _ref_sgd(node: Tensor, ex) -> np.ndarray:
    a, grad, p = node.src
    alpha, wd = ex.read(p).reshape(-1)
    return ex.read(a).astype(np.float64) * (1.0 - alpha * wd) - alpha * ex.read(grad)


# -- conformance cases --------------------------------------------------------------------
# The updated tensors must not be leafs with host data (conformance checks those unchanged,
# and the CPU runs on them in place): a is either a pre-allocated zero buffer (a leaf: what
# ggml's constructor asks for, so these cases run on libggml too) or a planned copy of values
# (weight decay then acts; ggml refuses a parameter that is not a leaf), and m, v are copies.

def _param(B: CaseBuilder, ne: tuple[int, ...], leaf: bool) -> Tensor:
    if leaf:
        return B.cache(T.F32, *ne)
    return cont(B.inp(T.F32, *ne))


def _values(B: CaseBuilder, vals: np.ndarray) -> Tensor:
    return B.ctx.new_tensor(T.F32, (len(vals),), name="params").set_data(vals)


_SHAPES = ((17, 3), (64, 4, 2, 3))


def _adamw_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        for leaf, wd, step in ((True, 0.1, 2), (False, 0.1, 3)):
            yield case(OpKind.OPT_STEP_ADAMW, lambda B, ne=ne, leaf=leaf, wd=wd, step=step:
                       opt_step_adamw(_param(B, ne, leaf), B.inp(T.F32, *ne),
                                      cont(B.inp(T.F32, *ne, lo=-0.1, hi=0.1)),
                                      cont(B.inp(T.F32, *ne, lo=0.0, hi=0.01)),
                                      _values(B, adamw_param_values(0.05, wd=wd, step=step))),
                       TOL_DEFAULT, ne=list(ne), a="leaf" if leaf else "copy", wd=wd,
                       step=step)


def _sgd_cases() -> Iterator[Case]:
    for ne in _SHAPES:
        for leaf, wd in ((True, 0.0), (False, 0.1)):
            yield case(OpKind.OPT_STEP_SGD, lambda B, ne=ne, leaf=leaf, wd=wd: opt_step_sgd(
                _param(B, ne, leaf), B.inp(T.F32, *ne), _values(B, sgd_param_values(0.1, wd))),
                TOL_DEFAULT, ne=list(ne), a="leaf" if leaf else "copy", wd=wd)


def _ggml_param_leaf(t: Tensor) -> str | None:
    a = t.src[0]
    if a.op is not None or a.view_src is not None:
        return f"ggml's {t.op} needs its parameter a to be a leaf (ggml_set_param)"
    return None


def _ggml_step(fn: str):
    """ggml's constructor asserts a is flagged as a parameter: flag the leaf, build, and put
    its flags back (a parameter leaf is a node of ggml's graph, not of ggraph's; the step's
    kernel never looks at the flag)."""
    def build(lib, ctx, t: Tensor, S: list):
        flags = S[0].flags
        lib.ggml_set_param(S[0])
        g = getattr(lib, fn)(ctx, *S)
        S[0].flags = flags
        return g
    return build


def _probe_step(k, fn: str, n_src: int, n_params: int):
    a = k.new(T.F32, 8, 2)
    k.lib.ggml_set_param(a)
    return getattr(k.lib, fn)(k.ctx, *([a] * (n_src - 1)), k.new(T.F32, n_params))


register(OpDef(OpKind.OPT_STEP_ADAMW, "adamw", _ref_adamw, cases=_adamw_cases,
               accepts=lambda n: types_ok(n, *[(T.F32,)] * 5), src_labels=True,
               doc="one AdamW step, in place on a, m and v",
               ggml=GGMLMap(cdecl=ggml_fn("ggml_opt_step_adamw", "a", "grad", "m", "v",
                                          "adamw_params")
                            + "\nvoid ggml_set_param(struct ggml_tensor * tensor);",
                            limits=_ggml_param_leaf, build=_ggml_step("ggml_opt_step_adamw"),
                            probe=lambda k: _probe_step(k, "ggml_opt_step_adamw", 5,
                                                        ADAMW_PARAMS))))
register(OpDef(OpKind.OPT_STEP_SGD, "sgd", _ref_sgd, cases=_sgd_cases, src_labels=True,
               accepts=lambda n: types_ok(n, *[(T.F32,)] * 3),
               doc="one SGD step, in place on a",
               ggml=GGMLMap(cdecl=ggml_fn("ggml_opt_step_sgd", "a", "grad", "params"),
                            limits=_ggml_param_leaf, build=_ggml_step("ggml_opt_step_sgd"),
                            probe=lambda k: _probe_step(k, "ggml_opt_step_sgd", 3, SGD_PARAMS))))
