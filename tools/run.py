"""`ggraph run`: generate text with a GGUF model, as llama-cli does.

MODEL is a path or a model name (`default` = smollm2, `gemma3`), given positionally or with
`-m`. llama-cli's spellings work: `-p`/`-f`/`-sys`, `-n`, `-c`, `-b`, `-ub`, `-fa on|off|auto`,
`-ctk`/`-ctv`, `-t`, `-amb` (ik_llama.cpp's split attention), the sampling flags (`--temp`,
`--top-k`, `--top-p`, `--min-p`, `--typical`, `--repeat-penalty`, `--repeat-last-n`,
`--frequency-penalty`, `--presence-penalty`, `--seed`, ...; `--temp 0` is greedy) and
`-cnv`/`-i` (an interactive chat that keeps the KV cache between turns).

`--dump-tensors REGEX` prints every graph node whose name the pattern finds as it is computed
(its op, type, shape, a few values and their sum), as llama.cpp's llama-eval-callback does.

`-np N` generates N sequences together in one KV cache (llama-parallel): the lines of `-f`
as N prompts at a time, or N samples of `-p` (seed, seed + 1, ...); each sequence's text is
printed when all are done.

`-md DRAFT` generates with speculative decoding (graphs/runtime/speculative.py): the draft
model proposes up to `--spec-draft-n-max` tokens (default 3; `--spec-draft-n-min`,
`--draft-p-min` as llama.cpp's), the model checks them in one batch, and the text is the
model's own (greedy: token for token). llama-speculative-simple's acceptance figures follow
the timings.

Messages come in llama.cpp's order: the memory lines at load (stderr), then the text (stdout),
then llama_perf's timings (stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any, Iterator

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text with a GGUF model (llama-cli's flags)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL",
                   help="the same as the positional MODEL (llama.cpp's spelling)")
    io = p.add_argument_group("prompt")
    io.add_argument("-p", "--prompt", default=None)
    io.add_argument("-f", "--file", help="read the prompt from a file")
    io.add_argument("-sys", "--system-prompt", default=None,
                    help="a system message (chat template)")
    io.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    io.add_argument("-cnv", "--conversation", action="store_true",
                    help="interactive chat: read turns from stdin, keep the KV cache")
    io.add_argument("-i", "--interactive", action="store_true",
                    help="the same as -cnv here")
    io.add_argument("-no-cnv", "--no-conversation", action="store_true",
                    help="no chat (the default)")
    io.add_argument("-e", "--escape", action="store_true", default=True,
                    help="process escapes (\\n, \\t, \\xHH) in the prompt (the default, as in "
                         "llama.cpp)")
    io.add_argument("--no-escape", dest="escape", action="store_false")
    io.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                    help="stop generating when the text ends with TEXT (repeatable)")
    io.add_argument("-st", "--single-turn", action="store_true",
                    help="-cnv: answer the first turn, then exit")
    io.add_argument("--jinja", action="store_true",
                    help="accepted: chat templates always render with jinja (sandboxed)")
    p.add_argument("-n", "--n-predict", type=int, default=32,
                   help="tokens to generate (default 32; -1: until an end-of-generation token, "
                        "shifting the context as it fills; -2: until the context is full)")
    from ggraph.tools.common.defaults import (N_BATCH, add_context_flags, add_flash_attn_flag,
                                              add_load_flags, add_lora_flags,
                                              add_swa_full_flag,
                                              add_threads_flag)

    m = p.add_argument_group("context and memory")
    add_context_flags(m)
    m.add_argument("-b", "--batch-size", type=int, default=N_BATCH,
                   help="logical batch (llama.cpp: the ubatch is at most this)")
    m.add_argument("-amb", "--attention-max-batch", "--amb", dest="amb", type=int, default=0,
                   metavar="MIB", help="split attention so K*Q stays under MIB (0: off)")
    m.add_argument("-ctk", "--cache-type-k", default="f16")
    m.add_argument("-ctv", "--cache-type-v", default="f16")
    add_flash_attn_flag(m)
    add_swa_full_flag(m)
    m.add_argument("--keep", type=int, default=0, metavar="N",
                   help="tokens of the prompt kept when the context shifts (default 0; -1: all; "
                        "the BOS token is always kept)")
    m.add_argument("--context-shift", dest="context_shift", action="store_true", default=True,
                   help="when the context fills, discard half of it after the kept tokens and "
                        "go on (the default, as llama-cli)")
    m.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop generating when the context is full")
    add_load_flags(m)
    add_lora_flags(m)
    m.add_argument("--reserve-outputs", choices=("all", "last"), default="all",
                   help="size the compute buffer for every token's logits (llama.cpp) or the "
                        "last token's only")
    m.add_argument("--strategy", default="default", choices=("default", "ggml"))
    d = p.add_argument_group("devices")
    d.add_argument("--backend", default="cpu")
    add_threads_flag(d)
    d.add_argument("--ggml-exact", action="store_true",
                   help="compute as ggml's CPU does, bit for bit (slower; the logits equal "
                        "llama.cpp's)")
    d.add_argument("--devices", default="", metavar="LIST",
                   help="offload devices beside the host CPU, e.g. cuda or cuda,cuda ('cpu' "
                        "adds a second CPU backend); layers are placed as llama.cpp does")
    d.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=-1,
                   help="with --devices: layers to offload, the output layer counting as one "
                        "(default: all)")
    d.add_argument("-ts", "--tensor-split", metavar="SHARES",
                   help="with --devices: layer shares per device, e.g. 3,1")
    d.add_argument("--check-tensors", action="store_true",
                   help="check model tensor data for invalid values")
    d.add_argument("--profile", action="store_true",
                   help="time every graph node of the prompt and the generation and print a "
                        "table per op and per node name (ggml's perf output)")
    d.add_argument("--dump-tensors", metavar="REGEX", default=None,
                   help="print each graph node whose name REGEX finds (re.search), as it is "
                        "computed: op, type, shape, leading and trailing values and their sum "
                        "(llama-eval-callback's format)")
    d.add_argument("--no-warmup", action="store_true",
                   help="skip the warmup run at load (kernels then compile, on a first run, "
                        "inside the prompt's time)")
    p.add_argument("-np", "--parallel", type=int, default=1, metavar="N",
                   help="generate N sequences together: the lines of -f, N at a time, or N "
                        "samples of -p (default 1)")
    s = p.add_argument_group("speculative decoding (llama.cpp's draft model flags)")
    from ggraph.tools.common.defaults import add_draft_flags

    add_draft_flags(s, "draft model (a path or a model name) sharing the vocabulary")
    for old, new in (("--draft-max", "--spec-draft-n-max"), ("--draft-min",
                                                             "--spec-draft-n-min")):
        s.add_argument(old, dest=f"removed_{old[2:].replace('-', '_')}", default=None,
                       help=f"removed in llama.cpp: use {new}")
    d.add_argument("--list-devices", action="store_true", help="list the backends and exit")
    d.add_argument("--version", action="store_true", help="print the version and exit")
    add_sampling_args(p)
    p.set_defaults(func=main)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags (graphs/runtime/sampling.py's SamplerParams, its CLI_FLAGS)."""
    from ggraph.graphs.runtime.sampling import CLI_FLAGS, SamplerParams

    g = p.add_argument_group("sampling (llama.cpp's chain; --temp 0: greedy)")
    defaults = SamplerParams()
    for field, flag in CLI_FLAGS.items():
        if field in ("samplers", "dry_multiplier", "mirostat"):
            continue
        v = getattr(defaults, field)
        g.add_argument(flag, dest=f"s_{field}", type=type(v) if not isinstance(v, bool) else int,
                       default=None, help=f"default {v}")
    g.add_argument("--sampler-seq", "--sampling-seq", dest="s_seq", default=None,
                   help="sampler order as letters, e.g. edskypmxt")
    from ggraph.tools.common.grammar_flags import add_grammar_args
    add_grammar_args(p)


