"""`ggraph tokenize`: llama.cpp's llama-tokenize. Prints the token ids of a prompt or file as
llama-tokenize does, one `id -> 'piece'` line per token (pieces are the raw bytes, control
tokens included) or with --ids the Python-style list. Only the GGUF header is read: the
tokenizer never needs the weights. Differences from llama-tokenize: a -f file is read verbatim
(llama-tokenize also applies escapes to it); -p applies escapes (\\n, \\t, ...) as it does.
"""
from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="print a text's token ids (llama-tokenize)",
                       description=__doc__)
    p.add_argument("-m", "--model", default="default",
                   help="GGUF path or a model name: default (= smollm2), smollm2, gemma3")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the text (escapes such as \\n are processed)")
    src.add_argument("-f", "--file", help="a file whose bytes are the text (verbatim)")
    src.add_argument("--stdin", action="store_true", help="read the text from standard input")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a list")
    p.add_argument("--no-bos", action="store_true",
                   help="no BOS token even where the model adds one")
    p.add_argument("--no-parse-special", action="store_true",
                   help="control tokens written in the text are plain text")
    p.add_argument("--show-count", action="store_true", help="print the number of tokens")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ggraph.tools.common.cli_text import argv_text, process_escapes
    from ggraph.graphs.gguf.fetch import resolve_model
    from ggraph.graphs.gguf.gguf_reader import read_header
    from ggraph.graphs.tokenizers.tokenizer import Tokenizer

    if args.file is not None:
        with open(args.file, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    elif args.stdin:
        text = sys.stdin.buffer.read().decode("utf-8", "replace")
    elif args.prompt is not None:
        text = process_escapes(argv_text(args.prompt))
    else:
        raise ValueError("give the text with -p PROMPT, -f FILE or --stdin")
    path = resolve_model(args.model)
    tok = Tokenizer(read_header(path).metadata, path)
    ids = tok.encode(text, add_bos=tok.add_bos and not args.no_bos,
                     special=not args.no_parse_special)
    out = sys.stdout.buffer
    if args.ids:
        out.write(("[" + ", ".join(str(i) for i in ids) + "]\n").encode())
    else:
        for i in ids:
            out.write(f"{i:6d} -> '".encode() + tok.piece(i, special=True) + b"'\n")
    if args.show_count:
        out.write(f"Total number of tokens: {len(ids)}\n".encode())
    out.flush()
    return 0
