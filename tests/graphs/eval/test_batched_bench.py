"""`ggraph batched-bench` (graphs/eval/batched_bench.py, tools/batched_bench.py): the runs and
their arithmetic as llama-batched-bench does them, its jsonl records parsed, its command
line, and the CLI on a tiny model (llama.cpp's program itself where it is built)."""
from __future__ import annotations

import json
import sys

import pytest

from ggraph.cli import main
from ggraph.graphs.eval.batched_bench import (
    BatchedRow,
    batched_bench,
    cells_needed,
    find_llama_batched_bench,
    llama_cpp_command,
    llama_cpp_rows,
    parse_llama_cpp,
    runs,
)
from ggraph.graphs.runtime.engine import Engine, EngineConfig


def test_cells_and_order_as_llama_batched_bench():
    assert cells_needed(128, 64, 4, pps=False) == 4 * 192
    assert cells_needed(128, 64, 4, pps=True) == 128 + 4 * 64
    assert cells_needed(128, 64, 4, pps=True, unified=False) == 4 * 128 + 4 * 64
    assert runs([1, 2], [3], [4, 5]) == [(1, 3, 4), (1, 3, 5), (2, 3, 4), (2, 3, 5)]


def test_rows_on_a_tiny_model(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=128, n_seq_max=4))
    rows = batched_bench(eng, [8], [4], [1, 2, 4], warmup=False)
    assert [(r.pl, r.n_kv) for r in rows] == [(1, 12), (2, 24), (4, 48)]
    for r in rows:
        assert r.s_pp == pytest.approx(r.pl * r.pp / r.t_pp)
        assert r.s_tg == pytest.approx(r.pl * r.tg / r.t_tg)
        assert r.t == pytest.approx(r.t_pp + r.t_tg)
        assert r.s == pytest.approx(r.n_kv / r.t)
    shared = batched_bench(eng, [8], [4], [4], pps=True)
    assert shared[0].n_kv == 8 + 16 and shared[0].s_pp == pytest.approx(8 / shared[0].t_pp)
    assert eng.cache.cells.used == 0


def test_runs_that_do_not_fit_are_left_out_and_too_many_sequences_refused(tiny):
    eng = Engine(tiny, EngineConfig(n_ctx=64, n_seq_max=4))
    assert [r.pl for r in batched_bench(eng, [16], [4], [1, 2, 4], warmup=False)] == [1, 2]
    with pytest.raises(ValueError, match="-npl 8 needs a cache of 8 sequences"):
        batched_bench(eng, [8], [4], [8])


def test_llama_cpp_records_and_command():
    text = ("main: n_kv_max = 4096 ...\n"
            '{"n_kv_max": 4096, "n_batch": 2048, "pp": 128, "tg": 64, "pl": 2, "n_kv": 384, '
            '"t_pp": 0.5, "speed_pp": 512.0, "t_tg": 2.0, "speed_tg": 64.0, "t": 2.5, '
            '"speed": 153.6}\nllama_perf_context_print: ...\n')
    assert parse_llama_cpp(text) == [BatchedRow(128, 64, 2, 384, 0.5, 512.0, 2.0, 64.0, 2.5,
                                                153.6)]
    fast = text.replace('"t_tg": 2.0, "speed_tg": 64.0', '"t_tg": 0.000000, "speed_tg": inf')
    assert parse_llama_cpp(fast)[0].s_tg == float("inf")
    cmd = llama_cpp_command("/bin/llama-batched-bench", "m.gguf", [128], [64], [1, 2], 4096,
                            2, False, True, False, True, 2048, 512)
    assert cmd[:9] == ["/bin/llama-batched-bench", "-m", "m.gguf", "-npp", "128", "-ntg", "64",
                       "-npl", "1,2"]
    assert {"-kvu", "-pps", "--output-format", "jsonl"} <= set(cmd) and "-tgs" not in cmd


_RECORD = ('{"n_kv_max": 64, "n_batch": 2048, "pp": 8, "tg": 2, "pl": %d, "n_kv": 20, '
           '"t_pp": 0.1, "speed_pp": 80.0, "t_tg": 0.1, "speed_tg": 20.0, "t": 0.2, '
           '"speed": 50.0}')


def _fake_program(tmp_path, outputs: list[int]) -> list[str]:
    """A stand-in for llama-batched-bench that prints outputs[i] records on its i-th run (the
    last count once they run out), as the real one prints fewer when its log thread loses
    the end of a short run."""
    script = tmp_path / "fake_bb.py"
    script.write_text(
        "import pathlib, sys\n"
        f"n_file = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "i = int(n_file.read_text()) if n_file.exists() else 0\n"
        "n_file.write_text(str(i + 1))\n"
        f"counts = {outputs!r}\n"
        "print('main: n_kv_max = 64')\n"
        "for pl in range(1, counts[min(i, len(counts) - 1)] + 1):\n"
        f"    print({_RECORD!r} % pl)\n")
    return [sys.executable, str(script)]


def test_llama_cpp_rows_runs_again_when_records_are_missing(tmp_path):
    rows = llama_cpp_rows(_fake_program(tmp_path, [1, 2]), expect=2)
    assert [r.pl for r in rows] == [1, 2] and (tmp_path / "runs").read_text() == "2"
    (tmp_path / "runs").unlink()
    with pytest.raises(RuntimeError, match="printed 1 of its 2 records in each of 3 runs"):
        llama_cpp_rows(_fake_program(tmp_path, [1]), expect=2)
    assert (tmp_path / "runs").read_text() == "3"


def test_a_missing_program_says_how_to_build_it(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setenv("GGRAPH_LLAMA_BIN", "/nonexistent")
    with pytest.raises(FileNotFoundError, match="llamacpp-tools.sh"):
        find_llama_batched_bench("/nonexistent/llama-batched-bench")


def test_cli_table_and_json(tiny, tmp_path, capsys):
    out = tmp_path / "bb.json"
    vs = []
    try:
        find_llama_batched_bench()
        vs = ["--vs", "llama.cpp"]
    except FileNotFoundError:
        pass
    rc = main(["batched-bench", "-m", tiny, "-npp", "8", "-ntg", "2", "-npl", "1,2", "-c",
               "64", "-t", "1", "-fa", "off", "--json", str(out)] + vs)
    cap = capsys.readouterr()
    text = cap.out
    assert rc == 0, cap.err[-2000:]
    assert "|    PP |     TG |    B |   N_KV |" in text and "cpu: " in text
    rec = json.loads(out.read_text())
    assert [r["pl"] for r in rec["ggraph"]] == [1, 2]
    if vs:   # llama.cpp's program ran the same runs
        assert [r["pl"] for r in rec["llama.cpp"]] == [1, 2] and "ggraph / llama.cpp" in text
    assert main(["batched-bench", "-m", tiny, "-npl", "0"]) == 1
    assert "-npl values must be >= 1" in capsys.readouterr().err
