"""docs/server.md's examples run against a live `ggraph serve`: each curl line of its ```bash
blocks (the `ggraph serve` and `pip` lines excepted) must answer JSON or server-sent events
ending with [DONE], and its ```py blocks run with the `openai` package, the port swapped for
the test server's."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import pytest

from paths import ROOT
from serve_client import start

pytest.importorskip("openai", reason="the test extra installs openai")
PAGE = ROOT / "docs" / "server.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(PAGE.read_text()) if m.group(1) == lang]


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    srv = start("-c", "512", tmp=tmp_path_factory.mktemp("serve-docs"))
    yield srv.port
    assert srv.stop() == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples(port):
    cmds = []
    for code in blocks("bash"):
        for cmd in code.replace("\\\n", " ").splitlines():
            if cmd.startswith("curl"):
                cmds.append(cmd.replace("8080", str(port)))
    assert len(cmds) >= 4
    for cmd in cmds:
        r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)
        out = r.stdout.strip()
        if out.startswith("data: "):
            events = [x[6:] for x in out.splitlines() if x.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"], cmd
        else:
            body = json.loads(out)
            assert "error" not in body, (cmd, body)


def test_python_examples(port, capsys):
    code = blocks("py")
    assert code
    ns: dict = {}
    for c in code:
        exec(compile(c.replace("8080", str(port)), "docs/server.md", "exec"), ns)
    out = capsys.readouterr().out
    assert "prompt_tokens" in out and len(out.splitlines()) >= 2
