"""The project's own Python sources, for the tests that read them (the layer, settings and
private-name scans): the library's folders, and every file under given folders."""
from __future__ import annotations

from pathlib import Path
from paths import ROOT

# the folders that install as the ggraph package (setup.py)
LIBRARY = ("ggraph", "ops", "backends", "graphs", "tools")


def py_files(folders: tuple[str, ...] = LIBRARY) -> list[Path]:
    """Every .py file under `folders` of the repository, sorted, caches left out."""
    return sorted(p for d in folders for p in (ROOT / d).rglob("*.py")
                  if "__pycache__" not in p.parts)
