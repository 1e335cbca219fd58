"""LoRA fine-tuning of a GGUF model: low-rank adapters on chosen weights trained with the
base weights frozen and quantized as they are in the file, written as llama.cpp's adapter
GGUF (graphs/models/lora_gguf.py), which `ggraph run --lora` and llama.cpp load.

The model's own graph is the forward pass (its builder applies the adapters through
graphs/models/lora.py's lora_mm, as inference does), over n_ctx tokens with an F32 KV cache
(llama.cpp's finetune uses F32 K/V) and flash attention off (it has no backward); the logits
of every position are fitted to the next token by cross-entropy (llama.cpp's dataset: windows
of n_ctx tokens every n_ctx / 2, labels shifted by one: common_opt_dataset_init).

Initial values as LoRA's paper and peft have them: a uniform in ±1/sqrt(n_in), b zero, so the
adapter starts as the identity of the base model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ggraph.ir.tensor import Context, Tensor
from .dataset import Dataset, one_hot
from .trainer import AdamW, History, Trainer

DEFAULT_TARGETS = ("attn_q", "attn_v")


@dataclass(frozen=True)
class LoraSettings:
    """What `ggraph finetune` takes: rank and alpha, the weights to adapt (names of the
    per-layer weights, `attn_q`, `ffn_down`, ...), the context, optimizer and schedule."""
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    n_ctx: int = 256
    lr: float = 1e-4
    wd: float = 0.0
    epochs: int = 2
    val_split: float = 0.05
    checkpoint: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"--lora-r {self.rank}: the rank must be at least 1")
        if self.n_ctx < 2:
            raise ValueError(f"-c {self.n_ctx}: the context must hold at least 2 tokens")
        if not self.targets:
            raise ValueError("no target weights to adapt")


def text_windows(tokens: Sequence[int], n_ctx: int, stride: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, next tokens): windows of n_ctx tokens every `stride` (default n_ctx / 2),
    the labels shifted by one, as llama.cpp's common_opt_dataset_init cuts them."""
    tokens = np.asarray(tokens, np.int64)
    stride = stride or max(1, n_ctx // 2)
    n = (len(tokens) - n_ctx - 1) // stride
    if n < 1:
        raise ValueError(f"the text has {len(tokens)} tokens: too few for one window of "
                         f"{n_ctx} tokens and its next token (use a smaller -c)")
    starts = np.arange(n) * stride
    data = np.stack([tokens[s:s + n_ctx] for s in starts])
    labels = np.stack([tokens[s + 1:s + n_ctx + 1] for s in starts])
    return data, labels


def target_weights(model: Any, targets: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The base weights to adapt ({name: ne}): every layer's `blk.N.<target>.weight`; a
    target may also be a full name or a regular expression over names."""
    names = model.gguf.tensors
    out: dict[str, tuple[int, ...]] = {}
    for t in targets:
        pat = re.compile(rf"blk\.\d+\.{re.escape(t)}\.weight") if re.fullmatch(r"\w+", t) \
            else re.compile(t)
        hit = [n for n in names if pat.fullmatch(n)]
        if not hit:
            raise ValueError(f"LoRA target {t!r} matches no weight of the model (its layers "
                             f"have {_layer_weights(names)})")
        for n in hit:
            w = names[n]
            if w.ne[2] != 1 or w.ne[3] != 1:
                raise ValueError(f"LoRA target {n!r} has ne={list(w.ne)}: expert (3-D) weights "
                                 f"are not trained")
            out[n] = tuple(w.ne[:2])
    return out


def _layer_weights(names: Any) -> str:
    kinds = sorted({m.group(1) for n in names if (m := re.match(r"blk\.\d+\.(\w+)\.weight", n))})
    return ", ".join(kinds)


@dataclass
class LoraFinetune:
    """A model with trainable adapters and the Trainer of its steps."""
    model: Any
    tokenizer: Any
    settings: LoraSettings
    adapter: Any
    trainer: Trainer
    mg: Any
    cache: Any
    history: History | None = None

    @classmethod
    def create(cls, path: str, settings: LoraSettings, backend: Any = "cpu") -> "LoraFinetune":
        """Load the model at `path`, add fresh adapters and build the training step."""
        from ggraph.graphs.gguf.gguf_file import load_gguf
        from ggraph.graphs.models.arch import build_model
        from ggraph.graphs.models.lora import LoraAdapter
        from ggraph.graphs.tokenizers.tokenizer import Tokenizer

        gguf = load_gguf(path)
        model = build_model(gguf)
        tok = Tokenizer(gguf.metadata, path)
        if settings.n_ctx > model.hp.n_ctx_train:
            raise ValueError(f"-c {settings.n_ctx} is larger than the model's training "
                             f"context {model.hp.n_ctx_train}")
        ctx = Context("lora")
        shapes = target_weights(model, settings.targets)
        adapter = LoraAdapter.new(ctx, gguf.arch, shapes, settings.rank, settings.alpha)
        rng = np.random.default_rng(settings.seed)
        for lw in adapter.weights.values():
            fan_in = lw.a.ne[0]
            lw.a.set_data(rng.uniform(-1, 1, lw.a.shape) / np.sqrt(fan_in))
            lw.b.set_data(np.zeros(lw.b.shape))
        model.set_loras([adapter])
        n = settings.n_ctx
        cache = model.new_cache(ctx, n, "f32", "f32", False)
        mg = model.build(ctx, cache, n, n, n, False, 0)
        params = [t for lw in adapter.weights.values() for t in (lw.a, lw.b)]
        checkpoint = _layer_inputs if settings.checkpoint else None
        trainer = Trainer(mg.logits, params, optimizer=AdamW(lr=settings.lr, wd=settings.wd),
                          backend=backend, checkpoint=checkpoint)
        return cls(model, tok, settings, adapter, trainer, mg, cache)

    # -- data -------------------------------------------------------------------------------
    def feeds(self, window: np.ndarray) -> dict[Tensor, np.ndarray]:
        """The graph's inputs for one window of tokens (positions 0.., cells 0..)."""
        from ggraph.graphs.models.model_graph import causal_batch, iswa_batch
        from ggraph.graphs.models.kv_iswa import IswaKVCache

        rows = np.arange(len(window))
        fn = iswa_batch if isinstance(self.cache, IswaKVCache) else causal_batch
        return fn(self.mg, self.cache, np.asarray(window, np.int32), 0, rows)

    def one_hot(self, labels: np.ndarray) -> np.ndarray:
        """Next tokens as the labels cross-entropy reads: one-hot rows over the vocabulary."""
        return one_hot(labels, self.mg.logits.ne[0])

    def dataset(self, text: str) -> Dataset:
        tokens = self.tokenizer.encode(text, add_bos=False)
        data, labels = text_windows(tokens, self.settings.n_ctx)
        return Dataset(data, labels)

    # -- training ---------------------------------------------------------------------------
    def train(self, text: str, callbacks: Sequence[Callable] = (), progress: bool | None = None,
              out: Any = None) -> History:
        """Epochs over the text's windows, one window a step, the last val_split of them
        held out (fit's loop; the progress line counts tokens)."""
        from .fit import run_epochs

        data = self.dataset(text)

        def feed(start: int, n: int) -> tuple[dict, np.ndarray]:
            x, y = data.batch(start, 1)
            return self.feeds(x[0]), self.one_hot(y[0])

        self.history = run_epochs(self.trainer, data, 1, feed, self.settings.epochs,
                                  self.settings.val_split, callbacks, self.settings.seed,
                                  progress=progress, out=out, unit=self.settings.n_ctx)
        return self.history

    def save(self, path: str) -> None:
        """The trained adapter as llama.cpp's LoRA GGUF."""
        from ggraph.graphs.models.lora_gguf import write_lora_adapter

        tensors = {name: tuple(self.trainer.values(t).reshape(t.ne[1], t.ne[0])
                               for t in (lw.a, lw.b))
                   for name, lw in self.adapter.weights.items()}
        write_lora_adapter(path, self.model.gguf.arch, self.settings.alpha, tensors)


def _layer_inputs(t: Tensor) -> bool:
    """Checkpoints for LoRA training: each layer's input (the residual stream between layers,
    named l_out-N by the builders) and the attention's K*Q-free tensors are kept; everything
    inside a layer is recomputed in the backward pass."""
    return t.name.startswith("l_out-")
