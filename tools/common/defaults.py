"""The model options the subcommands share, and how each one resolves: one place, so that
`ggraph plan FILE -c 8192` predicts the buffers `ggraph run FILE -c 8192` allocates and
`ggraph dot` draws the graph `run` executes.

- `-c/--ctx-size` (default N_CTX, llama-cli's 4096; perplexity's chunk default is 512, as
  llama-perplexity is run) and `-ub/--ubatch-size` (N_UBATCH): at least 1;
- `-fa/--flash-attn on|off|auto` (default auto): auto is on wherever the backend runs flash
  attention, as llama.cpp resolves it, and every ggraph backend (CPU, CUDA) runs it;
- `-t/--threads N`: at least 1 (as llama-bench refuses 0) and at most the threads numba may
  start; unset is every core numba may use;
- `--no-mmap` and `--mlock` for the commands that load a model's weights;
- `--lora FNAME[,...]` and `--lora-scaled FNAME:SCALE[,...]` (llama.cpp's common/arg.cpp
  syntax, each repeatable) for run, perplexity and serve: EngineConfig.loras.

This module has no `register`: the command line (ggraph/cli.py) imports it but adds no
subcommand for it.
"""
from __future__ import annotations

import argparse
from typing import Any

N_CTX = 4096          # llama-cli's -c
N_CTX_PERPLEXITY = 512  # perplexity's chunk: llama-perplexity's published figures use -c 512
N_UBATCH = 512        # llama.cpp's -ub
N_BATCH = 2048        # llama.cpp's -b
FLASH_ATTN = "auto"   # llama.cpp's -fa

# option bounds the subcommands share: attribute -> (flag, smallest value, what it means)
SIZE_BOUNDS: dict[str, tuple[str, float, str]] = {
    "ctx_size": ("-c/--ctx-size", 1, ""),
    "ubatch_size": ("-ub/--ubatch-size", 1, ""),
    "amb": ("--amb", 0, " MiB (0: attention is not split)"),
}


def add_context_flags(parser: Any, n_ctx: int | None = N_CTX,
                      ctx_help: str = "context size in tokens") -> None:
    """-c/--ctx-size and -ub/--ubatch-size with the shared defaults."""
    parser.add_argument("-c", "--ctx-size", type=int, default=n_ctx,
                        help=ctx_help if n_ctx is None else f"{ctx_help} (default {n_ctx})")
    parser.add_argument("-ub", "--ubatch-size", type=int, default=N_UBATCH,
                        help=f"physical batch: tokens per graph (default {N_UBATCH})")


def add_flash_attn_flag(parser: Any) -> None:
    """llama.cpp's `-fa on|off|auto` (also `--flash-attn` and `--fa`; the flag alone means
    on) into args.fa; `flash_attn_on(args.fa)` resolves it."""
    parser.add_argument("-fa", "--flash-attn", "--fa", dest="fa", nargs="?", const="on",
                        default=FLASH_ATTN, choices=("on", "off", "auto"),
                        help=f"flash attention: on, off or auto (default {FLASH_ATTN}: on "
                             f"where the backend runs it, as llama.cpp resolves it; every "
                             f"ggraph backend does)")


def add_swa_full_flag(parser: Any) -> None:
    """llama.cpp's --swa-full into args.swa_full: a sliding-window cache of the whole context
    (EngineConfig.swa_full; planned the same by `ggraph plan`)."""
    parser.add_argument("--swa-full", action="store_true",
                        help="full-size cache for sliding-window layers (llama.cpp's "
                             "--swa-full: n_ctx cells instead of n_swa + n_ubatch)")


def flash_attn_on(value: str | bool, backend: str = "cpu") -> bool:
    """-fa resolved: on and auto are on (every ggraph backend runs flash attention)."""
    if isinstance(value, bool):
        return value
    if value not in ("on", "off", "auto"):
        raise ValueError(f"-fa/--flash-attn must be on, off or auto, got {value!r}")
    return value != "off"


def add_load_flags(parser: Any) -> None:
    """llama.cpp's --no-mmap and --mlock into args.mmap and args.mlock (EngineConfig's
    use_mmap and use_mlock)."""
    parser.add_argument("--no-mmap", dest="mmap", action="store_false", default=True,
                        help="read the model into memory instead of mapping it (the file can "
                             "then change under the run)")
    parser.add_argument("--mlock", action="store_true",
                        help="keep the model in RAM (never swapped out or dropped from the "
                             "page cache)")


def add_lora_flags(parser: Any) -> None:
    """llama.cpp's --lora and --lora-scaled into args.lora and args.lora_scaled (lists of
    the values given); `lora_config(args)` resolves them."""
    parser.add_argument("--lora", action="append", default=[], metavar="FNAME",
                        help="LoRA adapter (comma-separated values to load several; "
                             "repeatable)")
    parser.add_argument("--lora-scaled", action="append", default=[],
                        metavar="FNAME:SCALE", help="LoRA adapter with a user scale "
                        "(format FNAME:SCALE, comma-separated values; repeatable)")


def lora_config(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--lora (scale 1) then --lora-scaled adapters as EngineConfig.loras; a malformed
    --lora-scaled is a one-line ValueError."""
    from ggraph.graphs.models.lora_gguf import parse_lora_flags

    return tuple(parse_lora_flags(getattr(args, "lora", None) or (),
                                  getattr(args, "lora_scaled", None) or ()))


def add_threads_flag(parser: Any) -> None:
    parser.add_argument("-t", "--threads", type=int, default=None,
                        help="CPU threads (>= 1; default: every core numba may use)")


def check_threads(threads: int | None, backend: str = "cpu") -> int | None:
    """-t resolved: None (every core) or a count from 1 to numba's thread limit."""
    if threads is None:
        return None
    if threads < 1:
        raise ValueError(f"-t/--threads must be >= 1, got {threads}")
    from ggraph.backends import registry

    if registry.kind(backend).threads:
        import numba

        if threads > numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"-t {threads}: numba runs at most "
                             f"{numba.config.NUMBA_NUM_THREADS} threads on this machine "
                             f"(NUMBA_NUM_THREADS)")
    return threads


def check_bounds(args: argparse.Namespace, bounds: dict[str, tuple[str, float, str]]) -> None:
    """A one-line ValueError for the first option below its smallest value (None: unset)."""
    for attr, (flag, lo, meaning) in bounds.items():
        v = getattr(args, attr, None)
        if v is not None and v < lo:
            raise ValueError(f"{flag} must be >= {lo}{meaning}, got {v}")


def add_draft_flags(group: Any, draft_help: str) -> None:
    """llama.cpp's draft model flags (-md, --spec-draft-n-max/-n-min, --draft-p-min), shared
    by `ggraph run` and `ggraph serve`."""
    group.add_argument("-md", "--model-draft", default=None, metavar="MODEL", help=draft_help)
    group.add_argument("--spec-draft-n-max", type=int, default=3, metavar="N",
                       help="most tokens drafted per step (default 3)")
    group.add_argument("--spec-draft-n-min", type=int, default=0, metavar="N",
                       help="a shorter draft is dropped (default 0)")
    group.add_argument("--draft-p-min", type=float, default=0.0, metavar="P",
                       help="stop drafting below this probability (default 0.0)")
