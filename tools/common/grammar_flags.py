"""llama.cpp's grammar flags (--grammar, --grammar-file, -j/--json-schema, -jf/--json-schema-file)
for the tools that sample, read into the GBNF text the sampler takes."""
from __future__ import annotations

import argparse
import os

from ggraph.graphs.grammar.gbnf import MAX_GRAMMAR_CHARS


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("constrained output (llama.cpp's grammar flags; needs "
                             "ggraph[grammar])")
    g.add_argument("--grammar", default=None, metavar="GBNF",
                   help="a GBNF grammar the output must follow (llama.cpp's syntax)")
    g.add_argument("--grammar-file", default=None, metavar="FILE",
                   help="read the GBNF grammar from a file")
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="a JSON Schema the output must follow, e.g. '{}' for any JSON")
    g.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE",
                   help="read the JSON Schema from a file")


def _read(path: str, flag: str) -> str:
    try:
        size = os.path.getsize(path)
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{flag} {path}: {size} bytes; at most {MAX_GRAMMAR_CHARS} are read")
        with open(path, "rb") as f:
            data = f.read(MAX_GRAMMAR_CHARS + 1)
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 at byte {e.start}") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None


def grammar_text(args: argparse.Namespace) -> str:
    """The GBNF the flags give ("" for none); a JSON Schema is converted as llama.cpp's
    json_schema_to_grammar does. More than one of the four is an error."""
    given = [(f, v) for f, v in (("--grammar", args.grammar), ("--grammar-file", args.grammar_file),
                                 ("--json-schema", args.json_schema),
                                 ("--json-schema-file", args.json_schema_file)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of --grammar, --grammar-file, --json-schema, "
                         f"--json-schema-file; got {', '.join(f for f, _ in given)}")
    if not given:
        return ""
    flag, value = given[0]
    if flag.endswith("-file"):
        value = _read(value, flag)
    if flag.startswith("--json-schema"):
        from ggraph.graphs.grammar.json_schema import SchemaError, schema_to_gbnf
        try:
            return schema_to_gbnf(value)
        except SchemaError as e:
            raise ValueError(f"{flag}: {e}") from None
    if not value.strip():
        raise ValueError(f"{flag}: the grammar is empty")
    return value
