"""LoRA fine-tuning (graphs/train/lora.py, `ggraph finetune`) on a tiny llama: llama.cpp's
windows, a fresh adapter that leaves the model as it was, training that lowers the loss, an
adapter file that `--lora` applies with the trained effect, checkpointing that changes
nothing but memory, and the report of a training step."""
from __future__ import annotations

import numpy as np
import pytest

from ggraph.graphs.testing.tiny import TinyDense, write_tiny_llama
from ggraph.graphs.train.lora import LoraFinetune, LoraSettings, text_windows
from paths import ROOT

TEXT = (ROOT / "tests" / "data" / "train" / "fdr_state_of_the_union.txt").read_text()[:2500]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("lora") / "tiny.gguf",
                                TinyDense(n_layer=2)))


def test_windows_as_llama_cpp_cuts_them():
    data, labels = text_windows(list(range(40)), 16)
    assert data.shape == (2, 16) and (40 - 16 - 1) // 8 == 2
    assert data[1, 0] == 8 and labels[1, 0] == 9 and labels[1, -1] == 24
    with pytest.raises(ValueError, match="too few for one window"):
        text_windows(list(range(10)), 16)


def _logits(path, adapter=None, tokens=None):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    cfg = EngineConfig(n_ctx=32, type_k="f32", type_v="f32",   # as the training graph
                       loras=((adapter, 1.0),) if adapter else ())
    eng = Engine(path, cfg)
    return eng.eval(list(tokens), all_logits=True)


def test_training_lowers_the_loss_and_the_adapter_applies(tiny, tmp_path):
    st = LoraSettings(rank=4, alpha=8, n_ctx=32, lr=1e-2, epochs=2, val_split=0.1)
    ft = LoraFinetune.create(tiny, st)
    window = ft.dataset(TEXT).data[0]
    before = _logits(tiny, tokens=window)
    ft.trainer.evaluate(ft.feeds(window), ft.one_hot(ft.dataset(TEXT).labels[0]))
    fresh = ft.trainer.session.read(ft.mg.logits).reshape(before.shape)
    np.testing.assert_allclose(fresh, before, rtol=1e-3, atol=1e-3)   # b = 0: no change
    hist = ft.train(TEXT, progress=False)
    assert hist.val[-1].loss < hist.val[0].loss
    assert np.mean(hist.step_losses[-3:]) < 0.8 * np.mean(hist.step_losses[:3])
    path = str(tmp_path / "adapter.gguf")
    ft.save(path)
    ft.trainer.evaluate(ft.feeds(window), ft.one_hot(ft.dataset(TEXT).labels[0]))
    trained = ft.trainer.session.read(ft.mg.logits).reshape(before.shape)
    applied = _logits(tiny, path, window)
    np.testing.assert_allclose(applied, trained, rtol=1e-3, atol=1e-3)
    assert np.abs(applied - before).max() > 0.1


def test_checkpointing_gives_the_same_step(tiny):
    steps = []
    for ck in (False, True):
        ft = LoraFinetune.create(tiny, LoraSettings(rank=4, n_ctx=16, lr=1e-2,
                                                    checkpoint=ck))
        data = ft.dataset(TEXT)
        losses = [ft.trainer.step([(ft.feeds(data.data[i]), ft.one_hot(data.labels[i]))]).loss
                  for i in range(3)]
        lw = next(iter(ft.adapter.weights.values()))
        steps.append((losses, ft.trainer.values(lw.b), len(ft.trainer.grads.recomputed)))
    assert steps[0][2] == 0 and steps[1][2] > 0
    np.testing.assert_allclose(steps[1][0], steps[0][0], rtol=1e-5)
    np.testing.assert_allclose(steps[1][1], steps[0][1], rtol=1e-4, atol=1e-7)


def test_finetune_and_report_commands(tiny, tmp_path, capsys):
    from ggraph.cli import main

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "a.gguf"
    assert main(["finetune", "-m", tiny, "-f", str(text), "-c", "16", "--epochs", "1",
                 "--lora-r", "2", "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    err = capsys.readouterr().err
    assert "trainable parameters" in err and "epoch 1: train loss" in err
    assert main(["report", tiny, "--train-lora", "--n-tokens", "16", "--top", "3"]) == 0
    rep = capsys.readouterr().out
    assert "without checkpointing: compute buffer" in rep and "with checkpointing" in rep
    assert "held for the backward" in rep
    assert main(["finetune", "-m", tiny, "-f", str(text), "--lora-targets", "nope"]) != 0
    assert "LoRA target 'nope' matches no weight" in capsys.readouterr().err
