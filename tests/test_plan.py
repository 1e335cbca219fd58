"""`ggraph plan`: DeepSeek2 memory planning without weights.

The seed's numbers for DeepSeek-V3/R1 (facts page sections 6-7): at ctx 163000 and ubatch 512
the unsplit K*Q is 40,750 MiB and `--amb 2048` needs 20 steps (built as 19 groups of <= 7
heads); at ubatch 1 it is about 79 MiB and unsplit; the MLA cache at 163,840 cells; the compute
buffer with `--amb 2048` is the 2,228.5 MiB K*Q of one 7-head group plus named smaller parts.
Planning the full-size model takes seconds and allocates no tensor memory: the wall time and
RSS growth of these plans are measured by benchmarks/bench_plan.py, not asserted here, where
a busy shared machine would fail them.
"""
from __future__ import annotations

import json

import pytest
from ggraph.graphs.presets import bytes_per_weight, header_model, plan_deepseek2, preset_model
from ggraph.graphs.tiny_deepseek2 import write_tiny_deepseek2

from ggraph.cli import main
from ggraph.types import MIB

GIB = 1 << 30


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_numbers_ubatch_512(capsys):
    r = _plan_json(capsys, "--preset", "deepseek-v3", "-c", "163000", "-ub", "512",
                   "--amb", "2048")
    assert r["kq_all_heads_mib"] == 40750
    absorbed = next(p for p in r["paths"] if p["name"] == "absorbed")
    assert absorbed["selected"] and absorbed["formula_steps"] == 20
    assert absorbed["iterations"] == 19 and absorbed["max_heads"] == 7
    # the compute buffer: one 7-head K*Q group (a little over 2 GiB) plus named smaller parts
    kq = 163000 * 512 * 7 * 4
    parts = {p["name"]: p["bytes"] for p in r["peak_parts"]}
    assert parts["kq_soft_max-0-s1"] == kq                      # 2,228.52 MiB
    assert parts["kq_mask"] == 163000 * 512 * 4                 # the f32 mask, an input
    assert parts["kv_latent_t-0"] == 163000 * 512 * 2           # the latent, transposed f16
    assert parts["Qcur-0"] == 576 * 512 * 128 * 4               # absorbed queries
    assert 2 * GIB < kq < r["compute_buffer_bytes"] < 3 * GIB
    assert r["compute_buffer_bytes"] <= r["compute_buffer_ggml_bytes"]
    assert r["n_nodes"] > 61 * 19 * 9 and r["n_nodes"] <= r["capacity"]
    assert abs(r["kq_scale"] - 0.13524) < 1e-5


def test_seed_numbers_ubatch_1(capsys):
    r = _plan_json(capsys, "--preset", "deepseek-r1", "-c", "163000", "-ub", "1",
                   "--amb", "2048")
    assert r["kq_all_heads_mib"] == 79                         # 79.59 MiB, under the cap
    absorbed = next(p for p in r["paths"] if p["name"] == "absorbed")
    assert absorbed["iterations"] == 1 and absorbed["formula_steps"] == 1
    assert absorbed["largest_bytes"] == 163000 * 128 * 4


def test_mla_cache_at_163840_f16_and_q8_0(capsys):
    r = _plan_json(capsys, "--preset", "deepseek-v3", "-c", "163840", "-ub", "1",
                   "-ctk", "q8_0", "--fa")
    f16 = 61 * 163840 * 576 * 2
    q8 = 61 * 163840 * (576 // 32) * 34
    assert r["kv_cache_bytes_by_type"]["f16"] == f16 == 10980 * MIB
    assert r["kv_cache_bytes_by_type"]["q8_0"] == q8 == r["kv_cache_bytes"]   # 5833.12 MiB
    assert r["path"] == "absorbed-fa"
    dec = next(p for p in r["paths"] if p["name"] == "decompress-fa")
    assert "f32 or f16" in dec["unavailable"]


def test_text_report_names_every_part(capsys):
    assert main(["plan", "--preset", "deepseek-v3", "-c", "163000", "-ub", "512",
                 "--amb", "2048", "--strategy", "ggml"]) == 0
    out = capsys.readouterr().out
    for text in ("K*Q of all heads 40,750 MiB", "n_step = ceil(40750 / 2048) = 20",
                 "19 iterations of <= 7 heads", "ik_llama.cpp's divisor search: 16",
                 "15 iterations of <= 9 heads",
                 "CPU compute buffer size =", "kq_soft_max-0-s1", "kq_mask", "graph:"):
        assert text in out, text


def test_gguf_header_plan_equals_the_engine(tmp_path):
    """The same graph from a file's header (no weights) and from the loaded model."""
    from ggraph.graphs.engine import Engine, EngineConfig

    p = write_tiny_deepseek2(tmp_path / "t.gguf")
    model, wbytes = header_model(p)
    r = plan_deepseek2(model, p, 1024, 64, strategy="default")
    eng = Engine(p, EngineConfig(n_ctx=1024, n_ubatch=64))
    assert r.plan.size == eng.reserve_plan.size and r.kv_bytes == eng.cache.nbytes
    assert r.n_nodes == eng.worst_case.graph.n_nodes
    assert wbytes == eng.file.tensor_bytes


def test_weights_parameter():
    _, q2 = preset_model("deepseek-v3")
    _, q4 = preset_model("deepseek-v3", "q4_k")
    _, one = preset_model("deepseek-v3", 1.0)
    assert 200 * GIB < q2 < 215 * GIB and q4 / q2 == pytest.approx(144 / 84, rel=1e-3)
    assert 650e9 < one < 700e9            # ~671B weights at one byte each
    with pytest.raises(ValueError, match="unknown weight format"):
        bytes_per_weight("q9_9")


def test_bad_arguments(tmp_path, capsys):
    from ggraph.graphs.tiny import write_tiny_llama

    assert main(["plan"]) == 1
    assert "give a GGUF file or --preset" in capsys.readouterr().err
    assert main(["plan", "--preset", "gpt-5"]) == 1
    assert "unknown preset 'gpt-5'" in capsys.readouterr().err
    p = write_tiny_llama(tmp_path / "llama.gguf")
    assert main(["plan", str(p)]) == 1
    assert "no MLA planner" in capsys.readouterr().err
    assert main(["plan", "--preset", "deepseek-v3", "-c", "200000"]) == 1
    err = capsys.readouterr().err
    assert "training context 163840" in err and "Traceback" not in err
