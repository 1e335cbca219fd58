"""ggraph.ops: op constructors (which record nodes and compute nothing) and the op registry.

Importing this package imports every op module in it (found, not listed), which defines each
op kind and registers its record: `REGISTRY[OpKind.X]` holds X's params, reference, in-place
flag, family, accepted types, ggml mapping and conformance cases, all declared in X's own
module. The functions and classes an op module defines (constructors, params dataclasses,
enums) are exported here as `ggraph.ops.<name>`.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from ggraph.ir.opkind import OpKind as _OpKind

from .case import Case, CaseBuilder
from .registry import REGISTRY, GGMLMap, OpDef, get_op, ops_where

_INFRASTRUCTURE = {"case", "registry"}  # modules that hold machinery, not ops

for _info in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name in _INFRASTRUCTURE or _info.name.startswith("_"):
        continue
    _mod = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name, _value in vars(_mod).items():
        if not _name.startswith("_") and getattr(_value, "__module__", None) == _mod.__name__:
            globals()[_name] = _value

_missing = [k for k in _OpKind if k not in REGISTRY or REGISTRY[k].cases is None]
assert not _missing, f"ops without a record or without conformance cases: {_missing}"

__all__ = [n for n in dir() if not n.startswith("_")]
