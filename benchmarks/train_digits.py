"""An MLP classifier trained end to end on scikit-learn's digits, by ggraph and by torch from
the same start (issue 33's must-show): the same initial weights (graphs/train/mlp.py draws
them; torch copies them), the same data order (both walk graphs/train/dataset.py's shuffled
order), batch size and AdamW settings. Prints and writes:
- per-step losses side by side: the largest relative difference over the first --check
  steps (target < 1e-3);
- per-epoch training loss and the final validation accuracy of both (target >= 95%);
- seconds per epoch of both, on the same threads.

    python benchmarks/train_digits.py [--hidden 128] [--batch 32] [--epochs 12] [--lr 1e-3]
        [--check 200] [-t 2] [-o results.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, print_table, results_path, threads_option,  # noqa: E402
                      write_markdown_table, write_results)

COLUMNS = [Column("epoch"), Column("ggraph_loss", "ggraph loss", "{:.5f}"),
           Column("torch_loss", "torch loss", "{:.5f}"),
           Column("ggraph_val_acc", "ggraph val acc", "{:.2%}"),
           Column("torch_val_acc", "torch val acc", "{:.2%}"),
           Column("ggraph_s", "ggraph s/epoch", "{:.3f}"),
           Column("torch_s", "torch s/epoch", "{:.3f}")]


def digits(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits, pixels scaled to [0, 1], in one fixed random order: the data set is
    stored writer by writer, so the validation split (its last examples) would otherwise be
    the last writers' hands only."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(seed).permutation(len(d.target))
    return (d.data[order] / 16.0).astype(np.float32), d.target[order].astype(np.int64)


def run_ggraph(args, x, y):
    from ggraph.graphs.train import AdamW, Dataset, Trainer, fit
    from ggraph.graphs.train.mlp import mlp

    net = mlp((64, args.hidden, 10), args.batch, seed=args.seed)
    init = net.initial_values()
    data = Dataset.one_hot(x, y, 10)
    tr = Trainer(net.logits, net.params, optimizer=AdamW(lr=args.lr),
                 backend=_backend(args.threads))
    hist = fit(tr, net.inputs, data, epochs=args.epochs, val_split=args.val_split,
               seed=args.seed, progress=False)
    return init, hist


def _backend(threads: int):
    from ggraph.backends import get_backend

    return get_backend("cpu", n_threads=threads)


def run_torch(args, x, y, init):
    import torch

    torch.set_num_threads(args.threads)
    from ggraph.graphs.train import Dataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.hidden), torch.nn.SiLU(),
                                torch.nn.Linear(args.hidden, 10))
    with torch.no_grad():
        for p, v in zip(model.parameters(), init):
            p.copy_(torch.from_numpy(np.asarray(v, np.float32).reshape(p.shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0)
    data = Dataset.one_hot(x, y, 10)        # the same shard order, drawn the same way
    n_train, n_val = data.split(args.val_split)
    rng = np.random.default_rng(args.seed)
    steps = n_train // args.batch
    losses, epochs = [], []
    for _ in range(args.epochs):
        t0 = time.perf_counter()
        data.shuffle(rng, n_train)
        ep = []
        for s in range(steps):
            xb, yb = data.batch(s * args.batch, args.batch)
            out = model(torch.from_numpy(xb))
            loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(yb))
            opt.zero_grad()
            loss.backward()
            opt.step()
            ep.append(loss.item())
        dt = time.perf_counter() - t0
        losses += ep
        with torch.no_grad():
            idx = np.arange(n_train, n_train + (n_val // args.batch) * args.batch)
            pred = model(torch.from_numpy(x[idx])).argmax(-1).numpy()
            acc = float(np.mean(pred == y[idx]))
        epochs.append({"loss": float(np.mean(ep)), "val_acc": acc, "seconds": dt})
    return losses, epochs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter,
                                 parents=[threads_option(2)])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-split", type=float, default=0.1)
    ap.add_argument("--check", type=int, default=200, help="steps whose losses are compared")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", default=results_path("train_digits.json"))
    args = ap.parse_args(argv)
    if isinstance(args.threads, list):
        args.threads = args.threads[0]
    x, y = digits(args.seed)
    init, hist = run_ggraph(args, x, y)
    t_losses, t_epochs = run_torch(args, x, y, init)
    g = np.array(hist.step_losses[:args.check])
    t = np.array(t_losses[:args.check])
    rel = np.abs(g - t) / np.abs(t)
    rows = [{"epoch": i + 1, "ggraph_loss": hist.train[i].loss, "torch_loss": te["loss"],
             "ggraph_val_acc": hist.val[i].accuracy if hist.val else None,
             "torch_val_acc": te["val_acc"], "ggraph_s": hist.seconds[i],
             "torch_s": te["seconds"]} for i, te in enumerate(t_epochs)]
    print_table(rows, COLUMNS)
    worst = float(rel.max())
    print(f"per-step loss, first {len(g)} steps: largest relative difference {worst:.2e} "
          f"(target < 1e-3), at step {int(rel.argmax()) + 1}")
    acc = hist.val[-1].accuracy
    print(f"final validation accuracy: ggraph {acc:.2%}, torch {t_epochs[-1]['val_acc']:.2%} "
          f"(target >= 95%)")
    write_results(args.out, rows, args=args, extra={
        "steps_compared": len(g), "max_rel_step_loss_diff": worst,
        "step_losses": {"ggraph": hist.step_losses, "torch": t_losses},
        "final_val_acc": {"ggraph": acc, "torch": t_epochs[-1]["val_acc"]}})
    write_markdown_table(args.out, rows, COLUMNS, notes=[
        f"per-step loss over the first {len(g)} steps: largest relative difference "
        f"{worst:.2e} (target < 1e-3)",
        f"final validation accuracy: ggraph {acc:.2%}, torch {t_epochs[-1]['val_acc']:.2%}"])
    return 0 if worst < 1e-3 and acc >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
