"""`ggraph bench` (tools/bench.py) and its measuring library (graphs/bench.py) on the tiny
random model: the tests the options make, the result records and their statistics, every
output format, and the errors for bad values. No speed thresholds: speed is the benchmark's
business, not the tests'."""
from __future__ import annotations

import csv
import io
import json
import math
import statistics

import pytest

from ggraph.cli import main
from ggraph.graphs import bench
from ggraph.graphs.tiny import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf")


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_stddev_is_the_sample_stddev():
    v = [3.0, 5.0, 10.0, 2.5]
    assert bench.mean(v) == pytest.approx(statistics.fmean(v))
    assert bench.stddev(v) == pytest.approx(statistics.stdev(v))   # n - 1, as llama-bench
    assert bench.stddev([7.0]) == 0.0 and bench.stddev([]) == 0.0


def test_expand_is_the_cartesian_product_in_llama_bench_order():
    tests = bench.expand(["a", "b"], n_prompt=[16, 0], n_gen=[4], n_pg=[(8, 2)],
                         n_batch=[64], n_ubatch=[8, 16], type_k=["f16", "q8_0"],
                         flash_attn=[False, True], n_threads=[1, 2])
    # per model 2 ubatch x 2 type_k x 2 fa x 2 threads combinations, 3 tests each (pp0 skipped)
    assert len(tests) == 2 * 16 * 3
    assert len(set(tests)) == len(tests)
    assert [t.name for t in tests[:3]] == ["pp16", "tg4", "pp8+tg2"]
    # threads vary fastest among the settings, the model slowest
    assert [t.n_threads for t in tests[:6]] == [1, 1, 1, 2, 2, 2]
    assert tests[6].flash_attn and tests[0].model == "a" and tests[-1].model == "b"
    assert {(t.n_ubatch, t.type_k, t.flash_attn, t.n_threads) for t in tests} == {
        (u, k, f, n) for u in (8, 16) for k in ("f16", "q8_0") for f in (False, True)
        for n in (1, 2)}
    assert tests[2].n_tokens == tests[2].n_ctx == 10


def test_run_test_results(tiny):
    t = bench.BenchTest(model=tiny, n_prompt=12, n_batch=5, n_ubatch=4, n_threads=1)
    (r,) = bench.run_test(t, reps=3)
    assert r.engine == "ggraph" and r.test is t and len(r.samples_ns) == 3
    assert all(ns > 0 for ns in r.samples_ns)
    ts = [12 * 1e9 / ns for ns in r.samples_ns]
    assert r.samples_ts == pytest.approx(ts)
    assert r.avg_ts == pytest.approx(statistics.fmean(ts))
    assert r.stddev_ts == pytest.approx(statistics.stdev(ts))
    assert r.model.n_params > 0 and r.model.size > 0 and r.model.model_type.startswith("llama")
    rec = r.record(bench.machine_info())
    assert rec["test"] == "pp12" and rec["n_prompt"] == 12 and rec["n_gen"] == 0
    assert rec["avg_ns"] == round(statistics.fmean(r.samples_ns))
    assert len(rec["load_avg"]) == 3


def test_run_test_rejects_bad_values(tiny):
    t = bench.BenchTest(model=tiny, n_gen=2)
    with pytest.raises(ValueError, match="repetitions"):
        bench.run_test(t, reps=0)
    with pytest.raises(ValueError, match="unknown peer"):
        bench.run_test(t, peers=["vllm"])
    with pytest.raises(ValueError, match="evaluates tokens"):
        bench.BenchTest(model=tiny)
    with pytest.raises(ValueError, match="n_threads"):
        bench.BenchTest(model=tiny, n_gen=1, n_threads=0)


def test_file_type_names_and_machine():
    assert bench.file_type_name(3) == "Q4_1"
    assert bench.file_type_name(15) == "Q4_K - Medium"
    assert bench.file_type_name(0) == "all F32"
    assert bench.file_type_name(None) == "?"
    m = bench.machine_info()
    assert m.n_cpus >= 1 and "AVX-512" in m.line and "AMX" in m.line


