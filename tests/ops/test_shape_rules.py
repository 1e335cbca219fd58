"""Every shape/type rule rejects bad input with a ValueError naming the op, the tensors and
their ne (tests/ops/test_shape_rules_ggml.py: the broadcasting rules accept exactly what ggml
accepts)."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph import Context, ops
from ggraph.ir.tensor import fmt_ne

from shape_cases import CASES, T, case, transposed  # noqa: E402  (tests/ is on sys.path)


# -- mul_mat / mul_mat_id --
@case("mul_mat K mismatch")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "f32", [5, 2], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a, b]


@case("mul_mat dim2 broadcast")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "a"), T(c, "f32", [4, 2, 3], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a, b]


@case("mul_mat dim3 broadcast")
def _(c):
    a, b = T(c, "f32", [4, 3, 1, 2], "a"), T(c, "f32", [4, 3, 1, 3], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a, b]


@case("mul_mat b bigger heads than a is fine, a bigger is not")
def _(c):
    a, b = T(c, "f32", [4, 3, 4], "a"), T(c, "f32", [4, 3, 2], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a, b]


@case("mul_mat a type")
def _(c):
    a, b = T(c, "i32", [4, 3], "a"), T(c, "f32", [4, 2], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a]


@case("mul_mat b quantized")
def _(c):
    a, b = T(c, "f32", [32, 3], "a"), T(c, "q8_0", [32, 2], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [b]


@case("mul_mat transposed a")
def _(c):
    a, b = transposed(c, "f32", [4, 3], "aT"), T(c, "f32", [4, 2], "b")
    return lambda: ops.mul_mat(a, b), "mul_mat", [a]


@case("mul_mat_id as 4-D")
def _(c):
    a, b = T(c, "f32", [4, 3, 2, 2], "as"), T(c, "f32", [4, 1, 5], "b")
    i = T(c, "i32", [2, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [a]


@case("mul_mat_id b 4-D")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [4, 1, 5, 2], "b")
    i = T(c, "i32", [2, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [b]


@case("mul_mat_id ids 3-D")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [4, 1, 5], "b")
    i = T(c, "i32", [2, 5, 2], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [i]


@case("mul_mat_id tokens")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [4, 1, 5], "b")
    i = T(c, "i32", [2, 4], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [b, i]


@case("mul_mat_id K")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [8, 1, 5], "b")
    i = T(c, "i32", [2, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [a, b]


@case("mul_mat_id n_b broadcast")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [4, 2, 5], "b")
    i = T(c, "i32", [3, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [b, i]


@case("mul_mat_id ids type")
def _(c):
    a, b = T(c, "f32", [4, 3, 2], "as"), T(c, "f32", [4, 1, 5], "b")
    i = T(c, "i64", [2, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [i]


@case("mul_mat_id transposed as")
def _(c):
    a, b = transposed(c, "f32", [4, 3, 2], "asT"), T(c, "f32", [4, 1, 5], "b")
    i = T(c, "i32", [2, 5], "ids")
    return lambda: ops.mul_mat_id(a, b, i), "mul_mat_id", [a]


# -- soft_max_ext --
def _sm(c, a_ne=(6, 3, 4), a_type="f32", m_ne=(6, 3), m_type="f16"):
    return T(c, a_type, a_ne, "kq"), (T(c, m_type, m_ne, "mask") if m_ne else None)


@case("soft_max a type")
def _(c):
    a, m = _sm(c, a_type="f16")
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [a]


@case("soft_max a not contiguous")
def _(c):
    a = transposed(c, "f32", [6, 3, 4], "kq")
    return lambda: ops.soft_max_ext(a), "soft_max_ext", [a]


@case("soft_max mask type")
def _(c):
    a, m = _sm(c, m_type="i32")
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [m]


@case("soft_max mask not contiguous")
def _(c):
    a, _ = _sm(c, m_ne=None)
    m = transposed(c, "f16", [6, 3], "mask")
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [m]


@case("soft_max mask ne0")
def _(c):
    a, m = _sm(c, m_ne=(7, 3))
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [a, m]


@case("soft_max mask ne1")
def _(c):
    a, m = _sm(c, m_ne=(6, 2))
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [a, m]


@case("soft_max mask ne2 broadcast")
def _(c):
    a, m = _sm(c, m_ne=(6, 3, 3))
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [a, m]


@case("soft_max mask ne3 broadcast")
def _(c):
    a, m = _sm(c, a_ne=(6, 3, 4, 3), m_ne=(6, 3, 1, 2))
    return lambda: ops.soft_max_ext(a, m), "soft_max_ext", [a, m]


@case("soft_max alibi without mask")
def _(c):
    a, _ = _sm(c, m_ne=None)
    return lambda: ops.soft_max_ext(a, None, 1.0, 8.0), "soft_max_ext", [a]


@case("soft_max sinks count")
def _(c):
    a, m = _sm(c)
    s = T(c, "f32", [3], "sinks")
    return lambda: ops.soft_max_ext(a, m, sinks=s), "soft_max_ext", [a, s]


@case("soft_max sinks type")
def _(c):
    a, m = _sm(c)
    s = T(c, "f16", [4], "sinks")
    return lambda: ops.soft_max_ext(a, m, sinks=s), "soft_max_ext", [s]


@case("soft_max head slice past n_head")
def _(c):
    a, m = _sm(c)
    return lambda: ops.soft_max_ext(a, m, 1.0, 8.0, head_offset=6, n_head=8), "soft_max_ext", [a]


@case("soft_max head offset without n_head")
def _(c):
    a, m = _sm(c)
    return lambda: ops.soft_max_ext(a, m, head_offset=2), "soft_max_ext", [a]


# -- flash_attn_ext --
def _fa(c, q=("f32", (8, 3, 4, 1)), k=("f16", (8, 6, 2, 1)), v=("f16", (8, 6, 2, 1)),
        m=("f16", (6, 3))):
    return (T(c, q[0], q[1], "q"), T(c, k[0], k[1], "k"), T(c, v[0], v[1], "v"),
            T(c, m[0], m[1], "mask") if m else None)


def _fa_case(name, expect, **kw):
    def build(c):
        q, k, v, m = _fa(c, **{x: y for x, y in kw.items() if x in "qkvm"})
        p = {x: y for x, y in kw.items() if x not in "qkvm"}
        named = dict(q=q, k=k, v=v, mask=m)
        return (lambda: ops.flash_attn_ext(q, k, v, m if "nomask" not in p else None,
                                           **{x: y for x, y in p.items() if x != "nomask"}),
                "flash_attn_ext", [named[e] for e in expect])
    CASES["flash_attn " + name] = build


_fa_case("q type", ["q"], q=("f16", (8, 3, 4, 1)))
_fa_case("k type", ["k"], k=("i32", (8, 6, 2, 1)))
_fa_case("v type", ["v"], v=("i32", (8, 6, 2, 1)))
_fa_case("head size", ["q", "k"], k=("f16", (16, 6, 2, 1)))
_fa_case("n_kv", ["k", "v"], v=("f16", (8, 5, 2, 1)))
_fa_case("kv heads", ["k", "v"], v=("f16", (8, 6, 1, 1)))
_fa_case("gqa", ["q", "k"], k=("f16", (8, 6, 3, 1)), v=("f16", (8, 6, 3, 1)))
_fa_case("seqs", ["q", "k"], q=("f32", (8, 3, 4, 3)), k=("f16", (8, 6, 2, 2)),
         v=("f16", (8, 6, 2, 2)))
_fa_case("mask type", ["mask"], m=("i32", (6, 3)))
_fa_case("mask n_kv", ["mask", "k"], m=("f16", (5, 3)))
_fa_case("mask rows", ["mask", "q"], m=("f16", (6, 2)))
_fa_case("mask heads", ["mask", "q"], m=("f16", (6, 3, 3)))
_fa_case("alibi without mask", ["q"], max_bias=8.0, nomask=True)
_fa_case("negative softcap", ["q"], softcap=-1.0)
_fa_case("head slice", ["q"], head_offset=1, n_head=4)


# -- rope --
def _rope(c, a=("f32", (8, 2, 3)), pos=("i32", (3,))):
    return T(c, a[0], a[1], "x"), T(c, pos[0], pos[1], "pos")


@case("rope a type")
def _(c):
    a, p = _rope(c, a=("q8_0", (32, 2, 3)))
    return lambda: ops.rope_ext(a, p), "rope_ext", [a]


@case("rope pos type")
def _(c):
    a, p = _rope(c, pos=("f32", (3,)))
    return lambda: ops.rope_ext(a, p), "rope_ext", [p]


@case("rope pos not a vector")
def _(c):
    a, p = _rope(c, pos=("i32", (3, 2)))
    return lambda: ops.rope_ext(a, p), "rope_ext", [p]


@case("rope pos count")
def _(c):
    a, p = _rope(c, pos=("i32", (2,)))
    return lambda: ops.rope_ext(a, p), "rope_ext", [a, p]


@case("rope odd n_dims")
def _(c):
    a, p = _rope(c)
    return lambda: ops.rope_ext(a, p, n_dims=5), "rope_ext", [a]


@case("rope n_dims past head")
def _(c):
    a, p = _rope(c)
    return lambda: ops.rope_ext(a, p, n_dims=10), "rope_ext", [a]


@case("rope freq_base")
def _(c):
    a, p = _rope(c)
    return lambda: ops.rope_ext(a, p, freq_base=0.0), "rope_ext", [a]


@case("rope freq_scale")
def _(c):
    a, p = _rope(c)
    return lambda: ops.rope_ext(a, p, freq_scale=-1.0), "rope_ext", [a]


@case("rope freq_factors count")
def _(c):
    a, p = _rope(c)
    f = T(c, "f32", [3], "ff")
    return lambda: ops.rope_ext(a, p, f), "rope_ext", [f]


@case("rope freq_factors type")
def _(c):
    a, p = _rope(c)
    f = T(c, "f16", [4], "ff")
    return lambda: ops.rope_ext(a, p, f), "rope_ext", [f]


@case("rope mode")
def _(c):
    a, p = _rope(c)
    return lambda: ops.rope_ext(a, p, mode=1), "rope_ext", [a]


# -- norms, element-wise, reductions --
for _name, _fn in [("rms_norm", ops.rms_norm), ("norm", ops.norm), ("sum_rows", ops.sum_rows),
                   ("argsort", ops.argsort), ("silu", ops.silu), ("gelu", ops.gelu),
                   ("sigmoid", ops.sigmoid), ("scale", lambda a: ops.scale(a, 2.0)),
                   ("fill", lambda a: ops.fill(a, 1.0)), ("clamp", lambda a: ops.clamp(a, 0, 1)),
                   ("top_k", lambda a: ops.top_k(a, 2))]:
    for _t in ("i32", "q8_0") + (("f16",) if _name in ("rms_norm", "norm", "sum_rows",
                                                       "argsort", "top_k") else ()):
        def _build(c, fn=_fn, t=_t, op=_name):
            a = T(c, t, [32, 2], "a")
            return lambda: fn(a), op, [a]
        CASES[f"{_name} type {_t}"] = _build


@case("rms_norm negative eps")
def _(c):
    a = T(c, "f32", [4, 2], "a")
    return lambda: ops.rms_norm(a, -1e-6), "rms_norm", [a]


@case("clamp min above max")
def _(c):
    a = T(c, "f32", [4, 2], "a")
    return lambda: ops.clamp(a, 1.0, 0.0), "clamp", [a]


@case("top_k k zero")
def _(c):
    a = T(c, "f32", [4, 2], "a")
    return lambda: ops.top_k(a, 0), "top_k", [a]


@case("top_k k past row")
def _(c):
    a = T(c, "f32", [4, 2], "a")
    return lambda: ops.top_k(a, 5), "top_k", [a]


for _op in ("add", "mul", "div"):
    for _label, (_an, _at, _bn, _bt, _names) in {
        "broadcast": ([4, 3], "f32", [3, 3], "f32", "ab"),
        "b bigger": ([4, 1], "f32", [4, 2], "f32", "ab"),
        "a type": ([4, 3], "i32", [4, 3], "f32", "a"),
        "b type": ([32, 3], "f32", [32, 3], "q8_0", "b"),
    }.items():
        def _build(c, op=_op, an=_an, at=_at, bn=_bn, bt=_bt, names=_names):
            a, b = T(c, at, an, "a"), T(c, bt, bn, "b")
            return lambda: getattr(ops, op)(a, b), op, [{"a": a, "b": b}[n] for n in names]
        CASES[f"{_op} {_label}"] = _build


@case("swiglu shapes")
def _(c):
    g, u = T(c, "f32", [4, 3], "gate"), T(c, "f32", [4, 2], "up")
    return lambda: ops.swiglu(g, u), "swiglu", [g, u]


@case("swiglu types")
def _(c):
    g, u = T(c, "f32", [4, 3], "gate"), T(c, "f16", [4, 3], "up")
    return lambda: ops.swiglu(g, u), "swiglu", [g, u]


@case("swiglu gate type")
def _(c):
    g, u = T(c, "i32", [4, 3], "gate"), T(c, "f32", [4, 3], "up")
    return lambda: ops.swiglu(g, u), "swiglu", [g]


# -- rows --
@case("get_rows idx type")
def _(c):
    a, i = T(c, "f32", [4, 5], "a"), T(c, "f32", [2], "idx")  # (I32 and I64 are indices)
    return lambda: ops.get_rows(a, i), "get_rows", [i]


@case("get_rows idx 4-D")
def _(c):
    a, i = T(c, "f32", [4, 5], "a"), T(c, "i32", [2, 1, 1, 2], "idx")
    return lambda: ops.get_rows(a, i), "get_rows", [i]


@case("get_rows batch dims")
def _(c):
    a, i = T(c, "f32", [4, 5, 3], "a"), T(c, "i32", [2, 2], "idx")
    return lambda: ops.get_rows(a, i), "get_rows", [a, i]


@case("get_rows batch dim 3")
def _(c):
    a, i = T(c, "f32", [4, 5, 2, 2], "a"), T(c, "i32", [2, 2, 3], "idx")
    return lambda: ops.get_rows(a, i), "get_rows", [a, i]


def _sr(c, dst=("f16", (32, 8, 2)), src=("f32", (32, 3, 2)), idx=("i64", (3,))):
    return (T(c, dst[0], dst[1], "cache"), T(c, src[0], src[1], "src"),
            T(c, idx[0], idx[1], "idx"))


def _sr_case(name, expect, **kw):
    def build(c):
        d, s, i = _sr(c, **kw)
        named = {"cache": d, "src": s, "idx": i}
        return lambda: ops.set_rows(d, s, i), "set_rows", [named[e] for e in expect]
    CASES["set_rows " + name] = build


_sr_case("src type", ["src"], src=("f16", (32, 3, 2)))
_sr_case("idx type", ["idx"], idx=("f32", (3,)))
_sr_case("dst type", ["cache"], dst=("i32", (32, 8, 2)))
_sr_case("row length", ["cache", "src"], dst=("f16", (64, 8, 2)))
_sr_case("batch dims", ["cache", "src"], dst=("f16", (32, 8, 3)))
_sr_case("row count", ["src", "idx"], idx=("i64", (2,)))
_sr_case("idx broadcast", ["idx"], idx=("i64", (3, 3)))
_sr_case("idx 4-D", ["idx"], idx=("i64", (3, 1, 1, 2)))


@case("set_rows rows not packed")
def _(c):
    d = transposed(c, "f32", [32, 8], "cacheT")
    s, i = T(c, "f32", [32, 3], "src"), T(c, "i64", [3], "idx")
    return lambda: ops.set_rows(d, s, i), "set_rows", [d]


# -- concat / repeat --
@case("concat types")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "f16", [4, 3], "b")
    return lambda: ops.concat(a, b, 0), "concat", [a, b]


@case("concat other dims")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "f32", [5, 2], "b")
    return lambda: ops.concat(a, b, 0), "concat", [a, b]


@case("concat dim 4")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "f32", [4, 3], "b")
    return lambda: ops.concat(a, b, 4), "concat", [a, b]


@case("concat quantized")
def _(c):
    a, b = T(c, "q8_0", [32, 3], "a"), T(c, "q8_0", [32, 3], "b")
    return lambda: ops.concat(a, b, 1), "concat", [a]


@case("repeat not a tiling")
def _(c):
    a, b = T(c, "f32", [3, 2], "a"), T(c, "f32", [4, 4], "b")
    return lambda: ops.repeat(a, b), "repeat", [a, b]


@case("repeat empty into non-empty")
def _(c):
    a, b = T(c, "f32", [0, 2], "a"), T(c, "f32", [4, 4], "b")
    return lambda: ops.repeat(a, b), "repeat", [a, b]


@case("add empty b")
def _(c):
    a, b = T(c, "f32", [4, 4], "a"), T(c, "f32", [0, 4], "b")
    return lambda: ops.add(a, b), "add", [a, b]


@case("repeat quantized")
def _(c):
    a, b = T(c, "q8_0", [32, 1], "a"), T(c, "q8_0", [32, 4], "b")
    return lambda: ops.repeat(a, b), "repeat", [a]


@pytest.mark.parametrize("name", list(CASES))
def test_rule_rejects_with_named_message(name):
    ctx = Context("test")
    thunk, op, tensors = CASES[name](ctx)
    with pytest.raises(ValueError) as ei:
        thunk()
    msg = str(ei.value)
    assert msg.startswith(op + ":"), msg
    for t in tensors:
        assert repr(t.name) in msg, (t.name, msg)
        assert f"ne={fmt_ne(t.ne)}" in msg, (t.ne, msg)
        assert str(t.type) in msg, msg


@pytest.mark.parametrize("type", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("ne0", [1, 16, 33, 48, 100])
def test_quantized_tensor_row_not_multiple_of_32(type, ne0):
    ctx = Context()
    with pytest.raises(ValueError) as ei:
        ctx.new_tensor(type, (ne0, 2), name="w")
    msg = str(ei.value)
    assert "'w'" in msg and f"ne[0]={ne0}" in msg and "32" in msg and type in msg
    with pytest.raises(ValueError, match=f"{ne0}"):
        ctx.from_numpy(np.zeros((2, ne0), np.float32), type, name="w")
