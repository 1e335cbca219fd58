"""`ggraph bench` (tools/bench.py) and its measuring library (graphs/eval/bench.py) on the tiny
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
from ggraph.graphs.eval import bench



def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """ggraph bench's exit code and output; without the bandwidth measurement (1 GiB read a
    few times) unless a test asks for it with --bandwidth."""
    argv = tuple(a for a in argv if a != "--bandwidth") if "--bandwidth" in argv else \
        argv + ("--no-bandwidth",)
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


def test_expand_depth_and_ngl_in_llama_bench_order():
    tests = bench.expand(["a"], n_prompt=[16], n_gen=[4], n_threads=[1, 2], n_depth=[0, 32],
                         n_gpu_layers=[0, 1], devices="cpu")
    # ngl varies slowest among the settings, the depth fastest (llama-bench's loops)
    assert [(t.n_gpu_layers, t.n_threads, t.n_depth, t.name) for t in tests[:6]] == [
        (0, 1, 0, "pp16"), (0, 1, 0, "tg4"), (0, 1, 32, "pp16 @ d32"),
        (0, 1, 32, "tg4 @ d32"), (0, 2, 0, "pp16"), (0, 2, 0, "tg4")]
    assert {t.n_gpu_layers for t in tests[8:]} == {1} and len(tests) == 16
    assert tests[2].n_ctx == 48 and tests[2].n_tokens == 16   # the depth is not counted
    assert all(t.devices == "cpu" for t in tests)
    assert bench.BenchTest(model="a", n_prompt=8, n_gen=2, n_depth=4).name == "pp8+tg2 @ d4"
    with pytest.raises(ValueError, match="needs offload devices"):
        bench.BenchTest(model="a", n_gen=1, n_gpu_layers=3)
    with pytest.raises(ValueError, match="n_depth"):
        bench.BenchTest(model="a", n_gen=1, n_depth=-1)


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


def spy(monkeypatch, cls, calls: list) -> None:
    """Record every eval (cache length before it, tokens) and cut (length before, n) of a
    Bencher class."""
    length = {bench.GgraphBencher: lambda b: b.eng.cache.n_used,
              bench.LlamaCppBencher: lambda b: b.llm.n_tokens}[cls]
    ev, cut = cls.eval, cls.cut

    def eval_(self, toks):
        calls.append(("eval", length(self), len(toks)))
        ev(self, toks)

    def cut_(self, n):
        calls.append(("cut", length(self), n))
        return cut(self, n)

    monkeypatch.setattr(cls, "eval", eval_)
    monkeypatch.setattr(cls, "cut", cut_)


def test_depth_prefix_is_evaluated_once_and_cut_back(tiny, monkeypatch):
    calls: list = []
    spy(monkeypatch, bench.GgraphBencher, calls)
    lines: list[str] = []
    t = bench.BenchTest(model=tiny, n_prompt=4, n_depth=8, n_batch=5, n_ubatch=4)
    (r,) = bench.run_test(t, reps=3, progress=lines.append)
    assert t.n_ctx == 12 and len(r.samples_ns) == 3
    # the prefix from an empty cache in n_batch pieces, once; then the warmup (twice: the
    # second run of a graph lays its calls out) and every repetition start from the cache
    # cut back to 8 tokens
    assert calls[:2] == [("eval", 0, 5), ("eval", 5, 3)]
    assert calls[2:] == [("cut", 8, 8), ("eval", 8, 4)] + [("cut", 12, 8), ("eval", 8, 4)] * 4
    assert lines and lines[-1].startswith("depth 8/8 tokens on ggraph")
    rec = r.record(bench.machine_info())
    assert rec["test"] == "pp4 @ d8" and rec["n_depth"] == 8 and rec["n_prompt"] == 4
    assert rec["samples_ts"] == pytest.approx([4e9 / ns for ns in r.samples_ns])


def test_depth_on_a_sliding_window_cache_refills_when_the_ring_lost_it(tmp_path, monkeypatch):
    from ggraph.graphs.testing.tiny_gemma3 import write_tiny_gguf as write_gemma3

    path = write_gemma3(tmp_path / "g3.gguf", n_swa=16)
    calls: list = []
    spy(monkeypatch, bench.GgraphBencher, calls)
    # ring: pad256(16 + 64) = 256 cells; 300 tokens after a depth of 20 overwrite its window
    t = bench.BenchTest(model=path, n_prompt=300, n_depth=20, n_batch=300, n_ubatch=64)
    (r,) = bench.run_test(t, reps=2, warmup=False)
    assert len(r.samples_ns) == 2
    # the first sample starts on the fresh prefix; the second one's cut is refused, so the
    # prefix is evaluated again from an empty cache before it
    assert calls == [("eval", 0, 20), ("cut", 20, 20), ("eval", 20, 300),
                     ("cut", 320, 20), ("eval", 0, 20), ("eval", 20, 300)]


def test_ngl_with_a_cpu_standing_in_for_a_device(capsys, tiny):
    # llama.cpp's rule on 2 layers: -ngl 1 offloads the last one, -ngl 3 the output too
    for ngl, layers, output in ((1, (1, 0), 1), (2, (0, 0), 1), (3, (0, 0), 0)):
        b = bench.GgraphBencher(bench.BenchTest(model=tiny, n_gen=2, n_gpu_layers=ngl,
                                                devices="cpu"))
        assert (b.eng.layers.layers, b.eng.layers.output) == (layers, output)
    assert b.devices == "CPU1/CPU" and b.backend == "CPU"
    rc, out, err = cli(capsys, "-m", tiny, "-p", "6", "-n", "2", "-r", "1", "-t", "1",
                       "-ngl", "0,3", "-dev", "cpu", "-d", "0,4", "-oe", "json")
    assert rc == 0
    head, _, *body = md_rows(out)
    assert head[4:7] == ["threads", "ngl", "dev"]
    assert [(r[5], r[6], r[head.index("test")]) for r in body] == [
        (n, "CPU1/CPU", name) for n in ("0", "3") for name in ("pp6", "tg2", "pp6 @ d4",
                                                               "tg2 @ d4")]
    recs = json.loads(err)
    assert [(r["n_gpu_layers"], r["n_depth"]) for r in recs] == [
        (n, d) for n in (0, 3) for d in (0, 0, 4, 4)]
    assert all(r["devices"] == "CPU1/CPU" and r["backends"] == "CPU" for r in recs)


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
    (["-d", "-1"], "-d/--n-depth must be >= 0"),
    (["-d", "x"], "-d/--n-depth: 'x' is not an integer"),
    (["-ngl", "-2"], "-ngl/--n-gpu-layers must be >= -1"),
    (["-ngl", "0,2"], "-ngl/--n-gpu-layers 2 needs offload devices: give -dev/--devices"),
    (["-ngl", "1", "-dev", "24GiB"], "-dev/--devices '24GiB': benchmarks need backends"),
    (["-dev", "tpu"], "-dev/--devices: device list entry 'tpu'"),
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


def test_vs_llama_cpp_at_depth(capsys, tiny, monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp",
                                    reason="--vs llama.cpp measures llama-cpp-python")
    calls: list = []
    spy(monkeypatch, bench.LlamaCppBencher, calls)
    kept: list[int] = []
    cut = bench.LlamaCppBencher.cut

    def cut_and_look(self, n):   # the cells past the depth have really left the cache
        ok = cut(self, n)
        kept.append(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.llm.ctx), 0))
        return ok

    monkeypatch.setattr(bench.LlamaCppBencher, "cut", cut_and_look)
    rc, out, err = cli(capsys, "-m", tiny, "-p", "4", "-n", "2", "-d", "6", "-r", "2", "-t", "1",
                       "-b", "4", "-ngl", "0", "--vs", "llama.cpp", "-fa", "0,1", "-o", "json")
    assert rc == 0
    recs = json.loads(out)
    assert [(r["engine"], r["test"], r["flash_attn"]) for r in recs] == [
        (e, name, fa) for fa in (False, True) for name in ("pp4 @ d6", "tg2 @ d6")
        for e in ("ggraph", "llama.cpp")]
    assert all(r["n_depth"] == 6 and r["n_gpu_layers"] == 0 and len(r["samples_ns"]) == 2
               for r in recs)
    assert {r["devices"] for r in recs if r["engine"] == "llama.cpp"} == {"CPU"}
    # per test: the prefix once (n_batch pieces from empty), the warmup and each sample
    # from the cache cut back to 6 tokens
    pp = [("eval", 0, 4), ("eval", 4, 2), ("cut", 6, 6), ("eval", 6, 4),
          ("cut", 10, 6), ("eval", 6, 4), ("cut", 10, 6), ("eval", 6, 4)]
    assert calls[:len(pp)] == pp
    assert kept and set(kept) == {5}


def test_no_bandwidth_footer_without_a_reading(capsys, tiny):
    """--no-bandwidth (the helper's default here): no bw% column and no footer line about a
    bandwidth that was never read."""
    rc, out, _ = cli(capsys, "-m", tiny, "-p", "0", "-n", "3", "-r", "1", "-o", "md")
    assert rc == 0
    assert "bw%" not in out and "read bandwidth" not in out


def test_bandwidth_share_of_generation(capsys, tiny, monkeypatch):
    """bw%: the weights a token reads times tokens/s over the read bandwidth measured just
    before and just after the sample (here stand-in figures: the higher one is taken), for
    generation tests only; prompt tests read none."""
    from ggraph.backends.cpu import membw

    reads: list[tuple[int, int]] = []

    def fake(n: int, runs: int = 5) -> float:
        reads.append((n, runs))
        return 10.0 * n + (2.0 if len(reads) % 2 == 0 else 0.0)   # after > before

    monkeypatch.setattr(membw, "read_bandwidth", fake)
    rc, out, _ = cli(capsys, "-m", tiny, "-p", "8", "-n", "3", "-r", "1", "-t", "1,2",
                     "--bandwidth", "-o", "json")
    assert rc == 0
    recs = json.loads(out)
    info = bench.model_info(tiny)
    assert info.token_bytes == info.size   # tied output: the embeddings are read in full
    assert reads == [(1, 3), (1, 3), (2, 3), (2, 3)]   # around each generation test only
    for r in recs:
        if r["n_prompt"]:
            assert r["bw_share"] is None and r["read_gbs"] is None
        else:
            assert r["read_gbs"] == 10.0 * r["n_threads"] + 2.0
            assert r["bw_share"] == pytest.approx(
                r["weights_per_token"] * r["avg_ts"] / (r["read_gbs"] * 1e9))


def test_each_sample_is_set_beside_its_own_reads(capsys, tiny, monkeypatch):
    """With several repetitions the bandwidth is read before the first sample and after each
    one; a sample's share is over the higher of the two reads beside it, bw% is the median
    of the samples' shares, and read_gbs the median of the samples' reads (a shared host's
    bandwidth moves between spells within seconds)."""
    from ggraph.backends.cpu import membw

    figures = iter([30.0, 60.0, 20.0, 25.0, 40.0])   # before sample 1, after 1, 2, 3, 4
    reads: list[int] = []

    def fake(n: int, runs: int = 5) -> float:
        reads.append(n)
        return next(figures)

    monkeypatch.setattr(membw, "read_bandwidth", fake)
    rc, out, _ = cli(capsys, "-m", tiny, "-p", "0", "-n", "3", "-r", "4", "-t", "1",
                     "--bandwidth", "-o", "json")
    assert rc == 0 and reads == [1] * 5
    (r,) = json.loads(out)
    assert r["sample_reads_gbs"] == [60.0, 60.0, 25.0, 40.0]
    assert r["read_gbs"] == 50.0
    shares = sorted(r["weights_per_token"] * ts / (g * 1e9)
                    for ts, g in zip(r["samples_ts"], r["sample_reads_gbs"]))
    assert r["bw_share"] == pytest.approx((shares[1] + shares[2]) / 2)
