"""The documentation runs: every ```python block of each page in docs/ (and of README.md) is
executed, in order, in one namespace per page, in a scratch directory; a broken example fails
with its page, block number and line. In ```sh blocks, each `ggraph ...` line runs through the
CLI in-process and must exit 0 (a picture command without Graphviz's `dot` must instead give
the install hint), and each `bash scripts/X.sh` or `python scripts/X.py` line must name a script
that exists (setting up and running the whole suite from inside it would recurse; a fuzz run
takes minutes).
"""
from __future__ import annotations

import linecache
import re
import shlex
import shutil
import traceback
from pathlib import Path

import pytest
from paths import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXPECTED = {"index.md", "getting-started.md", "tutorial.md", "memory-planning.md",
            "conformance.md", "writing-ops.md", "writing-builders.md", "untrusted-files.md",
            "architectures.md", "performance.md", "sequences.md", "server.md", "grammar.md",
            "making-ggufs.md", "training.md"}


def blocks(page: Path, lang: str) -> list[tuple[int, str]]:
    """(line number, code) of each fenced block in `lang`."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text)
            if m.group(1) == lang]


def test_every_page_is_there_and_linked():
    have = {p.name for p in PAGES if p.parent.name == "docs"}
    assert EXPECTED <= have, f"missing pages: {EXPECTED - have}"
    index = (ROOT / "docs" / "index.md").read_text()
    for name in EXPECTED - {"index.md"}:
        assert f"({name})" in index, f"index.md does not link {name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # examples write their pictures and files here
    ns: dict = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for i, (line, code) in enumerate(blocks(page, "python"), 1):
        name = f"{page.name}:block{i}(line {line})"
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)  # in tracebacks
        try:
            exec(compile(code, name, "exec", dont_inherit=True), ns)  # no __future__ of ours
        except Exception:  # noqa: BLE001 - report the page, block and line, then fail
            pytest.fail(f"{page.relative_to(ROOT)} python block {i} (line {line}) failed:\n"
                        f"{traceback.format_exc(limit=-3)}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_shell_blocks_run(page, tmp_path, monkeypatch, capsys):
    from ggraph.cli import main

    monkeypatch.chdir(tmp_path)
    for line, code in blocks(page, "sh"):
        for cmd in code.splitlines():
            cmd = cmd.split(" #", 1)[0].strip()
            argv = shlex.split(cmd)
            if not argv:
                continue
            where = f"{page.name} line {line}: {cmd}"
            if argv[0] in ("bash", "python"):  # long scripts: they must exist
                assert (ROOT / argv[1]).is_file(), f"{where}: no such script"
                continue
            assert argv[0] == "ggraph", f"{where}: only ggraph and bash lines are allowed"
            rc = main(argv[1:])
            err = capsys.readouterr().err
            renders = any(a.endswith((".svg", ".png", ".pdf")) for a in argv)
            if renders and shutil.which("dot") is None:
                assert rc == 1 and "apt-get install graphviz" in err, where
                continue
            assert rc == 0, f"{where}: exit status {rc}\n{err[-2000:]}"


def test_architecture_and_type_tables_match_the_registries():
    """docs/architectures.md marks **yes** exactly what ggraph registers: architectures (by
    `general.architecture`) and tensor types, with each type's weight and KV roles."""
    from ggraph.graphs.models.arch import discover_architectures
    from ggraph.ir.types import TYPE_RECORDS

    text = (ROOT / "docs" / "architectures.md").read_text()
    archs, types = text.split("## Tensor types")
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in archs.splitlines() if ln.startswith("| ")]
    yes = {name.strip() for r in rows if r[1] == "**yes**" for name in r[0].split(",")}
    assert yes == set(discover_architectures())
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in types.splitlines() if ln.startswith("| ") and "**yes**" in ln]
    listed = {}
    for r in rows:
        for name in r[0].split(","):
            listed[name.strip()] = (r[4] == "yes", r[5] == "yes")
    have = {str(t): (rec.weight, rec.kv) for t, rec in TYPE_RECORDS.items()}
    assert listed == have
