"""`ggraph report`: plan a graph's compute buffer and explain it.

Builds the attention example (graphs/models/attention.py, reserved like llama.cpp: n_tokens = ubatch,
n_kv = n_ctx, K/V caches pre-allocated), a model's worst-case graph (a GGUF path or a model
name: default, smollm2, gemma3), or any user graph (`--graph module:function` or
`--graph file.py:function`, as `ggraph dot` takes it: a function returning a Graph, a
ModelGraph or an output Tensor), plans it with ggraph.plan.alloc and prints the llama.cpp-style
size line, the peak, and the tensor table; optionally writes JSON and a PNG memory map (one
panel when ggml-alloc's rules and the chosen strategy lay the graph out alike).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from ggraph.backends import registry
from ggraph.plan.alloc import AllocError, GraphAllocator
from ggraph.ir.graph import Graph
from ggraph.ir.tensor import Context
from ggraph.ir.types import GGMLType


def attention_graph(n_head: int = 32, n_head_kv: int = 8, head_dim: int = 128,
                    n_tokens: int = 512, n_kv: int = 4096, kv_type: str = "f16",
                    amb: int = 0, fa: bool = False, max_bias: float = 0.0) -> Graph:
    """One attention layer as llama.cpp reserves it: q and the mask are inputs, the K/V caches
    live in their own buffer ("kv_cache"), the attention output is the graph output."""
    from ggraph.graphs.models.attention import AttentionShape, build_attention, split_heads

    ctx = Context("attention")
    kvt = GGMLType.parse(kv_type)
    shape = AttentionShape(head_dim, n_head, n_head_kv, n_tokens, n_kv)
    q = ctx.new_tensor(GGMLType.F32, (head_dim, n_head, n_tokens), name="q").set_input()
    k_cache = ctx.new_tensor(kvt, (head_dim * n_head_kv, n_kv), name="cache_k")
    v_ne = (head_dim * n_head_kv, n_kv) if fa else (n_kv, head_dim * n_head_kv)
    v_cache = ctx.new_tensor(kvt, v_ne, name="cache_v")
    k_cache.buffer = v_cache.buffer = "kv_cache"
    mask = ctx.new_tensor(GGMLType.F16 if fa else GGMLType.F32, (n_kv, n_tokens),
                          name="kq_mask").set_input()
    out = build_attention(q, k_cache, v_cache, mask, shape=shape,
                          kq_scale=1.0 / math.sqrt(head_dim), max_bias=max_bias, flash=fa,
                          amb_mib=amb)
    out.set_output()
    n_groups = len(split_heads(n_head, n_head_kv, n_kv, n_tokens, amb))
    g = Graph(capacity=max(2048, 64 + 16 * n_groups))
    return g.build_forward_expand(out)


def _model_graph(spec: str, args: argparse.Namespace) -> Graph:
    """A model's worst-case graph (a GGUF path or a name: default, smollm2, gemma3), reserved
    as `ggraph dot` draws it: n_kv = --n-kv, ubatch = --n-tokens."""
    from ggraph.tools.dot import load_model, model_graph

    model, _ = load_model(spec)
    return model_graph(model, args.n_kv, args.n_tokens, args.amb, args.fa, args.kv_type,
                       args.kv_type).graph


def _bytes(text: str) -> int:
    """1048576, 512K, 64M, 1.5G (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    return int(value)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report", help="plan a graph's compute buffer and explain it",
        description="Plan the compute buffer of the attention example or of a user graph and "
                    "print its size, peak and tensor table (ggml-alloc's rules, and the "
                    "default strategy that is never worse).")
    p.add_argument("model", nargs="?", help="plan this model's worst-case graph: a GGUF file "
                   "or a model name (default, smollm2, gemma3); its shape options are "
                   "--n-tokens (ubatch), --n-kv (context), --kv-type, --amb, --fa")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL",
                   help="the same as the positional MODEL (llama.cpp's spelling)")
    p.add_argument("--graph", metavar="MODULE:FUNCTION",
                   help="plan the graph returned by this function (module path or "
                        "file.py; a Graph, ModelGraph or output Tensor) instead of the "
                        "attention example")
    t = p.add_argument_group("training")
    t.add_argument("--train-lora", action="store_true",
                   help="plan one LoRA training step of MODEL (forward, backward, AdamW) "
                        "instead of its inference graph, with and without gradient "
                        "checkpointing; --n-tokens is the window (default 256)")
    t.add_argument("--lora-r", type=int, default=8, help="the adapters' rank (default 8)")
    t.add_argument("--lora-targets", default="attn_q,attn_v",
                   help="comma-separated layer weights adapted (default attn_q,attn_v)")
    a = p.add_argument_group("attention example")
    a.add_argument("--n-head", type=int, default=32)
    a.add_argument("--n-head-kv", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=128)
    from ggraph.tools.common.defaults import N_CTX, N_UBATCH

    a.add_argument("--n-tokens", type=int, default=N_UBATCH,
                   help=f"ubatch size (default {N_UBATCH})")
    a.add_argument("--n-kv", type=int, default=N_CTX, help=f"KV length, n_ctx (default {N_CTX})")
    a.add_argument("--kv-type", default="f16", help="KV cache type (default f16)")
    a.add_argument("--amb", type=int, default=0, help="split attention cap in MiB (0: off)")
    from ggraph.tools.common.defaults import add_flash_attn_flag

    add_flash_attn_flag(a)
    a.add_argument("--max-bias", type=float, default=0.0, help="ALiBi max bias")
    o = p.add_argument_group("planning and output")
    o.add_argument("--strategy", choices=("default", "ggml"), default="default")
    o.add_argument("--backend", choices=sorted(registry.NAMES), default="cpu",
                   help="buffer type: cpu (alignment 32) or cuda (128)")
    o.add_argument("--alignment", type=int, help="override the backend's alignment")
    o.add_argument("--max-bytes", type=_bytes, help="buffer limit, e.g. 512M")
    o.add_argument("--json", metavar="FILE", help="write the report as JSON")
    o.add_argument("--png", metavar="FILE", help="write the memory map as PNG")
    o.add_argument("--top", type=int, default=40, help="table rows (largest tensors; 0: all)")
    p.set_defaults(func=run)


