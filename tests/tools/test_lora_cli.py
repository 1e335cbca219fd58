"""--lora FNAME[,...] and --lora-scaled FNAME:SCALE[,...] (llama.cpp's common/arg.cpp syntax)
on `ggraph run`, `ggraph perplexity` and `ggraph serve`: parsed into EngineConfig.loras,
applied, and every bad value one error line."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.cli import build_parser, main
from ggraph.graphs.gguf.gguf_file import load_gguf
from ggraph.graphs.models.lora_gguf import write_lora_adapter
from ggraph.graphs.testing.tiny import TinyLlama, write_tiny_llama
from ggraph.tools.common.defaults import lora_config

R = 4


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models.made(write_tiny_llama, TinyLlama(n_embd=128))


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    f = load_gguf(tiny)
    rng = np.random.default_rng(0)
    pairs = {}
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight"):
        ne = f.tensors[name].ne
        pairs[name] = (rng.normal(0, 1.0, (R, ne[0])), rng.normal(0, 1.0, (ne[1], R)))
    return write_lora_adapter(tmp_path_factory.mktemp("lora") / "a.gguf", f.arch, 8.0, pairs)


@pytest.mark.parametrize("cmd", [["run", "default"], ["perplexity", "-f", "x"],
                                 ["serve", "-m", "default"]])
def test_every_command_takes_the_flags(cmd):
    args = build_parser().parse_args(cmd + ["--lora", "a.gguf,b.gguf", "--lora-scaled",
                                            "c.gguf:0.5", "--lora", "d.gguf",
                                            "--lora-scaled", "e.gguf:2,f.gguf:0"])
    assert lora_config(args) == (("a.gguf", 1.0), ("b.gguf", 1.0), ("d.gguf", 1.0),
                                 ("c.gguf", 0.5), ("e.gguf", 2.0), ("f.gguf", 0.0))


def _error(capsys, *argv):
    assert main(list(argv)) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"ggraph {argv[0]}: error: "), lines[0]
    return lines[0]


def test_bad_values_are_one_line(capsys, tiny, tmp_path):
    base = ["run", tiny, "-p", "hi", "-n", "1", "-c", "64", "--no-warmup"]
    assert "lora-scaled format: FNAME:SCALE" in _error(capsys, *base, "--lora-scaled", "x.gguf")
    assert "no such file" in _error(capsys, *base, "--lora", str(tmp_path / "none.gguf"))
    assert "expect general.type to be 'adapter'" in _error(capsys, *base, "--lora", tiny)
    assert "lora-scaled format" in _error(capsys, "serve", "-m", tiny, "--lora-scaled", "a:b:c")


def test_run_applies_the_adapter(capsys, tiny, adapter):
    """Scale 0 is the base model's text; the adapter at scale 1 changes it."""
    def text(*extra):
        assert main(["run", tiny, "-p", "the", "-n", "8", "-c", "64", "--temp", "0",
                     "--no-warmup", *extra]) == 0
        return capsys.readouterr().out

    base = text()
    assert text("--lora-scaled", f"{adapter}:0") == base
    assert text("--lora", adapter) != base


def test_perplexity_engine_takes_the_adapters(tiny, adapter):
    from ggraph.tools.perplexity import load_engine

    args = build_parser().parse_args(["perplexity", "-m", tiny, "-f", "x", "--lora-scaled",
                                      f"{adapter}:0.5"])
    eng = load_engine(args, 32, 1)
    assert eng.cfg.loras == ((adapter, 0.5),)
    assert [a.scale for a in eng.model.loras] == [0.5]
