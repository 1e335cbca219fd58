"""The shape-rule cases of tests/ops/test_shape_rules.py: a registry of named cases, each building
(thunk, op, tensors the message must name), the tensor helpers they share, and the cases of
views and copies (the other ops' cases are in the test module itself)."""
from __future__ import annotations

from ggraph import ops

def T(ctx, type, ne, name):
    return ctx.new_tensor(type, ne, name=name)


def transposed(ctx, type, ne, name):
    """A transposed (nb0 > nb1) view of a fresh tensor of ne [ne1, ne0, ...]."""
    ne = list(ne)
    src = T(ctx, type, [ne[1], ne[0]] + ne[2:], name + "_src")
    return ops.transpose(src, name=name)


# Each case builds (thunk, op, tensors the message must name).
CASES = {}


def case(name):
    def deco(f):
        CASES[name] = f
        return f
    return deco


# -- views and copies --
@case("view past the end")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    return lambda: ops.view_2d(a, 8, 2, a.nb[1], 3 * a.nb[1]), "view", [a]


@case("view_1d past the end")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    return lambda: ops.view_1d(a, 30, 3 * 4), "view", [a]


@case("strided view past the end")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    return lambda: ops.view_2d(a, 4, 4, 2 * a.nb[1], 0), "view", [a]


@case("view of view past the root")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    v = ops.view_2d(a, 8, 2, a.nb[1], 2 * a.nb[1], name="v")
    return lambda: ops.view_1d(v, 9, a.nb[1]), "view", [v]


@case("negative view offset")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    return lambda: ops.view_1d(a, 2, -4), "view", [a]


@case("view of view before the root")
def _(c):
    a = T(c, "f32", [8, 4], "a")
    v = ops.view_1d(a, 8, a.nb[1], name="v")
    return lambda: ops.view_1d(v, 2, -2 * a.nb[1]), "view", [v]


@case("reshape non-contiguous")
def _(c):
    a = transposed(c, "f32", [4, 3], "aT")
    return lambda: ops.reshape(a, 12), "reshape", [a]


@case("reshape element count")
def _(c):
    a = T(c, "f32", [4, 3], "a")
    return lambda: ops.reshape(a, 5, 2), "reshape", [a]


@case("permute axes")
def _(c):
    a = T(c, "f32", [4, 3, 2], "a")
    return lambda: ops.permute(a, 0, 0, 1, 2), "permute", [a]


@case("permute quantized rows")
def _(c):
    a = T(c, "q8_0", [32, 3], "a")
    return lambda: ops.transpose(a), "transpose", [a]


@case("cont element count")
def _(c):
    a = T(c, "f32", [4, 3], "a")
    return lambda: ops.cont(a, 5, 2), "cont", [a]


@case("cpy element count")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "f16", [4, 2], "b")
    return lambda: ops.cpy(a, b), "cpy", [a, b]


@case("cpy quantized source")
def _(c):
    a, b = T(c, "q8_0", [32, 3], "a"), T(c, "f32", [32, 3], "b")
    return lambda: ops.cpy(a, b), "cpy", [a, b]


@case("cpy float to int")
def _(c):
    a, b = T(c, "f32", [4, 3], "a"), T(c, "i32", [4, 3], "b")
    return lambda: ops.cpy(a, b), "cpy", [a, b]


# quantized rows whose length is not a multiple of 32, reached through an op
@case("view_2d quantized half block")
def _(c):
    a = T(c, "q8_0", [64, 4], "w")
    return lambda: ops.view_2d(a, 16, 4, a.nb[1], 0), "view", [a]


@case("view_1d quantized")
def _(c):
    a = T(c, "q4_0", [64, 4], "w")
    return lambda: ops.view_1d(a, 40, 0), "view", [a]


@case("reshape quantized")
def _(c):
    a = T(c, "q4_0", [64, 2], "w")
    return lambda: ops.reshape(a, 16, 8), "reshape", [a]


@case("cont quantized")
def _(c):
    a = T(c, "q4_1", [64, 2], "w")
    return lambda: ops.cont(a, 16, 8), "cont", [a]
