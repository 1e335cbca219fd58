"""Names a kernel template reads but does not define: each binding supplies them
(backends/jit.py: Target.bind, and the copies it makes of the shared codecs). A template
module declares them with `bound(...)`, so a reader (and a linter) sees where they come from;
a copy compiled without one fails in numba naming it ("Untyped global name 'CELLS'")."""
from __future__ import annotations


class Unbound:
    """The stand-in of a name a binding supplies."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: bound per binding, backends/jit.py>"

    def __call__(self, *args: object, **kw: object) -> None:
        raise TypeError(f"{self.name} is bound per binding (backends/jit.py); this code ran "
                        f"unbound")


def bound(*names: str) -> Unbound | tuple[Unbound, ...]:
    """Stand-ins for `names` (one name: its stand-in; several: a tuple, in order)."""
    out = tuple(Unbound(n) for n in names)
    return out[0] if len(out) == 1 else out
