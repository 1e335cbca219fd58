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

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"ops": "ops", "backends": "backends", "graphs": "graphs", "tools": "tools"}

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
    for sub, folder in FOLDERS.items():
        shutil.copytree(ROOT / folder, root / "ggraph" / sub, ignore=skip)
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