def sampler_params(args: argparse.Namespace) -> Any:
    from ggraph.graphs.runtime.sampling import SamplerParams, samplers_from_chars
    from ggraph.tools.common.grammar_flags import grammar_text

    kw = {k[2:]: v for k, v in vars(args).items()
          if k.startswith("s_") and k != "s_seq" and v is not None}
    if args.s_seq:
        kw["samplers"] = samplers_from_chars(args.s_seq)
    return SamplerParams(**kw, grammar=grammar_text(args))


def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that cannot work, before the model loads (one-line errors)."""
    from ggraph.tools.common.defaults import SIZE_BOUNDS, check_bounds, check_threads

    check_bounds(args, {**SIZE_BOUNDS, "batch_size": ("-b/--batch-size", 1, ""), "n_predict": (
        "-n/--n-predict", -2, " (-1: until an end-of-generation token, -2: until the context "
        "is full)")})
    check_threads(args.threads, args.backend)
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models given: {args.model!r} and -m {args.model_opt!r}")
    if args.prompt is not None and args.file:
        raise ValueError("give the prompt with -p or -f, not both")
    for old, new in (("draft_max", "--spec-draft-n-max"), ("draft_min", "--spec-draft-n-min")):
        if getattr(args, f"removed_{old}", None) is not None:
            raise ValueError(f"--{old.replace('_', '-')} was removed (as in llama.cpp); use "
                             f"{new}")
    if args.parallel < 1:
        raise ValueError(f"-np/--parallel must be >= 1, got {args.parallel}")
    if args.parallel > 1 and (args.conversation or args.interactive or args.model_draft):
        raise ValueError("-np generates from prompts (-p/-f); not with -cnv or -md")
    if args.dump_tensors is not None and (args.parallel > 1 or args.model_draft or
                                          args.conversation or args.interactive or args.profile):
        raise ValueError("--dump-tensors watches one prompt's generation: not with -np, -md, "
                         "-cnv or --profile")
    if args.model_draft and (args.conversation or args.interactive):
        raise ValueError("-md drafts for a prompt (-p/-f); the interactive chat does not "
                         "speculate yet")


def list_devices() -> list[str]:
    """llama.cpp's --list-devices: the backends this machine can run."""
    from ggraph.backends import get_backend

    lines = ["Available devices:"]
    for kind in ("cpu", "cuda"):
        try:
            b = get_backend(kind)
        except (RuntimeError, ValueError, OSError, ImportError) as e:
            lines.append(f"  {kind.upper()}: unavailable ({str(e).splitlines()[0][:100]})")
            continue
        lines.append(f"  {kind.upper()}: {getattr(b, 'description', b.__class__.__name__)}")
    return lines


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig `ggraph run` loads with (options checked first; warnings for options
    that are changed or ignored)."""
    from ggraph.graphs.runtime.engine import EngineConfig
    from ggraph.graphs.deploy.placement import parse_split

    from ggraph.tools.common.defaults import flash_attn_on, lora_config

    check_options(args)
    amb = args.amb
    if 0 < amb < 128:
        print(f"warning: -amb {amb} raised to 128 MiB (as ik_llama.cpp does)", file=sys.stderr)
        amb = 128
    split = parse_split(args.tensor_split)
    if not args.devices and (split or args.n_gpu_layers != -1):
        # llama.cpp without a GPU backend warns and runs on the CPU; so does ggraph
        print("warning: no offload devices given (--devices cuda); -ngl/--tensor-split are "
              "ignored and every layer runs on the CPU", file=sys.stderr)
        split, args.n_gpu_layers = [], -1
    return EngineConfig(n_ctx=args.ctx_size, n_ubatch=min(args.ubatch_size, args.batch_size),
                        type_k=args.cache_type_k, type_v=args.cache_type_v,
                        flash_attn=flash_attn_on(args.fa, args.backend),
                        amb_mib=amb, swa_full=args.swa_full, backend=args.backend,
                        strategy=args.strategy,
                        n_threads=args.threads, reserve_outputs=args.reserve_outputs,
                        devices=args.devices, ggml_exact=args.ggml_exact,
                        n_gpu_layers=args.n_gpu_layers,
                        tensor_split=tuple(split) if split else None,
                        check_tensors=args.check_tensors, warmup=not args.no_warmup,
                        n_seq_max=args.parallel,
                        use_mmap=args.mmap, use_mlock=args.mlock, loras=lora_config(args))


def n_keep(args: argparse.Namespace, eng: Any, prompt: list[int]) -> int | None:
    """llama-cli's n_keep: --keep N tokens of the prompt and the BOS token, every token with
    -1 or more than the prompt has; None with --no-context-shift."""
    if not args.context_shift:
        return None
    tok = eng.tokenizer
    if args.keep < 0 or args.keep > len(prompt):
        return len(prompt)
    return args.keep + int(bool(prompt) and prompt[0] == tok.bos and tok.add_bos)


def main(args: argparse.Namespace) -> int:
    if args.version:
        import ggraph

        print(f"ggraph {ggraph.__version__}")
        return 0
    if args.list_devices:
        print("\n".join(list_devices()))
        return 0
    from ggraph.tools.common.cli_text import argv_text, process_escapes
    from ggraph.graphs.runtime.engine import Engine
    from ggraph.graphs.gguf.fetch import resolve_model

    cfg = engine_config(args)
    sampling = sampler_params(args)
    observe = None
    if args.dump_tensors is not None:
        from ggraph.tools.common.tensor_dump import TensorDump

        observe = TensorDump.of(args.dump_tensors).observer
    path = resolve_model(args.model_opt or args.model or "default")
    if args.parallel > 1:
        from ggraph.tools.common.parallel_text import run_parallel

        return run_parallel(args, cfg, sampling, path)
    if args.file:
        with open(args.file, encoding="utf-8", errors="replace") as f:
            user = f.read()
    else:
        user = argv_text(args.prompt if args.prompt is not None else "The capital of France is")
        user = process_escapes(user) if args.escape else user
    t0 = time.perf_counter()
    if cfg.warmup and sys.stderr.isatty():  # a first run compiles: say so before the wait
        print("load: warming up (the first run compiles the kernels, then numba caches them)",
              file=sys.stderr, flush=True)
    eng = Engine(path, cfg, progress=sys.stderr.isatty())  # GGUFError: one line (ggraph.cli)
    load_s = time.perf_counter() - t0
    from ggraph.tools.common.run_loop import Conversation, Limits, generate_text, perf_lines, prompt_ids

    interactive = args.conversation or args.interactive
    notes = eng.load_notes()
    if (interactive or args.chat) and eng.tokenizer.template is None:
        notes.append(f"warning: {os.path.basename(path)} has no chat template "
                     f"(tokenizer.chat_template): the chat falls back to ChatML "
                     f"(<|im_start|>role ... <|im_end|>), which this model may not know")
    if not interactive:  # a prompt without tokens fails before anything is printed
        n_ctx = eng.cfg.n_ctx
        text = eng.tokenizer.chat(user, args.system_prompt,
                                  max_chars=eng.tokenizer.chars_for(n_ctx)) \
            if args.chat else user
        ids = prompt_ids(eng, path, user, text)
    if sampling.grammar:   # a grammar that does not parse or compile fails before any output
        from ggraph.graphs.grammar.constraint import start_grammar
        start_grammar(sampling.grammar, eng.tokenizer)
    # llama.cpp's load messages once the prompt is known to be good: an error stays one line
    for line in notes + eng.memory_lines():   # on a terminal or not
        print(line, file=sys.stderr)
    spec = None
    if args.model_draft:
        from ggraph.graphs.runtime.speculative import SpecParams, Speculator

        params = SpecParams(args.spec_draft_n_max, args.spec_draft_n_min, args.draft_p_min)
        draft = Engine(resolve_model(args.model_draft), cfg)
        spec = Speculator(eng, draft, params)
    with profiled(eng, args.profile) as prof:
        if spec is not None:
            status = generate_text(eng, user, ids, Limits(args.n_predict, None), sampling,
                                   echo=not args.chat, stops=args.reverse_prompt, spec=spec)
        elif interactive:
            bos = eng.tokenizer.bos  # a chat starts with BOS (llama-cli keeps it)
            first = [bos] if eng.tokenizer.add_bos and bos is not None else []
            status = Conversation(eng, sampling, args.system_prompt,
                                  Limits(args.n_predict, n_keep(args, eng, first)),
                                  args.reverse_prompt).loop(
                first=user if (args.prompt is not None or args.file) else None,
                single_turn=args.single_turn)
        else:
            status = generate_text(eng, user, ids, Limits(args.n_predict,
                                                          n_keep(args, eng, ids)),
                                   sampling, echo=not args.chat, stops=args.reverse_prompt,
                                   observe=observe)
    if prof is not None:
        print("\n".join(prof.table()), file=sys.stderr)
        print("\n".join(prof.table(by="name", top=15)), file=sys.stderr)
    for line in perf_lines(eng, load_s):
        print(line, file=sys.stderr)
    if spec is not None:
        print("\n".join(["", *spec.stats.lines(spec.params.n_max)]), file=sys.stderr)
    return status


@contextlib.contextmanager
def profiled(eng: Any, on: bool) -> Iterator[Any]:
    """A Profile attached to the engine's runner while generating (None when off)."""
    if not on:
        yield None
        return
    from ggraph.backends.profile import Profile

    prof = Profile()
    try:
        ctx = prof.attach(eng.runner)
    except TypeError as e:  # several devices: their sessions have no profile slot yet
        raise ValueError(f"--profile: {e}") from None
    with ctx:
        yield prof