def md_rows(out: str) -> list[list[str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]


def test_markdown_table(capsys, tiny):
    rc, out, _ = cli(capsys, "-m", tiny, "-p", "8", "-n", "3", "-r", "2", "-t", "1",
                     "-ub", "4,8")
    assert rc == 0
    rows = md_rows(out)
    head = rows[0]
    assert head[:5] == ["model", "size", "params", "backend", "threads"]
    assert head[-2:] == ["test", "t/s"] and "n_ubatch" in head   # a varied setting shows
    assert "fa" not in head and "type_k" not in head              # defaults do not
    body = rows[2:]
    assert [r[head.index("test")] for r in body] == ["pp8", "tg3", "pp8", "tg3"]
    assert [r[head.index("n_ubatch")] for r in body] == ["4", "4", "8", "8"]
    for r in body:
        mean, sd = r[-1].split(" ± ")
        assert float(mean) > 0 and float(sd) >= 0
    assert "cpu: " in out and "load average" in out


def test_csv_and_json_formats_parse(capsys, tiny):
    args = ["-m", tiny, "-p", "6", "-n", "2", "-r", "2", "-t", "1", "-fa", "0,1"]
    rc, out, _ = cli(capsys, *args, "-o", "csv")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["test"], r["flash_attn"]) for r in rows] == [
        ("pp6", "False"), ("tg2", "False"), ("pp6", "True"), ("tg2", "True")]
    assert all(float(r["avg_ts"]) > 0 and r["engine"] == "ggraph" for r in rows)
    assert all(len(r["load_avg"].split()) == 3 and r["cpu_info"] for r in rows)

    rc, out, err = cli(capsys, *args, "-o", "json", "-oe", "jsonl")
    recs = json.loads(out)
    lines = [json.loads(ln) for ln in err.splitlines() if ln.strip()]
    assert len(recs) == len(lines) == 4
    for rec in recs:
        ts = [(rec["n_prompt"] + rec["n_gen"]) * 1e9 / ns for ns in rec["samples_ns"]]
        assert rec["samples_ts"] == pytest.approx(ts)
        assert rec["avg_ts"] == pytest.approx(statistics.fmean(ts))
        assert rec["stddev_ts"] == pytest.approx(statistics.stdev(ts))
        assert math.isfinite(rec["avg_ts"])
    assert [r["test"] for r in lines] == [r["test"] for r in recs]


@pytest.mark.parametrize("argv, msg", [
    (["-p", "x"], "-p/--n-prompt: 'x' is not an integer"),
    (["-p", "-3"], "-p/--n-prompt must be >= 0"),
    (["-t", "0"], "-t/--threads must be >= 1"),
    (["-ub", "0"], "-ub/--ubatch-size must be >= 1"),
    (["-ctk", "q9_9"], "-ctk/--cache-type-k: unknown type"),
    (["-fa", "maybe"], "-fa/--flash-attn: 'maybe' is not 0/1"),
    (["-pg", "5"], "-pg: '5' is not PP,TG"),
    (["-r", "0"], "-r/--repetitions must be >= 1"),
    (["-p", "0", "-n", "0"], "no tests"),
])
def test_bad_values_are_one_line_errors(capsys, tiny, argv, msg):
    rc, out, err = cli(capsys, "-m", tiny, *argv)
    assert rc == 1 and out == ""
    assert err.startswith("ggraph bench: error: ") and msg in err and err.count("\n") == 1


def test_bad_choices_and_models(capsys, tiny):
    with pytest.raises(SystemExit):
        main(["bench", "-m", tiny, "-o", "xml"])
    with pytest.raises(SystemExit):
        main(["bench", "-m", tiny, "--vs", "vllm"])
    capsys.readouterr()
    rc, _, err = cli(capsys, "-m", tiny + ".missing", "-p", "4", "-n", "0")
    assert rc == 1 and "no such GGUF file or model name" in err


def test_vs_llama_cpp(capsys, tiny):
    pytest.importorskip("llama_cpp", reason="--vs llama.cpp measures llama-cpp-python")
    rc, out, err = cli(capsys, "-m", tiny, "-p", "8", "-n", "2", "-r", "2", "-t", "1",
                       "--vs", "llama.cpp", "-oe", "json")
    assert rc == 0
    head, *_, last = md_rows(out)
    assert head[-3:] == ["ggraph t/s", "llama.cpp t/s", "ggraph/llama.cpp"]
    recs = json.loads(err)
    assert [(r["engine"], r["test"]) for r in recs] == [
        ("ggraph", "pp8"), ("llama.cpp", "pp8"), ("ggraph", "tg2"), ("llama.cpp", "tg2")]
    g, peer = recs[2], recs[3]
    assert g["ratio_vs_llama_cpp"] == pytest.approx(g["avg_ts"] / peer["avg_ts"])
    assert float(last[-1]) == pytest.approx(g["avg_ts"] / peer["avg_ts"], abs=0.006)
    assert len(peer["samples_ns"]) == 2
