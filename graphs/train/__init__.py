"""graphs.train: training on ggraph graphs. Trainer (one optimizer step's graphs, built with
ggraph.autodiff and the optimizer ops), Dataset (examples in shuffled shards), fit (epochs,
validation, callbacks, progress), and LoRA fine-tuning of GGUF models."""
from .dataset import Dataset
from .fit import Progress, fit
from .trainer import SGD, AdamW, EpochResult, History, StepResult, Trainer

__all__ = ["AdamW", "SGD", "Dataset", "EpochResult", "History", "Progress", "StepResult",
           "Trainer", "fit"]
