"""The training API (graphs/train): datasets in shuffled shards, a Trainer whose steps match
torch's (AdamW and SGD, with gradient accumulation), fit's epochs, validation, callbacks and
progress line."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from ggraph.graphs.train import SGD, AdamW, Dataset, Progress, Trainer, fit
from ggraph.graphs.train.mlp import mlp


def test_dataset_shards_split_and_errors():
    d = Dataset(np.arange(12).reshape(12, 1), np.arange(12), shard=3)
    assert d.n_shards == 4 and d.split(0.25) == (9, 3)
    d.shuffle(np.random.default_rng(0), 9)
    order = d.indices(0, 12)
    assert sorted(order[:9]) == list(range(9)) and list(order[9:]) == [9, 10, 11]
    assert all(order[i + 1] == order[i] + 1 for i in (0, 3, 6))     # shards stay together
    oh = Dataset.one_hot(np.zeros((3, 2)), np.array([0, 2, 1]))
    assert oh.labels.tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 0]]
    with pytest.raises(ValueError, match="shard=5 must divide"):
        Dataset(np.zeros((12, 1)), np.zeros(12), shard=5)
    with pytest.raises(ValueError, match="12 examples but 11 labels"):
        Dataset(np.zeros((12, 1)), np.zeros(11))
    with pytest.raises(ValueError, match=r"lie in \[0, 2\)"):
        Dataset.one_hot(np.zeros((2, 1)), np.array([0, 2]), 2)


def _torch_twin(init, hidden):
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.SiLU(),
                                torch.nn.Linear(hidden, 3))
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(torch.from_numpy(np.asarray(v, np.float32).reshape(p.shape)))
    return model


@pytest.mark.parametrize("opt,accumulate", [(AdamW(lr=1e-2, wd=0.1), 1), (SGD(lr=0.1), 1),
                                            (AdamW(lr=1e-2), 2)])
def test_steps_match_torch(opt, accumulate):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (64, 8)).astype(np.float32)
    y = rng.integers(0, 3, 64)
    batch = 16 // accumulate
    net = mlp((8, 12, 3), batch, seed=3)
    init = net.initial_values()
    tr = Trainer(net.logits, net.params, optimizer=opt, accumulate=accumulate)
    model = _torch_twin(init, 12)
    topt = (torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.wd)
            if isinstance(opt, AdamW) else torch.optim.SGD(model.parameters(), lr=opt.lr,
                                                          weight_decay=opt.wd))
    data = Dataset.one_hot(x, y, 3)
    for step in range(4):
        micro = []
        for i in range(accumulate):
            xb, yb = data.batch(step * 16 + i * batch, batch)
            micro.append(({net.inputs: xb}, yb))
        res = tr.step(micro)
        xb, yb = data.batch(step * 16, 16)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(xb)),
                                                 torch.from_numpy(yb))
        topt.zero_grad()
        loss.backward()
        topt.step()
        assert abs(res.loss - loss.item()) < 1e-5 * max(1.0, abs(loss.item()))
    for p, tp in zip(net.params, model.parameters()):
        np.testing.assert_allclose(tr.values(p).reshape(tp.shape), tp.detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
    assert np.array_equal(net.initial_values()[0], init[0])   # the caller's data untouched


def test_fit_epochs_validation_callbacks_and_progress():
    rng = np.random.default_rng(1)
    centers = rng.uniform(-2, 2, (3, 8))
    y = rng.integers(0, 3, 96)
    x = (centers[y] + rng.normal(0, 0.3, (96, 8))).astype(np.float32)
    net = mlp((8, 16, 3), 8, seed=0)
    tr = Trainer(net.logits, net.params, optimizer=AdamW(lr=3e-2))
    seen = []

    def cb(trainer, what, i, res):
        seen.append(what)
        return not (what == "val" and i == 1)      # stop after the second epoch
    out = io.StringIO()
    hist = fit(tr, net.inputs, Dataset.one_hot(x, y, 3), epochs=5, val_split=0.25,
               callbacks=[cb], out=out)
    assert len(hist.train) == len(hist.val) == 2 and seen.count("step") == 2 * 9
    assert hist.val[-1].accuracy > 0.9 and hist.train[1].loss < hist.train[0].loss
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train: [====================] data=000072/000072 loss=")
    assert "acc=" in lines[0] and "ETA=" in lines[0] and lines[1].startswith("val: [")
    p = Progress("train", 100, io.StringIO(), live=False)
    assert "data=000050/000100" in p.line(50, hist.train[0])


def test_fit_refuses_what_does_not_fit():
    net = mlp((8, 4, 3), 8)
    tr = Trainer(net.logits, net.params)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        fit(tr, net.inputs, Dataset.one_hot(np.zeros((4, 8)), np.zeros(4, int), 3))
    with pytest.raises(ValueError, match="do not fit the inputs"):
        fit(tr, net.inputs, Dataset.one_hot(np.zeros((16, 5)), np.zeros(16, int), 3))
