"""`ggraph finetune`: train LoRA adapters on a text and write llama.cpp's adapter GGUF.

    ggraph finetune -m MODEL -f TEXT [--lora-r 8] [--lora-alpha 16]
        [--lora-targets attn_q,attn_v] [-c 256] [--epochs 2] [--lr 1e-4] [--wd 0]
        [--val-split 0.05] [--checkpoint] [-t N] -o adapter.gguf

The base weights stay frozen and quantized as they are in the file; the adapters are F32.
The text is cut as llama.cpp's finetune cuts it: windows of -c tokens every -c / 2, each
position's next token the label; the last --val-split of the windows are held out and
their loss printed after each epoch. The adapter loads with `ggraph run --lora FILE` and
with llama.cpp's --lora. --checkpoint keeps only each layer's input for the backward pass
and recomputes the rest (less memory, more time).
"""
from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="train LoRA adapters on a text (llama.cpp's adapter "
                                        "GGUF)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="default",
                   help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    p.add_argument("-f", "--file", required=True, help="the training text (UTF-8)")
    p.add_argument("-o", "--output", default="adapter.gguf", help="the adapter to write")
    p.add_argument("--lora-r", type=int, default=8, help="the adapters' rank (default 8)")
    p.add_argument("--lora-alpha", type=float, default=16.0,
                   help="alpha: the adapter's output is scaled by alpha / rank (default 16)")
    p.add_argument("--lora-targets", default="attn_q,attn_v",
                   help="comma-separated layer weights to adapt (default attn_q,attn_v)")
    p.add_argument("-c", "--ctx-size", type=int, default=256, help="tokens a window (256)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the text (default 2)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (1e-4)")
    p.add_argument("--wd", type=float, default=0.0, help="AdamW's weight decay (0)")
    p.add_argument("--val-split", type=float, default=0.05,
                   help="share of the windows held out for validation (0.05)")
    p.add_argument("--checkpoint", action="store_true",
                   help="gradient checkpointing: recompute activations in the backward pass")
    p.add_argument("--seed", type=int, default=0, help="initial values and shuffling")
    from ggraph.tools.common.defaults import add_threads_flag

    add_threads_flag(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ggraph.backends import get_backend
    from ggraph.graphs.eval.perplexity import read_text
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.train.lora import LoraFinetune, LoraSettings
    from ggraph.tools.common.defaults import check_threads

    if args.epochs < 1:
        raise ValueError(f"--epochs {args.epochs}: at least one epoch")
    settings = LoraSettings(rank=args.lora_r, alpha=args.lora_alpha,
                            targets=tuple(t.strip() for t in args.lora_targets.split(",")
                                          if t.strip()),
                            n_ctx=args.ctx_size, lr=args.lr, wd=args.wd, epochs=args.epochs,
                            val_split=args.val_split, checkpoint=args.checkpoint,
                            seed=args.seed)
    path = resolve_model(args.model)
    text = read_text(args.file)
    backend = get_backend("cpu", n_threads=check_threads(args.threads))
    t0 = time.perf_counter()
    ft = LoraFinetune.create(path, settings, backend)
    n_params = sum(t.nelements for lw in ft.adapter.weights.values() for t in (lw.a, lw.b))
    print(f"finetune: {path}: {len(ft.adapter.weights)} weights adapted "
          f"({', '.join(settings.targets)}), rank {settings.rank}, alpha {settings.alpha}, "
          f"{n_params:,} trainable parameters", file=sys.stderr)
    hist = ft.train(text)
    for i, (tr, va) in enumerate(zip(hist.train, hist.val + [None] * len(hist.train))):
        val = f", val loss {va.loss:.4f} acc {100 * va.accuracy:.2f}%" if va else ""
        print(f"epoch {i + 1}: train loss {tr.loss:.4f} acc {100 * tr.accuracy:.2f}%{val}",
              file=sys.stderr)
    ft.save(args.output)
    tokens = sum(r.seen for r in hist.train)
    dt = time.perf_counter() - t0
    print(f"wrote {args.output} ({tokens} tokens trained in {dt:.1f} s, "
          f"{tokens / dt:.1f} tokens/s)", file=sys.stderr)
    return 0
