"""The `ggraph` console command. Each subcommand lives in a module of ggraph.tools that
defines `register(subparsers)`; this file only discovers and dispatches them (the options
several subcommands share and how they resolve are tools/common/defaults.py's; the text helpers the
commands share, one-line errors among them, are tools/common/cli_text.py's)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Sequence

from ggraph.tools.common.cli_text import fail


def build_parser() -> argparse.ArgumentParser:
    import ggraph.tools as tools

    import ggraph

    parser = argparse.ArgumentParser(prog="ggraph", description="ggml-style compute graphs: "
                                     "plan memory, run and inspect graphs")
    parser.add_argument("--version", action="version", version=f"ggraph {ggraph.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(tools.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"ggraph.tools.{info.name}")
        if hasattr(mod, "register"):
            mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `ggraph report | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, KeyError, OSError) as e:  # user errors: one line, no traceback
        fail(args.command, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
