"""Settings (ggraph/config.py): every GGRAPH_* variable is read there and nowhere else in the
library, each when its function is called, and no library module changes the environment
when it is imported (the one exception, NUMBA_CACHE_DIR set by `import ggraph` before numba
loads, is named below)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from source_files import ROOT, py_files

from ggraph import config

# (file, variable): set when imported, and why
IMPORT_TIME = {("ggraph/__init__.py", "NUMBA_CACHE_DIR"): "numba reads it once, when it loads; "
               "every entry point shares one cache outside the source tree"}


def _environ(node: ast.AST) -> bool:
    """`os.environ` (or `_os.environ`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id in ("os", "_os"))


def _ggraph_reads(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(tree):
        key = None
        if isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant):
            f = n.func
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault")
                    and _environ(f.value)) or (isinstance(f, ast.Attribute) and f.attr == "getenv"):
                key = n.args[0].value
        elif isinstance(n, ast.Subscript) and _environ(n.value) and isinstance(n.slice,
                                                                                ast.Constant):
            key = n.slice.value
        if isinstance(key, str) and key.startswith("GGRAPH_"):
            out.append((n.lineno, key))
    return out


def test_every_setting_is_read_in_config():
    bad = [f"{p.relative_to(ROOT)}:{line}: {key}" for p in py_files()
           if p.relative_to(ROOT).as_posix() != "ggraph/config.py"
           for line, key in _ggraph_reads(ast.parse(p.read_text()))]
    assert not bad, "GGRAPH_* read outside ggraph/config.py:\n" + "\n".join(bad)


def _module_level(tree: ast.Module):
    """Statements that run when the module is imported (not inside a def or class)."""
    todo = list(tree.body)
    while todo:
        s = todo.pop()
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield s
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo += [x for x in getattr(s, field, []) if isinstance(x, ast.stmt)]


def _environ_changes(tree: ast.Module) -> list[tuple[int, str]]:
    out = []
    for s in _module_level(tree):
        for n in ast.walk(s):
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Subscript) and _environ(t.value):
                        key = t.slice.value if isinstance(t.slice, ast.Constant) else "?"
                        out.append((n.lineno, str(key)))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (
                    (n.func.attr in ("update", "setdefault", "pop", "clear")
                     and _environ(n.func.value)) or n.func.attr == "putenv"
                    or getattr(n.func, "attr", "") == "configure_openmp"):
                out.append((n.lineno, ast.unparse(n)[:60]))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                    n.func.id == "configure_openmp":
                out.append((n.lineno, "configure_openmp()"))
    return out


def test_no_module_changes_the_environment_when_imported():
    bad = []
    for p in py_files():
        rel = p.relative_to(ROOT).as_posix()
        for line, what in _environ_changes(ast.parse(p.read_text())):
            if (rel, what) not in IMPORT_TIME:
                bad.append(f"{rel}:{line}: {what}")
    assert not bad, "the environment changed at import:\n" + "\n".join(bad)


def test_the_scans_see_what_they_look_for():
    src = ("import os\nX = os.environ.get('GGRAPH_FOO', '1')\nos.environ['A'] = '1'\n"
           "def f():\n    os.environ['B'] = '2'\n    return os.getenv('GGRAPH_BAR')\n")
    tree = ast.parse(src)
    assert _ggraph_reads(tree) == [(2, "GGRAPH_FOO"), (6, "GGRAPH_BAR")]
    assert _environ_changes(tree) == [(3, "A")]


def test_flags_and_numbers(monkeypatch):
    monkeypatch.setenv("GGRAPH_FUSE", "0")
    assert config.fuse() is False
    monkeypatch.setenv("GGRAPH_FUSE", "")
    assert config.fuse() is True
    monkeypatch.setenv("GGRAPH_EXACT_ACTIVATIONS", "1")
    assert config.exact_activations() is True
    monkeypatch.setenv("GGRAPH_PARALLEL_MIN_PRODUCT", "4096")
    assert config.parallel_min_product() == 4096
    monkeypatch.setenv("GGRAPH_PARALLEL_MIN_PRODUCT", "lots")
    with pytest.raises(ValueError, match="GGRAPH_PARALLEL_MIN_PRODUCT='lots' is not an integer"):
        config.parallel_min_product()
    monkeypatch.setenv("GGRAPH_CUDASIM_GEOMETRY", "huge")
    with pytest.raises(ValueError, match="expected small or gpu"):
        config.cudasim_geometry()
    monkeypatch.setenv("GGRAPH_CACHE", "/tmp/somewhere")
    assert config.cache_dir() == Path("/tmp/somewhere")
