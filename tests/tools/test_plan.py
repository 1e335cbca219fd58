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
from ggraph.graphs.deploy.memory_plan import plan_model
from ggraph.graphs.deploy.presets import bytes_per_weight, header_model, preset_model
from ggraph.graphs.testing.tiny_deepseek2 import write_tiny_deepseek2

from ggraph.cli import main
from ggraph.ir.types import MIB

GIB = 1 << 30


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_numbers_ubatch_512(capsys):
    # the seed's figures are without flash attention (the absorbed path)
    r = _plan_json(capsys, "--preset", "deepseek-v3", "-c", "163000", "-ub", "512",
                   "--amb", "2048", "-fa", "off")
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
                 "--amb", "2048", "--strategy", "ggml", "-fa", "off"]) == 0
    out = capsys.readouterr().out
    for text in ("K*Q of all heads 40,750 MiB", "n_step = ceil(40750 / 2048) = 20",
                 "19 iterations of <= 7 heads", "ik_llama.cpp splits this path into 16",
                 "15 iterations of <= 9 heads",
                 "CPU compute buffer size =", "kq_soft_max-0-s1", "kq_mask", "graph:"):
        assert text in out, text


def test_gguf_header_plan_equals_the_engine(tmp_path):
    """The same graph from a file's header (no weights) and from the loaded model."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    p = write_tiny_deepseek2(tmp_path / "t.gguf")
    model, wbytes = header_model(p)
    r = plan_model(model, p, 1024, 64, strategy="default")
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


def test_bad_arguments(tiny, capsys):

    assert main(["plan"]) == 1
    assert "give a GGUF file or --preset" in capsys.readouterr().err
    assert main(["plan", "--preset", "gpt-5"]) == 1
    assert "unknown preset 'gpt-5'" in capsys.readouterr().err
    p = tiny
    assert main(["plan", str(p), "--path", "absorbed"]) == 1
    assert "one attention path" in capsys.readouterr().err
    assert main(["plan", "--preset", "deepseek-v3", "-c", "200000"]) == 1
    err = capsys.readouterr().err
    assert "training context 163840" in err and "Traceback" not in err


@pytest.mark.parametrize("fa,ctk,ctv", [(False, "f16", "f16"), (True, "f16", "f16"),
                                        (True, "q8_0", "q4_0"), (False, "q4_1", "f32")])
def test_llama_header_plan_equals_the_engine(tmp_path, capsys, fa, ctk, ctv):
    """A non-MLA architecture plans from its header as the engine reserves it: the same KV
    cache (llama.cpp's line) and the same compute buffer."""
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.testing.tiny import TinyDense, write_tiny_llama

    # heads of 32 values: quantized caches store whole blocks per head
    p = str(write_tiny_llama(tmp_path / "llama.gguf", TinyDense(n_embd=128)))
    args = ["-c", "1024", "-ub", "128", "-ctk", ctk, "-ctv", ctv, "-fa", "on" if fa else "off"]
    r = _plan_json(capsys, p, "--strategy", "default", *args)
    eng = Engine(p, EngineConfig(n_ctx=1024, n_ubatch=128, type_k=ctk, type_v=ctv,
                                 flash_attn=fa))
    assert r["kv_cache_bytes"] == eng.cache.nbytes
    assert r["kv_cache_lines"] == eng.cache.summary_lines()
    assert r["compute_buffer_bytes"] == eng.reserve_plan.size
    assert r["n_nodes"] == eng.worst_case.graph.n_nodes
    assert main(["plan", p, *args]) == 0
    out = capsys.readouterr().out
    assert "llama_kv_cache: size =" in out and "CPU compute buffer size =" in out


@pytest.mark.parametrize("ctk,per_row", [("f16", 2 * 512), ("q8_0", 34 * 512 // 32),
                                         ("q4_0", 18 * 512 // 32)])
def test_qwen2_7b_kv_cache_at_32k(capsys, ctk, per_row):
    """The second seed's model: 28 layers, 4 KV heads of 128 (GQA), so K and V rows hold 512
    values, not 28 * 128 = 3584 as the seed's '14.2 GB at 32K' assumes."""
    r = _plan_json(capsys, "--preset", "qwen2-7b", "-c", "32768", "-ctk", ctk, "-ctv", ctk,
                   "--fa")
    assert r["arch"] == "qwen2"
    assert r["kv_cache_bytes"] == 28 * 32768 * 2 * per_row
    assert r["kv_cache_bytes_by_type"]["f16"] == 1792 * MIB
    assert r["kv_cache_lines"][0].startswith(f"llama_kv_cache: size = {28 * 32768 * 2 * per_row / MIB:7.2f} MiB")
    # the output head of 512 tokens x 152064 logits is part of the compute buffer
    assert r["compute_buffer_bytes"] >= 512 * 152064 * 4


def test_model_names_and_presets_everywhere(capsys):
    """`default` names SmolLM2 in plan as in run; presets of any architecture draw."""
    r = _plan_json(capsys, "default", "-c", "2048")
    assert r["arch"] == "llama" and r["kv_cache_bytes"] == 30 * 2048 * 2 * 192 * 2
    assert main(["plan", "no-such-model"]) == 1
    assert "no such GGUF file or model name" in capsys.readouterr().err


def test_llama_cpp_fa_spellings(capsys):
    """`-fa on`, `--flash-attn`, `--fa` and `-fa off` as llama.cpp spells them."""
    on = [_plan_json(capsys, "default", "-c", "1024", *fa)["flash_attn"]
          for fa in (["-fa", "on"], ["--flash-attn"], ["--fa"], ["-fa", "auto"])]
    off = _plan_json(capsys, "default", "-c", "1024", "-fa", "off")["flash_attn"]
    assert on == [True] * 4 and off is False


def test_parallel_sequences_in_one_cache_or_a_stream_each(capsys):
    """-np 4: the same cells, llama.cpp's "4/1 seqs" (one unified stream); -no-kvu: a stream
    of pad256(4096 / 4) = 1024 cells per sequence, "4/4 seqs", and a worst case of 4 streams
    of 128 tokens. llama.cpp's figures (`llama-batched-bench -c 4096 -npl 4 -fa on -v`,
    0.3.36's source): the same memory line, a compute buffer of 98.25 MiB."""
    assert main(["plan", "default", "-c", "1024", "-np", "4"]) == 0
    out = capsys.readouterr().out
    assert "(  1024 cells,  30 layers,  4/1 seqs)" in out
    assert main(["plan", "default", "-c", "1024"]) == 0
    assert "1/1 seqs" in capsys.readouterr().out
    assert main(["plan", "default", "-c", "4096", "-np", "4", "-no-kvu", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert ("llama_kv_cache: size =   90.00 MiB (  1024 cells,  30 layers,  4/4 seqs), "
            "K (f16):   45.00 MiB, V (f16):   45.00 MiB") in out
    buf = float(out.split("CPU compute buffer size = ")[1].split()[0])
    assert 90 < buf <= 98.25


def test_parallel_sequences_each_keep_their_window(capsys):
    """Gemma 3's sliding-window cache with -np 4 holds every sequence's window: llama.cpp's
    lines for `llama-batched-bench -c 4096 -npl 4 -kvu` (0.3.36's source), KV buffers of
    12.00 and 37.50 MiB, the second of pad256(512 * 4 + 512) = 2560 cells."""
    assert main(["plan", "gemma3", "-c", "4096", "-np", "4"]) == 0
    out = capsys.readouterr().out
    assert ("llama_kv_cache: size =   12.00 MiB (  4096 cells,   3 layers,  4/1 seqs), "
            "K (f16):    6.00 MiB, V (f16):    6.00 MiB") in out
    assert "llama_kv_cache_iswa: creating     SWA KV cache, size = 2560 cells" in out
    assert ("llama_kv_cache: size =   37.50 MiB (  2560 cells,  15 layers,  4/1 seqs), "
            "K (f16):   18.75 MiB, V (f16):   18.75 MiB") in out
    # a stream per sequence: pad256(512 + 512) = 1024 ring cells each (llama.cpp's KV
    # buffers of 12.00 and 60.00 MiB, compute 514.50 MiB with -fa on)
    assert main(["plan", "gemma3", "-c", "4096", "-np", "4", "-no-kvu", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells" in out
    assert ("llama_kv_cache: size =   60.00 MiB (  1024 cells,  15 layers,  4/4 seqs), "
            "K (f16):   30.00 MiB, V (f16):   30.00 MiB") in out
    buf = float(out.split("CPU compute buffer size = ")[1].split()[0])
    assert 500 < buf <= 514.50