def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot work, with one-line errors (the attention example's
    shape is checked only when it is built)."""
    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds

    if getattr(args, "model", None) or getattr(args, "model_opt", None):
        check_bounds(args, {a: ("--" + a.replace("_", "-"), 1, "") for a in
                            ("n_tokens", "n_kv")})
        check_bounds(args, {"amb": SIZE_BOUNDS["amb"]})
    elif not args.graph:
        check_bounds(args, {a: ("--" + a.replace("_", "-"), 1, "") for a in
                            ("n_head", "n_head_kv", "head_dim", "n_tokens", "n_kv")})
        if args.n_head % args.n_head_kv:
            raise ValueError(f"--n-head {args.n_head} must be a multiple of --n-head-kv "
                             f"{args.n_head_kv} (grouped-query attention)")
        check_bounds(args, {"amb": SIZE_BOUNDS["amb"]})
        if not (math.isfinite(args.max_bias) and args.max_bias >= 0):
            raise ValueError(f"--max-bias must be a finite number >= 0, got {args.max_bias}")
    if args.alignment is not None and args.alignment <= 0:
        raise ValueError(f"--alignment must be a positive power of two, got {args.alignment}")
    check_bounds(args, {"max_bytes": ("--max-bytes", 0, ""),
                        "top": ("--top", 0, " (0: every tensor)")})


def run(args: argparse.Namespace) -> int:
    from ggraph.tools.common.defaults import flash_attn_on

    args.fa = flash_attn_on(args.fa)
    from ggraph.pictures import alloc_report as R
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models given: {args.model} and -m {args.model_opt}")
    model = args.model or args.model_opt
    if model and args.graph:
        raise ValueError("give a MODEL or --graph MODULE:FUNCTION, not both")
    check_options(args)
    if getattr(args, "train_lora", False):
        if not model:
            raise ValueError("--train-lora plans a model's training step: give a MODEL")
        return _train_report(model, args)
    if args.graph:
        from ggraph.tools.dot import user_graph

        graph = user_graph(args.graph)[0]
    elif model:
        graph = _model_graph(model, args)
    else:
        graph = attention_graph(args.n_head, args.n_head_kv, args.head_dim, args.n_tokens,
                                args.n_kv, args.kv_type, args.amb, args.fa, args.max_bias)
    allocator = GraphAllocator(alignment=args.alignment or registry.alignment(args.backend),
                               strategy=args.strategy, max_bytes=args.max_bytes,
                               name=args.backend.upper())
    try:
        plan = allocator.reserve(graph)
    except AllocError as e:
        if e.plan is not None:  # show what was planned before the failure
            print(R.format_report(e.plan, top=args.top))
            _write(R, e.plan, args)
        raise
    print(R.format_report(plan, top=args.top))
    _write(R, plan, args)
    return 0


def _train_report(model: str, args: argparse.Namespace) -> int:
    """One LoRA training step's plan (the report of the plain step), then what it holds
    with and without checkpointing."""
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.train.lora import LoraFinetune, LoraSettings
    from ggraph.graphs.train.memory import step_memory
    from ggraph.pictures import alloc_report as R

    n_ctx = args.n_tokens if args.n_tokens != _default_ubatch() else 256
    path = resolve_model(model)
    targets = tuple(x.strip() for x in args.lora_targets.split(",") if x.strip())
    alignment = args.alignment or registry.alignment(args.backend)
    out = []
    for ck in (False, True):
        st = LoraSettings(rank=args.lora_r, targets=targets, n_ctx=n_ctx, checkpoint=ck)
        ft = LoraFinetune.create(path, st, backend=None)
        if not ck:
            plan = GraphAllocator(alignment=alignment, name=args.backend.upper()).reserve(
                ft.trainer.step_graph)
            print(R.format_report(plan, top=args.top))
            _write(R, plan, args)
        out.append(step_memory(ft.trainer, alignment))
    print(f"\nLoRA training step of {os.path.basename(path)}: window {n_ctx} tokens, rank "
          f"{args.lora_r} on {', '.join(targets)}")
    for mem, label in zip(out, ("without checkpointing", "with checkpointing")):
        print("\n".join(mem.lines(label)))
    saved = 1 - out[1].compute / out[0].compute
    print(f"checkpointing saves {saved:.1%} of the compute buffer")
    return 0


def _default_ubatch() -> int:
    from ggraph.tools.common.defaults import N_UBATCH

    return N_UBATCH


def _write(R: Any, plan: Any, args: argparse.Namespace) -> None:
    if args.json:
        R.write_json(plan, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png:
        R.render_png(plan, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
