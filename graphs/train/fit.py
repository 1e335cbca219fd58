"""`fit`: epochs over a Dataset with a Trainer, as ggml_opt_fit runs them: the validation
split is the dataset's last shards, the training shards are shuffled each epoch, each
optimizer step takes `accumulate` batches of the inputs' size, and each epoch ends with the
loss (mean ± its standard error) and accuracy of both parts. Callbacks see every step and
every epoch; a progress line on a terminal shows ggml-opt's fields (data, loss, acc, t, ETA).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Sequence, TextIO

import numpy as np

from ggraph.ir.tensor import Tensor
from .dataset import Dataset
from .trainer import Callback, EpochResult, History, Trainer


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """ggml-opt's progress line: `train: [=====>    ] data=000064/001024 loss=2.3±0.1
    acc=12.50% t=00:00:01 ETA=00:00:07`, redrawn in place on a terminal, once per epoch
    part otherwise."""

    def __init__(self, label: str, total: int, out: TextIO, live: bool) -> None:
        self.label, self.total, self.out, self.live = label, total, out, live
        self.t0 = time.perf_counter()

    def line(self, done: int, res: EpochResult) -> str:
        frac = done / self.total if self.total else 1.0
        bar = "=" * int(frac * 20)
        bar = (bar + (">" if len(bar) < 20 else "")).ljust(20)
        dt = time.perf_counter() - self.t0
        eta = dt / frac - dt if frac > 0 else 0.0
        acc = f"{100 * res.accuracy:.2f}%" if res.seen else "-"
        unc = f"±{res.loss_unc:.5f}" if len(res.losses) > 1 else ""
        return (f"{self.label}: [{bar}] data={done:06d}/{self.total:06d} "
                f"loss={res.loss:.5f}{unc} acc={acc} t={_fmt_time(dt)} ETA={_fmt_time(eta)}")

    def show(self, done: int, res: EpochResult, final: bool = False) -> None:
        if self.live:
            self.out.write("\r" + self.line(done, res) + ("\n" if final else ""))
            self.out.flush()
        elif final:
            self.out.write(self.line(done, res) + "\n")


Feed = Callable[[int, int], "tuple[dict, np.ndarray]"]


def fit(trainer: Trainer, inputs: Tensor, dataset: Dataset, epochs: int = 1,
        val_split: float = 0.0, callbacks: Sequence[Callback] = (), seed: int = 0,
        shuffle: bool = True, progress: bool | None = None, out: TextIO | None = None
        ) -> History:
    """Train for `epochs` over `dataset`; `inputs` is the graph's input leaf, holding a
    batch of examples (ne [n_in, batch] for examples of n_in values). Callbacks are called
    as cb(trainer, "step", step, result) after each optimizer step and cb(trainer,
    "train"/"val", epoch, result) after each epoch part; a callback returning False stops
    training. Returns the History."""
    if trainer.labels is None:
        raise ValueError("fit: the trainer minimises its own loss; fit needs one made with "
                         "outputs (cross-entropy against the dataset's labels)")
    example = int(np.prod(dataset.data.shape[1:]))
    batch = inputs.nelements // max(example, 1)
    if batch < 1 or batch * example != inputs.nelements:
        raise ValueError(f"fit: examples of shape {dataset.data.shape[1:]} do not fit the "
                         f"inputs {inputs.describe()} (a whole number of examples: the "
                         f"batch)")
    lab_rows = trainer.labels.shape

    def feed(start: int, n: int) -> tuple[dict, np.ndarray]:
        x, y = dataset.batch(start, n)
        return {inputs: x.reshape(inputs.shape)}, y.reshape(lab_rows)

    return run_epochs(trainer, dataset, batch, feed, epochs, val_split, callbacks, seed,
                      shuffle, progress, out)


def run_epochs(trainer: Trainer, dataset: Dataset, batch: int, feed: Feed, epochs: int = 1,
               val_split: float = 0.0, callbacks: Sequence[Callback] = (), seed: int = 0,
               shuffle: bool = True, progress: bool | None = None,
               out: TextIO | None = None, unit: int = 1) -> History:
    """fit's loop for any graph: `feed(start, batch)` gives (feeds, labels) for `batch`
    examples from position `start` of the dataset's current order (LoRA fine-tuning feeds a
    model's token windows this way). The progress line counts `unit` per example (a
    window's tokens)."""
    if epochs < 1:
        raise ValueError(f"fit: epochs={epochs} must be at least 1")
    per_step = batch * trainer.accumulate
    n_train, n_val = dataset.split(val_split)
    steps = n_train // per_step
    if steps == 0:
        raise ValueError(f"fit: {n_train} training examples are fewer than one optimizer "
                         f"step's {per_step} (batch {batch} x accumulate "
                         f"{trainer.accumulate})")
    out = out or sys.stderr
    live = out.isatty() if progress is None else progress
    show = progress is not False
    rng = np.random.default_rng(seed)
    hist = History()
    for epoch in range(epochs):
        t0 = time.perf_counter()
        if shuffle:
            dataset.shuffle(rng, n_train)
        res = EpochResult()
        bar = Progress("train", steps * per_step * unit, out, live)
        for s in range(steps):
            micro = [feed(s * per_step + i * batch, batch) for i in range(trainer.accumulate)]
            r = trainer.step(micro)
            res.losses.extend(r.losses)
            res.correct += r.correct
            res.seen += r.seen
            hist.step_losses.append(r.loss)
            if show:
                bar.show((s + 1) * per_step * unit, res)
            if any(cb(trainer, "step", trainer.steps, r) is False for cb in callbacks):
                hist.train.append(res)
                return hist
        if show:
            bar.show(steps * per_step * unit, res, final=True)
        hist.train.append(res)
        hist.seconds.append(time.perf_counter() - t0)
        stop = any(cb(trainer, "train", epoch, res) is False for cb in callbacks)
        if n_val >= batch:
            vres = EpochResult()
            vbar = Progress("val", (n_val // batch) * batch * unit, out, live)
            for b in range(n_val // batch):
                x, y = feed(n_train + b * batch, batch)
                trainer.evaluate(x, y, into=vres)
            if show:
                vbar.show((n_val // batch) * batch * unit, vres, final=True)
            hist.val.append(vres)
            stop |= any(cb(trainer, "val", epoch, vres) is False for cb in callbacks)
        if stop:
            break
    return hist
