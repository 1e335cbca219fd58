"""Untrusted input through the `ggraph` command (issue #13): every bad value is one line on
stderr, `ggraph <cmd>: error: ...`, a non-zero exit status and no traceback.

Cheap cases run in-process through ggraph.cli.main; the CUDA-driver cases need a process of
their own (numba.cuda decides at import whether it is the simulator). The model cases use the
default model (SmolLM2-135M, no BOS token) with tiny contexts and -n of a few tokens."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ggraph.cli import main
from ggraph.tools.common.cli_text import argv_text, error_text

DEFAULT = "default"
RUN = ["run", DEFAULT, "-n", "2", "-c", "64"]


def one_line_error(err: str, cmd: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ggraph {cmd}: error: "), lines[0]
    return lines[0]


def fails(capsys, *argv: str, rc: int = 1) -> str:
    """Run the command in-process; its one error line."""
    got = main(list(argv))
    err = capsys.readouterr().err
    assert got == rc, err
    return one_line_error(err, argv[0])


# -- 1. an empty prompt -------------------------------------------------------------------

def test_empty_prompt_without_bos(capsys):
    line = fails(capsys, "run", DEFAULT, "-p", "", "-n", "2", "-c", "64")
    assert "empty" in line and "BOS" in line and "SmolLM2-135M-Instruct" in line


def test_empty_prompt_with_bos_is_fine(tiny, capsys, monkeypatch):
    from ggraph.graphs.tokenizers import tokenizer

    path = tiny
    init = tokenizer.Tokenizer.__init__

    def with_bos(self, *a, **kw):
        init(self, *a, **kw)
        self.add_bos = True

    monkeypatch.setattr(tokenizer.Tokenizer, "__init__", with_bos)
    assert main(["run", str(path), "-p", "", "-n", "2", "-c", "64"]) == 0
    cap = capsys.readouterr()
    assert "error:" not in cap.err and re.search(r"eval time = .* /\s+2 runs", cap.err)


# -- 2. no CUDA driver ----------------------------------------------------------------------

def _env(sim: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return env


@pytest.fixture(scope="module")
def no_cuda_driver() -> None:
    probe = subprocess.run([sys.executable, "-c", "from numba import cuda; "
                            "print(cuda.is_available())"], env=_env(False),
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "False":
        pytest.skip("this machine has a CUDA GPU and driver")


def test_cuda_without_driver_is_one_line(no_cuda_driver):
    cases = {"run --backend": ["run", DEFAULT, "--backend", "cuda", "-n", "2", "-c", "64"],
             "run --devices": ["run", DEFAULT, "--devices", "cuda", "-n", "2", "-c", "64"],
             "conformance": ["conformance", "--backend", "cuda"]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "ggraph.cli", *argv],
                                    env=_env(False), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, argv in cases.items()}
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 1, (name, err)
        line = one_line_error(err, cases[name][0])
        assert "no CUDA driver found" in line and "--backend cpu" in line, line


def test_cuda_simulator_still_runs():
    r = subprocess.run([sys.executable, "-m", "ggraph.cli", "conformance", "--backend", "cuda",
                        "--op", "scale", "-q"], env=_env(True), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tests passed" in r.stdout and "error" not in r.stderr


# -- 3. numeric options ---------------------------------------------------------------------

PREFLIGHT = [  # refused before the model loads
    (RUN + ["--amb", "-5"], "--amb"),
    (RUN + ["-c", "-5"], "-c/--ctx-size"),
    (RUN + ["-c", "0"], "-c/--ctx-size"),
    (RUN + ["-ub", "-1"], "-ub/--ubatch-size"),
    (RUN + ["-n", "-3"], "-n/--n-predict"),
    (RUN + ["--devices", "cpu", "-ts", "inf"], "finite"),
    (RUN + ["--devices", "cpu", "-ts", "nan"], "finite"),
    (RUN + ["--devices", "cpu,cpu", "-ts", "1,-1"], ">= 0"),
    (RUN + ["--devices", "cpu,cpu", "-ts", "0,0"], "not all 0"),
    (RUN + ["--devices", "cpu,cpu", "-ts", "1e308,1e308"], "too large"),
    (RUN + ["--devices", "cpu,cpu", "-ts", "3,x"], "cannot read --tensor-split"),
    (["plan", "--preset", "deepseek-v2-lite", "--amb", "-5"], "--amb"),
    (["plan", "--preset", "deepseek-v2-lite", "--weights", "-3"], "--weights"),
    (["plan", "--preset", "deepseek-v2-lite", "--weights", "0"], "--weights"),
    (["plan", "--preset", "deepseek-v2-lite", "--weights", "inf"], "--weights"),
    (["plan", "--preset", "deepseek-v2-lite", "--weights", "nan"], "--weights"),
    (["plan", "--preset", "deepseek-v2-lite", "-c", "-1"], "-c/--ctx-size"),
    (["plan", "--preset", "deepseek-v2-lite", "-ub", "0"], "-ub/--ubatch-size"),
    (["plan", "--preset", "deepseek-v2-lite", "--parts", "-1"], "--parts"),
    (["plan", "--preset", "deepseek-v2-lite", "--devices", "2x24GiB", "-ts", "inf,1"], "finite"),
    (["plan", "--preset", "deepseek-v2-lite", "--devices", "2x24GiB", "-ts", "nan,1"], "finite"),
    (["plan", "--preset", "deepseek-v2-lite", "--devices", "2x24GiB", "--host-memory", "0"],
     "--host-memory"),
    (["plan", "--preset", "deepseek-v2-lite", "--devices", "2x24GiB", "--pipeline-copies", "0"],
     "--pipeline-copies"),
    (["report", "--n-head-kv", "0"], "--n-head-kv"),
    (["report", "--n-head", "0"], "--n-head"),
    (["report", "--n-head", "-4"], "--n-head"),
    (["report", "--head-dim", "0"], "--head-dim"),
    (["report", "--n-tokens", "0"], "--n-tokens"),
    (["report", "--n-kv", "0"], "--n-kv"),
    (["report", "--n-head", "32", "--n-head-kv", "5"], "multiple"),
    (["report", "--amb", "-1"], "--amb"),
    (["report", "--max-bias", "nan"], "--max-bias"),
    (["report", "--alignment", "0"], "--alignment"),
    (["report", "--top", "-1"], "--top"),
    (["dot", "--amb", "-5", "--layer", "0"], "--amb"),
    (["dot", "-c", "0"], "-c/--ctx-size"),
    (["dot", "--max-nodes", "-1"], "--max-nodes"),
    (["conformance", "--backend", ","], "names no backend"),
]


@pytest.mark.parametrize("argv,words", PREFLIGHT, ids=[" ".join(a) for a, _ in PREFLIGHT])
def test_bad_numbers(capsys, argv, words):
    assert words in fails(capsys, *argv)


def test_threads(capsys):
    import numba

    line = fails(capsys, *RUN, "-t", str(numba.config.NUMBA_NUM_THREADS + 1))
    assert "-t " in line and "NUMBA_NUM_THREADS" in line


def test_parse_split_and_size():
    from ggraph.graphs.deploy.placement import parse_size, parse_split

    assert parse_split("3,1") == [3.0, 1.0]
    for bad in ("inf", "nan,1", "1,-inf", "1e400"):
        with pytest.raises(ValueError, match="finite"):
            parse_split(bad)
    with pytest.raises(ValueError, match="too large"):
        parse_size("9" * 400 + "GiB")


# -- 4. prompt bytes that are not UTF-8 ------------------------------------------------------

def test_argv_text():
    raw = b"\xff\xfe abc \xc3\xa9"
    assert argv_text(os.fsdecode(raw)) == "\ufffd\ufffd abc \u00e9"
    assert argv_text("caf\u00e9") == "caf\u00e9"
    assert argv_text("x\ud800y") == "x\ufffd\ufffd\ufffdy"   # not from surrogateescape


def test_prompt_not_utf8(capsys):
    prompt = os.fsdecode(b"\xff\xfe abc")     # what Python makes of these argv bytes
    assert main([*RUN, "-p", prompt]) == 0
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and "error" not in cap.err
    assert cap.out.startswith("\ufffd\ufffd abc")


# -- 5. the context overflows while generating -------------------------------------------------

class _Tee:
    """sys.stdout / sys.stderr that log (stream, text) in the order written."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def write(self, s: str) -> int:
        self.log.append((self.name, s))
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_context_full_without_shift_stops_after_the_text(monkeypatch):
    """With --no-context-shift a full context ends the generation as llama-cli does: the text
    line, then "context full and context shift is disabled => stopping", then llama_perf's
    timings, in the order a terminal shows them; the exit status is 0."""
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(sys, "stdout", _Tee("out", log))
    monkeypatch.setattr(sys, "stderr", _Tee("err", log))
    prompt = "one two three four five six seven eight nine ten eleven twelve"  # 12 tokens
    rc = main(["run", DEFAULT, "-p", prompt, "-c", "16", "-n", "8", "--no-context-shift"])
    monkeypatch.undo()
    err = "".join(s for n, s in log if n == "err")
    assert rc == 0 and "Traceback" not in err and "error" not in err, err
    lines = "".join(s for _, s in log).splitlines()
    at = lines.index("context full and context shift is disabled => stopping")
    before, after = lines[:at], lines[at + 1:]
    assert any("compute buffer size" in x for x in before)
    text = [x for x in before if x.startswith(prompt)]
    assert text, "the message follows the generated text's own line"
    assert re.search(r"prompt eval time = .* /\s+12 tokens", after[-3])
    assert after[-1].startswith("llama_perf_context_print:       total time")


