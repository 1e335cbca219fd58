"""Pipeline stages on a local Ray cluster (backends/ray_stages.py, backends/stage.py): SmolLM2
split over two stage actors gives the logits of the same split in one process bit for bit and
the single-process greedy tokens; weights are mapped or shipped; a killed stage is a clear
error within seconds and the engine refuses to go on; a stage unpickles ggraph's data only."""
from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

from ggraph.backends.tensor_wire import StageTensors, WireRegistry, tensor_table
from ggraph.graphs.runtime.engine import Engine, EngineConfig

ray = pytest.importorskip("ray", reason="Ray is the optional extra ggraph[distributed]; the "
                                        "setup script installs it")


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of this machine: the driver and up to three stage worker processes."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama

    return tiny_models.made(write_tiny_llama, TinyLlama(n_layer=4, n_embd=64))


CFG = dict(n_ctx=64, n_ubatch=4, reserve_outputs="last", n_threads=1)


def test_smollm2_over_two_stages_bit_for_bit(cluster):
    """Two stage actors holding 15 layers each: every ubatch of the prompt pipelined, the
    logits of the same split in one process bit for bit, greedy tokens of one backend."""
    from ggraph.graphs.gguf.fetch import default_model

    path = str(default_model())
    cfg = dict(n_ctx=256, n_ubatch=4, reserve_outputs="last", n_threads=1)
    remote = Engine(path, EngineConfig(devices="ray:cpu,ray:cpu", n_gpu_layers=31, **cfg))
    local = Engine(path, EngineConfig(devices="cpu,cpu", n_gpu_layers=31, **cfg))
    prompt = local.tokenizer.encode("The capital of France is a city called")
    assert len(prompt) > cfg["n_ubatch"]  # several ubatches through the pipeline
    np.testing.assert_array_equal(remote.eval(prompt, n_past=0), local.eval(prompt, n_past=0))
    one = Engine(path, EngineConfig(**cfg))
    short = one.tokenizer.encode("The capital of France is")
    a = list(one.generate(short, 6, stop_at_eos=False))
    remote.reset()
    b = list(remote.generate(short, 6, stop_at_eos=False))
    assert a == b and "Paris" in one.tokenizer.decode(a)
    lines = "\n".join(remote.memory_lines())
    assert "STAGE0 KV buffer size" in lines and "STAGE1 compute buffer size" in lines
    remote.runner.shutdown()


def test_weights_shipped_to_a_stage_without_the_file(cluster, tiny):
    shipped = Engine(tiny, EngineConfig(devices="ray:cpu,ray:cpu", ship_weights=True, **CFG))
    mapped = Engine(tiny, EngineConfig(devices="ray:cpu", **CFG))
    local = Engine(tiny, EngineConfig(devices="cpu,cpu", **CFG))
    assert not any(s.mapped for s in shipped.runner.sessions[:2])
    assert mapped.runner.sessions[0].mapped
    prompt = list(range(3, 12))
    ref = local.eval(prompt)
    np.testing.assert_array_equal(shipped.eval(prompt), ref)
    for e in (shipped, mapped):
        e.runner.shutdown()


def test_pipelining_off_gives_the_same_logits(cluster, tiny):
    prompt = list(range(5, 19))  # four ubatches of 4
    got = []
    for pipeline in (True, False):
        e = Engine(tiny, EngineConfig(devices="ray:cpu,ray:cpu", pipeline=pipeline, **CFG))
        got.append((e.eval(prompt, all_logits=True), e.eval(prompt, n_past=0)))
        e.runner.shutdown()
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_a_killed_stage_is_a_clear_error_within_seconds(cluster, tiny):
    eng = Engine(tiny, EngineConfig(devices="ray:cpu,ray:cpu", stage_timeout=20, **CFG))
    gen = eng.generate([1, 2, 3], 20, stop_at_eos=False)
    got = [next(gen), next(gen)]
    ray.kill(eng.runner.sessions[1].actor)
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="stage STAGE1 died") as err:
        got += list(gen)
    assert time.perf_counter() - t0 < 15
    assert "rebuilt" in str(err.value) and len(got) < 20   # not reported as complete
    with pytest.raises(Exception, match="lost a stage"):
        eng.eval([4])
    eng.runner.shutdown()
    again = Engine(tiny, EngineConfig(devices="ray:cpu,ray:cpu", **CFG))  # a new engine works
    assert again.eval([1, 2, 3]).shape == (again.model.hp.n_vocab,)
    again.runner.shutdown()


def test_the_core_never_imports_ray():
    import subprocess
    import sys

    code = ("import sys, ggraph, ggraph.graphs.runtime.engine, ggraph.backends.multi, ggraph.cli; "
            "from ggraph.graphs.runtime.engine import Engine; assert 'ray' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_stage_loads_ggraph_data_only(tiny):
    """A stage unpickles graphs with ggraph's, numpy's and the standard containers' classes,
    and tensors by reference; anything else is refused before it is built."""
    from ggraph import Context, GGMLType as T, build_graph, ops as O

    ctx = Context("w")
    w = ctx.new_tensor(T.F32, (4, 4), "w").set_data(np.eye(4))
    x = ctx.new_tensor(T.F32, (4, 1), "x").set_input()
    g = build_graph(O.mul_mat(w, x))
    blob, new = WireRegistry().dumps((g, tensor_table(g.nodes, g.leafs)))
    assert [spec.name for spec, _ in new] == ["w"]
    stage = StageTensors()
    stage.add(new[0][0], np.asarray(w.data))
    g2, table = stage.loads(blob)
    assert g2.nodes[0].src[0] is stage.by_key[0] and len(table) == 3

    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("true",))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        stage.loads(pickle.dumps(Evil()))
