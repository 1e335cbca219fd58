"""A wheel, not the editable checkout: build it, install it without -e into a fresh virtual
environment, import every module it ships, and run a few ops' CPU conformance cases and a
model's memory plan from outside the source tree. (An editable install hides a package the
wheel forgets: backends/cpu was once missing.) The kernels compile afresh there (numba's cache
is keyed by source path), so the compiled part is two cheap ops: the whole table compiled twice
was 3 of CI's minutes, and the default model's kernels 1.5 more; importing every module catches
a missing file, and `ggraph plan default` reads the GGUF and builds the model's graph."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from paths import ROOT



def _run(argv: list, cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, argv))}: exit {r.returncode}\n" \
                              f"{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r.stdout + r.stderr  # ggraph run: text on stdout, llama.cpp-style logs on stderr


def test_wheel_ships_every_package_and_runs(tmp_path):
    wheels = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(wheels), str(ROOT)], tmp_path)
    (whl,) = wheels.glob("ggraph-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    source_pkgs = {str(p.parent.relative_to(ROOT)) for top in ("ggraph", "ops", "backends",
                                                              "graphs", "tools")
                   for p in (ROOT / top).rglob("__init__.py")}
    for pkg in source_pkgs:
        top, _, rest = pkg.partition("/")
        inside = "ggraph" if top == "ggraph" else f"ggraph/{top}"
        want = f"{inside}/{rest}/__init__.py" if rest else f"{inside}/__init__.py"
        assert want in names, f"the wheel lacks {want} (from {pkg}/)"
    # a fresh environment; the dependencies come from this interpreter's site-packages, ggraph
    # from the wheel alone (checked below by where it is imported from)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], tmp_path)
    py, ggraph = venv / "bin" / "python", venv / "bin" / "ggraph"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", str(whl)], tmp_path)
    where = _run([py, "-c", "import ggraph.backends.cpu as m; print(m.__file__)"], tmp_path)
    assert where.startswith(str(venv)), where
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba_cache")}
    out = _run([ggraph, "conformance", "--backend", "cpu", "--op", "rms_norm,soft_max", "-q"],
               tmp_path, env)
    assert "tests passed" in out and "failed" not in out.lower(), out[-1000:]
    # every module the wheel ships imports from it (a module importing a file the wheel lacks
    # fails here, though nothing above would call it)
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names
                     if n.endswith(".py"))
    code = "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]; print('ok')"
    assert _run([py, "-c", code, *modules], tmp_path, env).strip().endswith("ok")
    out = _run([ggraph, "plan", "default", "-c", "512"], tmp_path, env)
    assert "llama_kv_cache: size =" in out and "compute buffer" in out, out[-1000:]


def test_numba_cache_outside_the_source_tree_even_when_numba_came_first(tmp_path):
    """A script that imports numba before ggraph still caches kernels under GGRAPH_CACHE (or
    ~/.cache/ggraph), never beside the sources (numba's default: a __pycache__ next to them)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["GGRAPH_CACHE"] = str(tmp_path / "gg")
    code = ("import numba, numba.core.config as c; import ggraph; "
            "print(c.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(tmp_path / "gg" / "numba")
