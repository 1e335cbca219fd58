"""The rough edges of the hostile-input issue, round 2: each case that killed, hung or traced
back is now a one-line error or llama.cpp's behaviour. Mostly on the tiny model writers.

- mapped weights: a file truncated or changed after loading is an error before the next
  evaluation (not SIGBUS); --no-mmap reads it into memory; --mlock locks it;
- bounded work: device and host counts bounded by the layers (at once, not minutes);
  a chat template rendering more than the context holds is stopped;
- memory checked before allocating: a KV cache or compute buffer larger than the memory
  available is a one-line error naming the buffer and the sizes;
- tracebacks: non-UTF-8 stdin under -cnv, empty softmax rows, ne = [2^32, 2^32],
  build_graph(42), reading a result after the session ran another graph;
- llama.cpp's behaviour: a model without a chat template warns under -cnv; one set of
  defaults (plan and dot predict what run uses), -t 0 refused, `ggraph --version`; a full
  context shifts (or stops with --no-context-shift), an overflowing -cnv turn is refused and
  the chat goes on; compilation is counted.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import time

import numpy as np
import pytest

from ggraph import Context, build_graph, ops
from ggraph.cli import main
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import GGUFError
from ggraph.plan.host_memory import HostMemoryError



def one_line_error(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    for w in words:
        assert w in err, err
    return err


# -- mapped weights --------------------------------------------------------------------------

def test_file_truncated_after_load_is_an_error_not_sigbus(tiny, tmp_path):
    path = str(tmp_path / "t.gguf")
    shutil.copy(tiny, path)
    eng = Engine(path, EngineConfig(n_ctx=32))
    eng.eval([1, 3])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(GGUFError, match="changed after it was loaded"):
        eng.eval([4])


def test_file_rewritten_in_place_is_an_error(tiny, tmp_path):
    path = str(tmp_path / "t.gguf")
    shutil.copy(tiny, path)
    eng = Engine(path, EngineConfig(n_ctx=32))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(GGUFError, match="size .* modified at"):
        eng.eval([1])


def test_no_mmap_reads_into_memory_and_mlock(tiny, tmp_path):
    path = str(tmp_path / "t.gguf")
    shutil.copy(tiny, path)
    mapped = Engine(path, EngineConfig(n_ctx=32)).eval([1, 3, 4])
    eng = Engine(path, EngineConfig(n_ctx=32, use_mmap=False, use_mlock=True))
    assert eng.file.mapped is None and not eng.file.buffer.flags.writeable
    assert all(w.startswith("warning: failed to mlock") for w in eng.load_warnings)
    with open(path, "r+b") as f:
        f.truncate(100)   # the weights are in memory now: nothing to check, nothing to fault
    assert np.array_equal(eng.eval([1, 3, 4]), mapped)


def test_perplexity_loads_as_run_does(tiny):
    """perplexity takes --no-mmap and --mlock too, and warms up before its first chunk (whose
    time is the pass estimate), counting what it compiled."""
    from ggraph.cli import build_parser
    from ggraph.tools.perplexity import load_engine

    args = build_parser().parse_args(["perplexity", "-m", tiny, "-f", "x", "--no-mmap",
                                      "--mlock"])
    eng = load_engine(args, 32, 1)
    assert eng.file.mapped is None and eng.cfg.use_mlock and eng.cfg.warmup
    assert eng.cfg.flash_attn and eng.warmup_s > 0


# -- bounded work ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["--devices", "100000000x1GiB"], ["100000000 devices", "at most 3"]),
    (["--hosts", "100000x(100000x1GiB)"], ["100000 devices", "at most 3"]),
    (["--hosts", "4x(1GiB)"], ["4 or more devices", "at most 3"]),
    (["--devices", "9" * 40 + "x1GiB"], ["more than 10^18 devices"]),
])
def test_device_and_host_counts_are_bounded_by_the_layers(capsys, tiny, argv, words):
    t0 = time.perf_counter()
    one_line_error(capsys, ["plan", tiny, *argv], *words)   # 2 layers + the output layer
    assert time.perf_counter() - t0 < 5


def test_template_output_is_capped_by_the_context():
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
          "tokenizer.ggml.merges": ["a b"],
          "tokenizer.chat_template": "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}"}
    tok = Tokenizer(md, "evil.gguf")
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match="rendered more than 128 characters, more than the "
                                        "context holds"):
        tok.chat("hi", max_chars=tok.chars_for(64))
    assert time.perf_counter() - t0 < 2


# -- memory checked before allocating -------------------------------------------------------

def test_kv_cache_larger_than_memory_is_one_line(capsys, monkeypatch, tiny):
    monkeypatch.setattr("ggraph.plan.host_memory.available", lambda: (1 << 19, "MemAvailable"))
    with pytest.raises(HostMemoryError, match=r"failed to allocate the CPU KV cache buffer of "
                                              r"1\.00 MiB: 0\.50 MiB of memory"):
        Engine(tiny, EngineConfig(n_ctx=4096))
    one_line_error(capsys, ["run", tiny, "-c", "4096", "-n", "1"], "KV cache buffer",
                   "MiB of memory are available")
    monkeypatch.setattr("ggraph.plan.host_memory.available", lambda: (2 << 20, "RLIMIT_AS"))
    with pytest.raises(HostMemoryError, match="CPU compute buffer .* after 1.00 MiB"):
        Engine(tiny, EngineConfig(n_ctx=4096))


def test_session_refuses_a_plan_larger_than_memory(monkeypatch):
    from ggraph.backends import get_backend

    ctx = Context()
    x = ctx.new_tensor("f32", (1 << 20,), name="x").set_input()
    g = build_graph(ops.scale(x, 2.0, name="y").set_output())
    monkeypatch.setattr("ggraph.plan.host_memory.available", lambda: (1 << 20, "MemAvailable"))
    with pytest.raises(HostMemoryError, match=r"the CPU buffer of \d+\.00 MiB: 1\.00 MiB"):
        get_backend("cpu").session().run(g, {x: np.zeros(1 << 20)})


# -- tracebacks from the API -----------------------------------------------------------------

def test_api_cases_are_clear_errors():
    from ggraph.backends import get_backend

    ctx = Context()
    with pytest.raises(ValueError, match=r"tensor 'big': ne=\[4294967296, 4294967296, 1, 1\]"
                                         r" holds 18446744073709551616 elements"):
        ctx.new_tensor("f32", (1 << 32, 1 << 32), name="big")
    empty = ctx.new_tensor("f32", (0, 4), name="empty")
    for op in (ops.soft_max, ops.rms_norm, ops.norm):
        with pytest.raises(ValueError, match="rows must hold at least one value .*'empty'"):
            op(empty)
    with pytest.raises(TypeError, match="built from Tensors .* got int 42"):
        build_graph(42)
    s = get_backend("cpu").session()
    x = ctx.new_tensor("f32", (4,), name="x").set_input()
    y = ops.scale(x, 2.0, name="y").set_output()
    x2 = ctx.new_tensor("f32", (8,), name="x2").set_input()
    y2 = ops.scale(x2, 3.0, name="y2").set_output()
    s.run(build_graph(y), {x: np.ones(4)})
    s.run(build_graph(y2), {x2: np.ones(8)})
    with pytest.raises(ValueError, match="tensor 'y' .* is not in the graph this session ran "
                                         "last"):
        s.read(y)


def test_cnv_with_bytes_that_are_not_utf8(capsys, monkeypatch, tiny):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 \xff\xfe\n")))
    assert main(["run", tiny, "-cnv", "-n", "2", "-c", "64", "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # a model without a chat template says which one it falls back to
    assert "has no chat template (tokenizer.chat_template): the chat falls back to ChatML" in err


# -- one set of defaults --------------------------------------------------------------------

def test_plan_and_dot_predict_what_run_uses(capsys, tiny):
    from ggraph.cli import build_parser
    from ggraph.tools.dot import load_model, model_graph
    from ggraph.tools.run import engine_config

    args = build_parser().parse_args(["run", tiny, "-c", "512", "-ub", "64", "--no-warmup"])
    eng = Engine(tiny, engine_config(args))
    assert eng.cfg.flash_attn                       # -fa auto: on
    assert main(["plan", tiny, "-c", "512", "-ub", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["flash_attn"] and plan["compute_buffer_bytes"] == eng.reserve_plan.size
    assert plan["kv_cache_bytes"] == eng.cache.nbytes
    assert plan["n_nodes"] == eng.worst_case.graph.n_nodes
    mg = model_graph(load_model(tiny)[0], 512, 64, flash_attn=True)
    assert [n.op for n in mg.graph.nodes] == [n.op for n in eng.worst_case.graph.nodes]
    ppl = build_parser().parse_args(["perplexity", "-m", tiny, "-f", "x"])
    bench = build_parser().parse_args(["bench", "-m", tiny])
    assert ppl.fa == args.fa == "auto" and bench.flash_attn is None   # bench: DEFAULTS auto


@pytest.mark.parametrize("cmd", [["run"], ["perplexity", "-f", "x.txt"]])
@pytest.mark.parametrize("t", ["0", "-3"])
def test_threads_below_one_are_refused(capsys, tiny, cmd, t):
    one_line_error(capsys, [cmd[0], "-m", tiny, *cmd[1:], "-t", t],
                   f"-t/--threads must be >= 1, got {t}")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ggraph ")


# -- a full context ---------------------------------------------------------------------------

def test_long_generation_shifts_the_context(capsys, tiny):
    assert main(["run", tiny, "-p", "ab", "-n", "100", "-c", "32", "--temp", "0",
                 "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "exceed" not in err and "context full" not in err
    assert "eval time =" in err and "/   100 runs" in err
    assert main(["run", tiny, "-p", "ab", "-n", "100", "-c", "32", "--temp", "0",
                 "--no-warmup", "--no-context-shift"]) == 0
    assert "context full and context shift is disabled => stopping" in capsys.readouterr().err


def test_prompt_longer_than_the_context(capsys, tiny):
    one_line_error(capsys, ["run", tiny, "-p", "a b " * 100, "-c", "32", "--no-warmup"],
                   "prompt is too long (more than 28 tokens")


def test_overflowing_cnv_turn_is_refused_and_the_chat_goes_on(capsys, monkeypatch, tiny):
    turns = "hi\n" + "a b " * 60 + "\nok\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    assert main(["run", tiny, "-cnv", "-n", "3", "-c", "64", "--temp", "0",
                 "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "this turn is" in err and "the turn is skipped, the chat goes on" in err
    assert err.count("total time =") == 1   # one run, to the end
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n" * 12))
    assert main(["run", tiny, "-cnv", "-n", "3", "-c", "64", "--temp", "0", "--no-warmup",
                 "--no-context-shift"]) == 0
    assert "context shift is disabled (--no-context-shift)" in capsys.readouterr().err
    # with the shift (the default) a long chat goes on in a small context: 15 turns in 48
    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n" * 15))
    assert main(["run", tiny, "-cnv", "-n", "6", "-c", "48", "--temp", "0",
                 "--no-warmup"]) == 0
    err = capsys.readouterr().err
    assert "error" not in err and "skipped" not in err
    assert re.search(r"eval time = .* /\s+90 runs", err)


def test_compilation_is_counted():
    import numba

    from ggraph.backends.compiles import counting

    with counting() as c:
        helper = numba.njit(lambda x: x * 2)
        numba.njit(lambda x: helper(x) + 1)(1)   # not cached: compiled here, helper inside
    assert c.count >= 2 and c.kernels == 1 and c.seconds > 0
    assert [name for name, _ in c.each] == ["test_compilation_is_counted.<locals>.<lambda>"]
