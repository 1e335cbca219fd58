"""Toy ops for tests/ops/test_op_records.py, defined outside ggraph.ops the way an op module
defines them: a kind, a constructor, and one record holding the ggml mapping (constructor,
C declaration, enum probe, limits) and the picture's edge-label rule. Nothing in
ggraph/check/ggml_ref.py, ggml_cdefs.py or dot.py names them.

Importing this module registers the toys in the process-wide registry, so only a child
process imports it (`facts()` runs there and prints what the test asserts on).

- toy_sub: a - b, ggml's SUB (as ggraph's own sub is: the two records share ggml's
  constructor and its declaration). Its sources play
  different roles, so pictures label them; ggml's constructor would broadcast b but the toy
  says it cannot (`limits`), and ggml's CPU kernel needs packed rows in a (`cpu_limits`).
- toy_neg: -a, ggml's UNARY op NEG, through GGMLMap.unary (packed rows needed).
- toy_late_div: a / b as ggml's DIV, registered after libggml was loaded: its enum is read
  on first use.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from ggraph import Context, build_graph

from ggraph.pictures import dot
from ggraph.ops import views as V
from ggraph.ops.registry import (GGMLMap, GGMLProbe, OpDef, ggml_packed_sources, new_node,
                                 register, require)
from ggraph.ir.opkind import Family, OpKind
from ggraph.ir.tensor import Tensor

TOY_SUB = OpKind.define("toy_sub", Family.ARITHMETIC)
TOY_NEG = OpKind.define("toy_neg", Family.ACTIVATION)
TOY_LATE_DIV = OpKind.define("toy_late_div", Family.ARITHMETIC)

SUB_DECL = ("struct ggml_tensor * ggml_sub(struct ggml_context * ctx, struct ggml_tensor * a, "
            "struct ggml_tensor * b);")
NEG_DECL = "struct ggml_tensor * ggml_neg(struct ggml_context * ctx, struct ggml_tensor * a);"
NO_BROADCAST = "toy_sub: ggml mapping takes b of a's shape only"


def toy_sub(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    require(a.type == b.type, "toy_sub", "a and b must have one type", a=a, b=b)
    return new_node(TOY_SUB, (a, b), a.type, a.ne, name=name)


def toy_neg(a: Tensor, name: str = "") -> Tensor:
    return new_node(TOY_NEG, (a,), a.type, a.ne, name=name)


def toy_late_div(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return new_node(TOY_LATE_DIV, (a, b), a.type, a.ne, name=name)


def _sub_limits(t: Tensor) -> str | None:
    return NO_BROADCAST if t.src[0].ne != t.src[1].ne else None


def _sub_probe(k: GGMLProbe) -> Any:
    return k.lib.ggml_sub(k.ctx, k.a, k.a)


def _ref(f):
    return lambda n, ex: f(*(ex.read(s).astype(np.float64) for s in n.src))


register(OpDef(TOY_SUB, "-", _ref(np.subtract), cases=lambda: iter(()), src_labels=True,
               ggml=GGMLMap("SUB", cdecl=SUB_DECL, probe=_sub_probe, limits=_sub_limits,
                            cpu_limits=ggml_packed_sources(0),
                            build=lambda lib, ctx, t, S: lib.ggml_sub(ctx, *S))))
register(OpDef(TOY_NEG, "neg", _ref(np.negative), cases=lambda: iter(()),
               ggml=GGMLMap.unary("NEG", cdecl=NEG_DECL,
                                  probe=lambda k: k.lib.ggml_neg(k.ctx, k.a),
                                  build=lambda lib, ctx, t, S: lib.ggml_neg(ctx, S[0]))))


def _err(got: np.ndarray, want: np.ndarray) -> float:
    """Largest error relative to the value's size (ggml computes in f32)."""
    return float((np.abs(got - want) / (np.abs(want) + 1.0)).max())


def _graph(f, *shapes: tuple[int, ...], strided: bool = False):
    ctx = Context()
    rng = np.random.default_rng(7)
    srcs, vals = [], []
    for i, ne in enumerate(shapes):
        if strided and i == 0:  # a transposed view: rows not packed
            big = ctx.new_tensor("f32", (ne[1], ne[0]), name=f"x{i}")
            big.set_data(rng.uniform(-1, 1, big.nelements))
            srcs.append(V.transpose(big))
            vals.append(None)
            continue
        v = rng.uniform(-1, 1, int(np.prod(ne))).reshape(tuple(reversed(ne)))
        srcs.append(ctx.new_tensor("f32", ne, name=f"x{i}").set_data(v))
        vals.append(v)
    out = f(*srcs, name="out").set_output()
    return build_graph(out), out, vals


def facts(use_ggml: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    g, _, _ = _graph(toy_sub, (8, 3), (8, 3))
    out["dot_sub"] = dot.to_dot(g)
    g, _, _ = _graph(toy_neg, (8, 3))
    out["dot_neg"] = dot.to_dot(g)
    if not use_ggml:
        return out
    from ggraph.check import ggml_ref
    lib = ggml_ref.load()
    ref = ggml_ref.GGMLReference()
    out["ggml_names"] = {str(k): lib.op_names[lib.op[k]] for k in (TOY_SUB, TOY_NEG)}
    out["neg_sub_op"] = TOY_NEG in lib.sub
    g, o, (a, b) = _graph(toy_sub, (8, 3), (8, 3))
    out["sub_err"] = _err(ref.run(g, o), a - b)
    g, o, (a,) = _graph(toy_neg, (8, 3))
    out["neg_err"] = _err(ref.run(g, o), -a)
    out["sub_broadcast"] = ref.supports(_graph(toy_sub, (8, 3), (8, 1))[0])
    out["sub_strided"] = ref.supports(_graph(toy_sub, (8, 3), (8, 3), strided=True)[0])
    out["neg_strided"] = ref.supports(_graph(toy_neg, (8, 3), strided=True)[0])
    # a record registered after load(): probed when first met
    register(OpDef(TOY_LATE_DIV, "/", _ref(np.divide), cases=lambda: iter(()),
                   ggml=GGMLMap("DIV", probe=lambda k: k.lib.ggml_div(k.ctx, k.a, k.a),
                                build=lambda lib, ctx, t, S: lib.ggml_div(ctx, *S))))
    out["late_known_before"] = TOY_LATE_DIV in lib.op
    g, o, (a, b) = _graph(toy_late_div, (8, 3), (8, 3))
    out["late_err"] = _err(ref.run(g, o), a / b)
    out["late_name"] = lib.op_names[lib.op[TOY_LATE_DIV]]
    return out


if __name__ == "__main__":
    print(json.dumps(facts(sys.argv[1:] == ["ggml"])))
