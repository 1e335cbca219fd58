"""No module reads or patches another module's private names (issue 28): an AST scan of the
library, the commands, the benchmarks and the scripts.

A private name is one with a single leading underscore. `x._name` is the module's own where the
same file defines `_name` (a function, class, module global, or an attribute it assigns), and
`super()._name` is a subclass calling its base; anything else that some other file of ggraph
defines is a read of another module's private state, and so is `from m import _name`. Private
names of other projects (numba's dispatcher internals, the standard library) are not ggraph's
to rename: the few read on purpose are listed below with the reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

from source_files import LIBRARY, ROOT, py_files

SCANNED = LIBRARY + ("benchmarks", "scripts")

# names other projects define, read on purpose: (file, name) -> why
FOREIGN = {
    ("backends/cuda/replay.py", "_prepare_args"): "numba-cuda's argument marshalling, to "
    "launch a kernel without its dispatcher (falls back to the dispatcher if it changes)",
    ("backends/cuda/replay.py", "_codelibrary"): "numba-cuda's compiled module, for the "
    "kernel handle of a prepared launch",
    ("backends/cuda/runtime.py", "_ary"): "the host array behind numba's simulator arrays",
    ("benchmarks/compare_gemma3_llama_cpp.py", "_ctx"): "llama-cpp-python's context, for "
    "the last token's logits without logits_all",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a file defines: functions, classes, globals, and attributes it assigns
    on its own objects (self, cls)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
            out.add(n.attr)   # its own objects' state (a store into another's is a patch)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
    return {x for x in out if _private(x)}


def _reads(path: Path, tree: ast.AST, own: set[str], ours: set[str]) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    bad = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ggraph") or (
                isinstance(n, ast.ImportFrom) and n.level):
            bad += [f"{rel}:{n.lineno}: from {'.' * n.level}{n.module or ''} import {a.name}"
                    for a in n.names if _private(a.name)]
        if not (isinstance(n, ast.Attribute) and _private(n.attr)):
            continue
        v = n.value
        if isinstance(v, ast.Name) and v.id in ("self", "cls"):
            continue
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
            continue
        if n.attr in own or n.attr not in ours or (rel, n.attr) in FOREIGN:
            continue
        bad.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
    return bad


def test_no_module_reads_another_modules_private_names():
    trees = {p: ast.parse(p.read_text(), str(p)) for p in py_files(SCANNED)}
    defined = {p: _defined(t) for p, t in trees.items()}
    ours = set().union(*defined.values())
    bad = [b for p, t in trees.items() for b in _reads(p, t, defined[p], ours)]
    assert not bad, "private names read across modules:\n" + "\n".join(bad)


def test_the_scan_sees_a_private_read(tmp_path):
    """The scan itself: a file reading another's `_calls` is caught; its own is not."""
    src = "def f(session):\n    return session._calls\n"
    other = "class S:\n    def __init__(self):\n        self._calls = []\n"
    a, b = ast.parse(src), ast.parse(other)
    p = ROOT / "tools" / "probe.py"
    assert _reads(p, a, _defined(a), _defined(b)) == ["tools/probe.py:2: session._calls"]
    assert _reads(p, b, _defined(b), _defined(b)) == []


def test_foreign_entries_are_still_needed():
    """Every allowed foreign read is still in its file (a stale entry would hide a new one)."""
    for (rel, name), why in FOREIGN.items():
        assert f"._{name[1:]}" in (ROOT / rel).read_text(), (rel, name, why)
