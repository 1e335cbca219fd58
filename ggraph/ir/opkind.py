"""OpKind, the name of every operation the IR can record, and Family, the kinds of op.

Op kinds are not listed here: each op module in ggraph.ops defines its own kinds
(`GELU = OpKind.define("gelu", Family.ACTIVATION)`), so adding an op touches its op module and
one kernel per backend, never a central list. A kind is a singleton that behaves like an enum
member: `OpKind.GELU`, `OpKind["GELU"]`, `OpKind("gelu")`, iteration in definition order,
identity hashing, `str(kind) == "gelu"`. Kinds exist once ggraph.ops is imported (importing
`ggraph` does that). Leaf tensors (weights, inputs, caches) have no op: `Tensor.op is None`.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Iterator


class Family(Enum):
    """What an op does, for pictures and for whoever groups ops (views compute nothing)."""
    VIEW = "view"
    COPY = "copy/rows"
    MATMUL = "matmul"
    ATTENTION = "attention"
    ROPE = "rope"
    NORM = "norm"
    ARITHMETIC = "arithmetic"
    ACTIVATION = "activation"
    REDUCE = "reduce"

    def __str__(self) -> str:
        return self.value


class _OpKindType(type):
    """Enum-like class behaviour for OpKind: iteration, len, lookup by name and by value."""

    def __iter__(cls) -> Iterator["OpKind"]:
        return iter(tuple(cls._by_name.values()))  # type: ignore[attr-defined]

    def __len__(cls) -> int:
        return len(cls._by_name)  # type: ignore[attr-defined]

    def __getitem__(cls, name: str) -> "OpKind":
        return cls._by_name[name]  # type: ignore[attr-defined]

    def __call__(cls, value: Any) -> "OpKind":
        if isinstance(value, OpKind):
            return value
        kind = cls._by_value.get(value)  # type: ignore[attr-defined]
        if kind is None:
            raise ValueError(f"{value!r} is not an op; ggraph knows "
                             f"{', '.join(k.value for k in cls)}")  # type: ignore[attr-defined]
        return kind

    def __getattr__(cls, name: str) -> Any:  # only reached for names not defined (yet)
        if name.isupper():
            raise AttributeError(f"OpKind has no op {name}: ops are defined by their modules "
                                 f"in ggraph.ops (import ggraph.ops first)")
        raise AttributeError(name)


class OpKind(metaclass=_OpKindType):
    """One operation the IR can record; made by `OpKind.define` in the op's own module."""

    __slots__ = ("name", "value", "family")
    _by_name: dict[str, "OpKind"] = {}
    _by_value: dict[str, "OpKind"] = {}

    name: str
    value: str
    family: Family

    @classmethod
    def define(cls, value: str, family: Family) -> "OpKind":
        """The kind `value` (lower case, ggml's op name), available as OpKind.VALUE."""
        name = value.upper()
        if not name.isidentifier() or name in cls._by_name:
            raise ValueError(f"op {value!r} is defined twice or is not a valid name")
        kind = object.__new__(cls)
        kind.name, kind.value, kind.family = name, value, family
        cls._by_name[name] = kind
        cls._by_value[value] = kind
        type.__setattr__(cls, name, kind)
        return kind

    @property
    def is_view(self) -> bool:
        return self.family is Family.VIEW

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"OpKind.{self.name}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return OpKind, (self.value,)  # pickles by name: the same singleton comes back
