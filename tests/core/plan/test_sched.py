"""The scheduler (ggraph/plan/sched.py), running across backends (backends/multi.py), llama.cpp's
layer placement (graphs/deploy/placement.py) and deployment plans (graphs/deploy/plan_devices.py).

Runs here use two CPU backends (a second CPUBackend stands in for a device, so every split,
copy and per-device plan is real); the CUDA backend in a split runs in
tests/backends/cuda/test_cuda_sim.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ggraph.plan.alloc import check_graph
from ggraph.backends import get_backend
from ggraph.backends.cpu import CPUBackend
from ggraph.backends.multi import MultiSession
from ggraph.cli import main as cli
from ggraph.graphs.models.arch import model_class
from ggraph.graphs.runtime.engine import Engine, EngineConfig
from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.deploy.placement import (layer_map, parse_devices, parse_size, parse_split,
                                     place_tensors)
from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama
from ggraph.ir.opkind import OpKind
from ggraph.plan.sched import SchedulerError, describe, schedule_graph
from ggraph.ir.tensor import Context
from ggraph.ir.types import MIB

SEED_SPLIT = "37,25,25,25,24.5,24,24,24,24,25,24,25,24,24.5,31"


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models.made(write_tiny_llama,
                            TinyLlama(n_layer=4, n_embd=128, weight_type="q8_0"))


def _graph(path, n_tokens=5, n_ctx=64):
    f = load_gguf(path)
    m = model_class(f.arch, path)(f)
    ctx = Context("t")
    cache = m.new_cache(ctx, n_ctx)
    mg = m.build(ctx, cache, n_tokens, n_ctx, n_tokens)
    toks = np.arange(3, 3 + n_tokens, dtype=np.int32)
    return m, cache, mg, m.batch_inputs(mg, cache, toks, 0, np.arange(n_tokens))


def _cpu_logits(mg, inputs):
    s = get_backend("cpu").session()
    s.run(mg.graph, inputs)
    return s.read(mg.logits)


@pytest.mark.parametrize("n_dev,ngl,split", [(1, -1, None), (2, 3, (1, 2)), (2, 2, None),
                                             (3, -1, (1, 1, 2))])
def test_split_run_equals_one_backend(tiny, n_dev, ngl, split):
    m, cache, mg, inputs = _graph(tiny)
    ref = _cpu_logits(mg, inputs)
    lm = layer_map(4, n_dev, ngl, split)
    ms = MultiSession([CPUBackend() for _ in range(n_dev + 1)],
                      place_tensors(mg.graph.leafs, lm))
    ms.run(mg.graph, inputs)
    np.testing.assert_array_equal(ms.read(mg.logits), ref)  # same kernels: bit for bit
    sch = ms.schedule(mg.graph)
    # every device graph is a valid graph for its allocator, in execution order
    for g in sch.device_graphs:
        check_graph(g)
    # KV cache rows were written on the cache's own device
    il = 3
    d = ms.placement[cache.k[il]]
    assert d == lm.layers[il]
    k = ms.read(cache.k[il])
    assert np.abs(k[..., :5, :]).sum() > 0 and not k[..., 5:, :].any()


def test_splits_copies_and_views(tiny):
    m, cache, mg, inputs = _graph(tiny)
    lm = layer_map(4, 1)                       # every layer on device 0, the host last
    pl = place_tensors(mg.graph.leafs, lm)
    sch = schedule_graph(mg.graph, ["DEV0", "CPU"], [lambda t: True] * 2, pl)
    # input layer on the host, the layers on the device, the tied output matrix (the token
    # embedding, which stays on the host) on the host again
    assert [s.device for s in sch.splits] == [1, 0, 1]
    names = {t.name for t in sch.splits[1].inputs}
    assert {"inp_embd", "kq_mask", "inp_pos", "k_idxs"} <= names
    assert [t.name for t in sch.splits[2].inputs] == ["result_norm"]
    # views never cut a split; copies are named like ggml's and live for the whole graph
    for s in sch.splits:
        for n in s.nodes:
            if n.op in (OpKind.VIEW, OpKind.RESHAPE, OpKind.PERMUTE, OpKind.TRANSPOSE):
                assert sch.node_device[n] == s.device
    c = sch.copies[(mg.inputs.kq_mask, 0)]
    assert c.name == "DEV0#kq_mask#0" and c.is_input and c.is_output
    assert sum(sch.copy_bytes()) == sum(c.nbytes for c in sch.copies.values())
    # the host keeps result_norm's source alive until the copy: a dependency view there
    text = "\n".join(describe(sch))
    assert "graph splits = 3" in text and "inputs: inp_embd" in text


class _NoSoftmax(CPUBackend):
    """A device without soft_max: those nodes must fall back to the host."""

    def supports(self, node):
        return node.op != OpKind.SOFT_MAX and super().supports(node)


def test_unsupported_op_falls_back(tiny):
    m, cache, mg, inputs = _graph(tiny)
    ref = _cpu_logits(mg, inputs)
    ms = MultiSession([_NoSoftmax(), CPUBackend()],
                      place_tensors(mg.graph.leafs, layer_map(4, 1)))
    ms.run(mg.graph, inputs)
    np.testing.assert_array_equal(ms.read(mg.logits), ref)
    sch = ms.schedule(mg.graph)
    soft = [n for n in mg.graph.nodes if n.op == OpKind.SOFT_MAX]
    assert soft and all(sch.node_device[n] == 1 for n in soft)
    # host (input layer), then per layer: device, host (soft_max); device, host (output)
    assert [sp.device for sp in sch.splits] == [1] + [0, 1] * 4 + [0, 1]
    assert sch.names == ["CPU1", "CPU"]


def test_scheduler_errors(tiny):
    m, cache, mg, inputs = _graph(tiny)
    with pytest.raises(SchedulerError, match="no device can run"):
        schedule_graph(mg.graph, ["A", "B"], [lambda t: t.op != OpKind.ROPE] * 2, {})
    with pytest.raises(SchedulerError, match="one table per device"):
        schedule_graph(mg.graph, ["A", "B"], [lambda t: True], {})
    # a device that cannot run set_rows cannot hold a KV cache
    pl = {cache.k[0]: 0}
    with pytest.raises(SchedulerError, match="writes into 'cache_k_l0'.*on A"):
        schedule_graph(mg.graph, ["A", "B"], [lambda t: t.op != OpKind.SET_ROWS,
                                              lambda t: True], pl)


def test_engine_on_two_backends_same_tokens(tiny):
    cfg = dict(n_ctx=256, n_ubatch=4)          # the prompt spans two ubatches
    a = Engine(tiny, EngineConfig(**cfg))
    b = Engine(tiny, EngineConfig(devices="cpu", n_gpu_layers=3, **cfg))
    prompt = a.tokenizer.encode("the quick brown fox")
    assert len(prompt) > 4
    la, lb = a.eval(prompt, all_logits=True), b.eval(prompt, all_logits=True)
    np.testing.assert_array_equal(la, lb)
    ta = list(a.generate(a.tokenizer.encode("hello"), 6, stop_at_eos=False))
    tb = list(b.generate(b.tokenizer.encode("hello"), 6, stop_at_eos=False))
    assert ta == tb
    text = "\n".join(b.memory_lines())
    assert "offloaded 3/4 repeating layers" in text
    assert "llama_kv_cache: CPU1 KV buffer size" in text and "graph splits = " in text
    assert "CPU1 compute buffer size" in text and "CPU compute buffer size" in text


# -- placement -----------------------------------------------------------------------------

def test_layer_map_follows_llama_cpp():
    lm = layer_map(61, 15, 100, parse_split(SEED_SPLIT))
    counts = [lm.count(i) for i in range(15)]
    assert counts == [6] + [4] * 13 + [3] and lm.output == 14 and lm.input == 15
    # -ngl 2 of 4 layers: the last two layers go to the devices, the output stays on the CPU
    lm = layer_map(4, 2, 2)
    assert lm.layers == (2, 2, 0, 1) and lm.output == 2
    # -ngl 5 of 4: the output layer too; no split: equal shares, or shares by memory
    assert layer_map(4, 2, 5).layers == (0, 0, 0, 1)
    assert layer_map(4, 2, -1, memory=[1 * MIB, 3 * MIB]).layers == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="--tensor-split has 14 values for 15 devices"):
        layer_map(61, 15, 100, parse_split(SEED_SPLIT)[:-1])


def test_device_specs():
    ds = parse_devices("2x24GiB,1x80GB")
    assert [d.name for d in ds] == ["CUDA0", "CUDA1", "CUDA2"]
    assert ds[0].memory == 24 << 30 and ds[2].memory == 80 * 10**9
    assert [d.name for d in parse_devices("cuda,cpu")] == ["CUDA0", "CPU1"]
    assert parse_size("512 MiB") == 512 * MIB
    for bad, msg in (("2x", "entry '2x': unknown unit 'x'"), ("0x24GiB", "must be positive"),
                     ("24furlongs", "unknown unit"), ("cuda,,cuda", "empty entry")):
        with pytest.raises(ValueError, match=msg):
            parse_devices(bad)
    with pytest.raises(ValueError, match="cannot read --tensor-split"):
        parse_split("3,a")
    with pytest.raises(ValueError, match="not all 0"):
        parse_split("0,0")


# -- deployment plans ------------------------------------------------------------------------

def _seed_plan(*extra):
    # the seed ran ik_llama.cpp without flash attention (-fa is auto, so on, by default)
    return ["plan", "--preset", "deepseek-r1", "--weights", "0.36375", "-c", "163840",
            "-ub", "1024", "--amb", "1024", "--strategy", "ggml", "-ngl", "100", "-fa", "off",
            *extra]


def test_plan_of_the_seed_deployment(capsys, tmp_path):
    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    rc = cli(_seed_plan("--devices", "15x24GiB", "-ts", SEED_SPLIT, "--json", str(out),
                        "--png", str(png)))
    text = capsys.readouterr().out
    assert rc == 0, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000
    assert "every device fits" in text and "pipeline parallelism: 4 copies" in text
    r = json.loads(out.read_text())
    devs = r["devices"]
    assert [d["name"] for d in devs] == [f"CUDA{i}" for i in range(15)] + ["CPU"]
    # the seed's KV lines: 1080 MiB on CUDA0, 720 MiB per device, 10980 MiB in all
    assert devs[0]["kv_cache_bytes"] == 1080 * MIB
    assert all(d["kv_cache_bytes"] == 720 * MIB for d in devs[1:14])
    assert sum(d["kv_cache_bytes"] for d in devs) == 10980 * MIB
    # the host buffer: 4 pipeline copies of the 640 MiB f32 mask + the 28 MiB input layer,
    # as the seed's "CUDA_Host compute buffer size = 2588.05 MiB"
    assert abs(devs[-1]["compute_buffer_bytes"] / MIB - 2588.05) < 0.1
    # device compute buffers: the seed printed 5088.02 MiB (ik_llama.cpp's MLA graph)
    for d in devs[:15]:
        assert 4500 * MIB < d["compute_buffer_bytes"] < 5200 * MIB
        assert d["fits"] is True
    assert r["n_splits"] == 16 and r["n_copies"] == 4
    assert 225 < sum(d["weights_bytes"] for d in devs) / (1 << 30) < 230   # 227.69 GiB


def test_plan_reports_what_to_change(capsys):
    # 16 GiB devices: 240 GiB cannot hold 310 GiB, whatever the split
    rc = cli(_seed_plan("--devices", "15x16GiB", "-ts", SEED_SPLIT))
    text = capsys.readouterr().out
    assert rc == 2
    assert "does not fit:" in text and "NO" in text
    assert "CUDA1..CUDA13 (each) over by 5.13 GiB" in text
    assert "no tensor split fits" in text
    assert "-ctk q8_0 --fa: KV cache 720.00 MiB -> 382.50 MiB on CUDA1" in text
    assert "3 extra pipeline copies of its inputs" in text and "a smaller -ub" in text
    # 24 GiB devices with a bad split: a split that fits is proposed, and it does fit
    bad = "80," + SEED_SPLIT.split(",", 1)[1]
    assert cli(_seed_plan("--devices", "15x24GiB", "-ts", bad)) == 2
    text = capsys.readouterr().out
    assert "CUDA0 over by" in text
    proposed = text.split("--tensor-split ")[1].split()[0]
    assert cli(_seed_plan("--devices", "15x24GiB", "-ts", proposed)) == 0
    assert "every device fits" in capsys.readouterr().out


def test_plan_bad_device_input(capsys):
    assert cli(_seed_plan("--devices", "15x24GiB", "-ts", "1,1")) == 1
    assert "--tensor-split has 2 values for 15 devices" in capsys.readouterr().err
    assert cli(_seed_plan("--devices", "16x2GiB")) == 1
    err = capsys.readouterr().err
    assert ("device CUDA1 (2.00 GiB) is too small for one layer: layer 4 alone needs 4.07 GiB "
            "(weights 3.90 GiB + KV cache 180.00 MiB)") in err
    assert cli(_seed_plan("-ts", "1,1")) == 1
    assert "need --devices" in capsys.readouterr().err
    assert cli(_seed_plan("--devices", "cuda,cuda")) == 1
    assert "give sizes for planning" in capsys.readouterr().err


def test_smollm2_split_across_two_backends_same_tokens():
    """SmolLM2 with 15 of its 30 layers on a second backend: the same greedy text as one
    backend (the CUDA backend in the split: benchmarks/sched_smollm2_cudasim.py)."""
    from ggraph.graphs.gguf.fetch import default_model

    path = str(default_model())
    cfg = dict(n_ctx=256, n_ubatch=64, reserve_outputs="last")
    one = Engine(path, EngineConfig(**cfg))
    two = Engine(path, EngineConfig(devices="cpu", n_gpu_layers=15, **cfg))
    prompt = one.tokenizer.encode("The capital of France is")
    a = list(one.generate(prompt, 8, stop_at_eos=False))
    b = list(two.generate(prompt, 8, stop_at_eos=False))
    assert a == b and "Paris" in one.tokenizer.decode(a)
    lines = "\n".join(two.memory_lines())
    assert "offloaded 15/30 repeating layers" in lines and "graph splits = 3" in lines


def test_deepseek2_split_across_two_backends(tmp_path):
    """MLA (prompt and decode take different attention paths, so decode derives its own
    weights, which are placed by name on their layer's device) and MoE across devices."""
    from ggraph.graphs.testing.tiny_deepseek2 import TinyDeepSeek2, write_tiny_deepseek2

    p = str(write_tiny_deepseek2(tmp_path / "ds.gguf", TinyDeepSeek2(kv_b="legacy")))
    cfg = dict(n_ctx=64, n_ubatch=8)
    one = Engine(p, EngineConfig(**cfg))
    two = Engine(p, EngineConfig(devices="cpu,cpu", tensor_split=(1, 1), **cfg))
    prompt = [3, 4, 5, 6, 7]
    assert list(one.generate(prompt, 4, stop_at_eos=False)) == \
        list(two.generate(prompt, 4, stop_at_eos=False))
    placed = two.runner.placement
    derived = [t for t in placed if "attn_k_b" in t.name]
    assert derived and all(placed[t] < 2 for t in derived)
