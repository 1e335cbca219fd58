"""Datasets for training, in ggml-opt's spirit (ggml_opt_dataset): examples and their labels
as numpy arrays, kept in shards of consecutive examples whose order is shuffled between
epochs (the examples inside a shard stay together, so data that streams from disk is read in
runs), and a validation split taken from the end, which is never shuffled into training."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def one_hot(classes: np.ndarray, n: int) -> np.ndarray:
    """float32 rows of n zeros with a one at each class (what cross_entropy_loss reads as
    labels); classes must lie in [0, n)."""
    classes = np.asarray(classes)
    if classes.size and (classes.min() < 0 or classes.max() >= n):
        raise ValueError(f"dataset: class labels must lie in [0, {n}), got "
                         f"{classes.min()}..{classes.max()}")
    out = np.zeros((len(classes), n), np.float32)
    out[np.arange(len(classes)), classes] = 1.0
    return out


@dataclass
class Dataset:
    """`data[i]` is example i (any shape), `labels[i]` its label (for cross-entropy: a
    probability per class, e.g. one-hot). `shard`: examples per shard (1: every example is
    shuffled on its own)."""
    data: np.ndarray
    labels: np.ndarray
    shard: int = 1
    order: np.ndarray = field(init=False, repr=False)   # shard order in use

    def __post_init__(self) -> None:
        self.data = np.asarray(self.data)
        self.labels = np.asarray(self.labels)
        if self.data.ndim < 1 or len(self.data) == 0:
            raise ValueError("dataset: no examples (data must be an array of at least one "
                             "example)")
        if len(self.labels) != len(self.data):
            raise ValueError(f"dataset: {len(self.data)} examples but {len(self.labels)} "
                             f"labels")
        if not 1 <= int(self.shard) <= len(self.data) or len(self.data) % int(self.shard):
            raise ValueError(f"dataset: shard={self.shard} must divide the number of "
                             f"examples ({len(self.data)})")
        self.shard = int(self.shard)
        self.order = np.arange(self.n_shards)

    @classmethod
    def one_hot(cls, data: np.ndarray, classes: np.ndarray, n_classes: int | None = None,
                shard: int = 1) -> "Dataset":
        """Examples with integer class labels, made one-hot (what cross_entropy_loss reads)."""
        classes = np.asarray(classes)
        if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer):
            raise ValueError(f"dataset: class labels must be a 1-D integer array, got "
                             f"{classes.dtype} of shape {classes.shape}")
        n = int(n_classes if n_classes is not None else classes.max() + 1)
        return cls(data, one_hot(classes, n), shard)

    @property
    def n(self) -> int:
        return len(self.data)

    @property
    def n_shards(self) -> int:
        return self.n // self.shard

    def split(self, val_split: float) -> tuple[int, int]:
        """(examples for training, examples for validation): the validation part is the last
        `val_split` share, in whole shards (ggml_opt_fit's rule)."""
        if not 0.0 <= val_split < 1.0:
            raise ValueError(f"val_split={val_split} must be in [0, 1)")
        train_shards = self.n_shards - int(round(self.n_shards * val_split))
        train = min(self.n, max(1, train_shards) * self.shard)
        return train, self.n - train

    def shuffle(self, rng: np.random.Generator, n_examples: int | None = None) -> None:
        """Shuffle the order of the shards that hold the first `n_examples` (default: all)."""
        k = self.n_shards if n_examples is None else -(-int(n_examples) // self.shard)
        self.order[:k] = self.order[:k][rng.permutation(k)]

    def indices(self, start: int, stop: int) -> np.ndarray:
        """The example indices at positions [start, stop) of the current order."""
        pos = np.arange(start, stop)
        shard = self.order[pos // self.shard]
        return shard * self.shard + pos % self.shard

    def batch(self, start: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """`size` examples and labels from position `start` of the current order."""
        idx = self.indices(start, start + size)
        return self.data[idx], self.labels[idx]