def test_prompt_longer_than_the_context(capsys):
    line = fails(capsys, "run", DEFAULT, "-p", "one two three four five six seven eight nine "
                 "ten eleven twelve thirteen", "-c", "16", "-n", "8")
    assert "prompt is too long (more than 12 tokens" in line


# -- 6. --check-tensors ----------------------------------------------------------------------

def test_check_tensors_reaches_the_engine(capsys, monkeypatch):
    from ggraph.graphs.runtime import engine
    seen = []

    class Stop(engine.Engine):
        def __init__(self, path, cfg, progress=False):
            seen.append(cfg)
            raise ValueError("stopped here")

    monkeypatch.setattr(engine, "Engine", Stop)
    fails(capsys, *RUN, "--check-tensors")
    fails(capsys, *RUN)
    assert [c.check_tensors for c in seen] == [True, False]


def test_check_tensors_runs(tiny, capsys):

    path = tiny
    assert main(["run", str(path), "--check-tensors", "-p", "a b", "-n", "2", "-c", "64"]) == 0
    assert "error" not in capsys.readouterr().err


# -- 7. any error escaping a subcommand: one line -------------------------------------------

def raises_multiline():
    raise ValueError("first line\n\n  second line\n:")


def raises_keyerror():
    raise KeyError("no tensor named 'x'")


def test_error_text():
    assert error_text(ValueError("a\nb\n")) == "a b"
    assert error_text(KeyError("k")) == "k"
    assert error_text(KeyError(3)) == "3"
    assert error_text(ValueError()) == "ValueError"
    assert error_text(FileNotFoundError(2, "No such file or directory", "x.gguf")) == \
        "x.gguf: No such file or directory"


def test_multiline_and_keyerror_messages(capsys):
    line = fails(capsys, "report", "--graph", "test_cli_errors:raises_multiline")
    assert line == "ggraph report: error: first line second line :"
    line = fails(capsys, "report", "--graph", "test_cli_errors:raises_keyerror")
    assert line == "ggraph report: error: no tensor named 'x'"


def test_unwritable_output(tmp_path, capsys):
    line = fails(capsys, "report", "--n-kv", "256", "--n-tokens", "16", "--json",
                 str(tmp_path))
    assert str(tmp_path) in line


def test_plan_keeps_exit_status_2(capsys):
    assert main(["plan", "--preset", "deepseek-v2-lite", "--devices", "2x1GiB"]) == 2
    cap = capsys.readouterr()
    assert "does not fit" in cap.out and not cap.err.strip()
