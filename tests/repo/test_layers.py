"""The layers import downward only (docs/architecture.md): import-linter's contract in
pyproject.toml holds, and no two modules import each other, directly or round a circle.

Both run on a copy of the package laid out as the wheel installs it (the top-level folders ops/,
backends/, graphs/ and tools/ become ggraph.ops, ...), in a child process whose path finds the
copy first: import-linter and grimp read files from the package's folder, which the editable
install does not have in one piece.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from source_files import LIBRARY, ROOT, py_files

FOLDERS = [f for f in LIBRARY if f != "ggraph"]   # installed as ggraph.<folder>

CYCLES = r"""
import json, sys
import grimp
g = grimp.build_graph("ggraph", include_external_packages=False, cache_dir=None)
edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def strong(v):  # Tarjan's strongly connected components, iteratively
    work = [(v, iter(edges[v]))]
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    while work:
        u, it = work[-1]
        w = next(it, None)
        if w is not None:
            if w not in index:
                index[w] = low[w] = n[0]; n[0] += 1; stack.append(w); on.add(w)
                work.append((w, iter(edges[w])))
            elif w in on:
                low[u] = min(low[u], index[w])
            continue
        work.pop()
        if work:
            low[work[-1][0]] = min(low[work[-1][0]], low[u])
        if low[u] == index[u]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == u:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
for v in sorted(edges):
    if v not in index:
        strong(v)
print(json.dumps({"modules": len(edges), "cycles": out}))
"""


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """The package as the wheel lays it out, and pyproject.toml beside it."""
    root = tmp_path_factory.mktemp("layers")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "ggraph", root / "ggraph", ignore=skip)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, root / "ggraph" / folder, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def _run(staged: Path, *cmd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(staged))
    return subprocess.run(cmd, cwd=staged, env=env, capture_output=True, text=True, timeout=300)


def test_layer_contracts_hold(staged):
    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    assert os.path.exists(lint), "import-linter is not installed: bash scripts/setup.sh --test"
    r = _run(staged, lint, "--no-cache")
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_no_import_cycles(staged):
    r = _run(staged, sys.executable, "-c", CYCLES)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout)
    assert found["modules"] > 100   # the whole package was read, not only ggraph/
    assert found["cycles"] == [], found["cycles"]


# -- one device registry ------------------------------------------------------------------------

# comparisons with a device kind's name that are not about ggraph's devices: (file, why)
NOT_DEVICES = {"tools/gpu/gpu_perf.py": "torch's device strings (cpu, cuda) for its peer"}


def test_device_kinds_and_alignments_are_resolved_in_the_registry():
    """Only backends/registry.py compares a device kind's name (cpu, cuda, ray:...) or states
    a buffer alignment: everything else asks the registry."""
    import ast

    from ggraph.backends.registry import KINDS, REMOTE

    names = set(KINDS)
    bad = []
    for p in py_files():
        rel = p.relative_to(ROOT).as_posix()
        if rel == "backends/registry.py" or rel in NOT_DEVICES:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Compare):
                consts = [c.value for c in [n.left, *n.comparators]
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                for c in [c for c in [n.left, *n.comparators] if isinstance(c, ast.Tuple)]:
                    consts += [e.value for e in c.elts if isinstance(e, ast.Constant)]
                if any(c in names or str(c).startswith(REMOTE + ":") for c in consts):
                    bad.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
            elif isinstance(n, ast.Assign) and isinstance(
                    n.value, ast.Constant) and isinstance(n.value.value, int):
                for t in n.targets:   # a class's or module's alignment = 32
                    name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
                    if name.lower().endswith("alignment") and "GGUF" not in name:
                        bad.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
    assert not bad, "device kinds or alignments outside the registry:\n" + "\n".join(bad)
