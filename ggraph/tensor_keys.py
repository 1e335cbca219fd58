"""Maps keyed by Tensor that still answer lookups by id(tensor): the bridge while callers move
from `d[id(t)]` to `d[t]`.

Tensor hashes by identity, so ggraph keys its maps by the tensor itself. The scheduler's
(`Schedule.node_device`, `.clones`, `.copies`) are still read with id(t) or (id(t), device)
by code written before that change (backends/multi.py, tests/test_sched.py), which also
passes device placements keyed by id(t): TensorKeyed answers the first and `lookup` reads the
second. Both are transitional; once no caller passes an id, TensorKeyed can become a plain
dict, `lookup` a plain `.get`, and this module can go.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from ggraph.tensor import Tensor

V = TypeVar("V")


def _head(key: Any) -> Any:
    """The tensor part of a key: the key itself, or the first item of a (tensor, int) pair."""
    return key[0] if type(key) is tuple and key else key


class TensorKeyed(dict):
    """A dict keyed by Tensor, or by (Tensor, int) pairs, that also finds an entry by the
    id() of its tensor. Iteration, `keys()` and `items()` give the tensors."""

    __slots__ = ("_by_id", "_indexed")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._by_id: dict[int, Tensor] = {}
        self._indexed = -1          # len(self) when _by_id was built

    def _resolve(self, key: Any) -> Any:
        head = _head(key)
        if not isinstance(head, int):
            return key
        # the maps only grow while they are built, so a changed length means new keys
        if self._indexed != len(self):
            self._by_id = {id(_head(k)): _head(k) for k in self}
            self._indexed = len(self)
        t = self._by_id.get(head)
        if t is None:
            return key
        return (t, *key[1:]) if type(key) is tuple else t

    def __getitem__(self, key: Any) -> Any:
        return dict.__getitem__(self, self._resolve(key))

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, self._resolve(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return dict.get(self, self._resolve(key), default)


def lookup(mapping: Mapping[Any, V], t: Tensor) -> V | None:
    """mapping[t], or mapping[id(t)] for a mapping still keyed by id; None when neither."""
    value = mapping.get(t)
    return mapping.get(id(t)) if value is None else value


__all__ = ["TensorKeyed", "lookup"]
