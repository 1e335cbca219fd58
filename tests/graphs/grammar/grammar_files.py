"""llama.cpp's grammar files, read where they are: its source tree (GGRAPH_LLAMACPP_SRC, default
~/.cache/llamacpp-tools/src, which ../shared/tools/llamacpp-tools.sh unpacks) or, for the seven
that llama-cpp-python carries as constants, from the installed llama_cpp package. Nothing of
llama.cpp's is copied into this repository."""
from __future__ import annotations

import os
from pathlib import Path

NAMES = ("arithmetic", "c", "chess", "english", "japanese", "json", "json_arr", "list")
_CONSTANTS = {"arithmetic": "ARITHMETIC_GBNF", "c": "C_GBNF", "chess": "CHESS_GBNF",
              "japanese": "JAPANESE_GBNF", "json": "JSON_GBNF", "json_arr": "JSON_ARR_GBNF",
              "list": "LIST_GBNF"}


def source_tree() -> Path:
    return Path(os.environ.get("GGRAPH_LLAMACPP_SRC",
                               Path.home() / ".cache" / "llamacpp-tools" / "src"))


def grammar_files() -> dict[str, str]:
    """name -> GBNF text, for those found."""
    out: dict[str, str] = {}
    d = source_tree() / "grammars"
    for name in NAMES:
        f = d / f"{name}.gbnf"
        if f.is_file():
            out[name] = f.read_text(encoding="utf-8")
    try:
        import llama_cpp.llama_grammar as lg
    except ImportError:
        return out
    for name, const in _CONSTANTS.items():
        if name not in out and isinstance(getattr(lg, const, None), str):
            out[name] = getattr(lg, const)
    return out
