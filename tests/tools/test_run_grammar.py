"""`ggraph run` with llama.cpp's grammar flags: --grammar, --grammar-file, -j/--json-schema,
-jf/--json-schema-file give output that follows them; bad ones are one-line errors."""
from __future__ import annotations

import json
import re

import pytest

from ggraph.cli import main
from test_cli_errors import fails

pytest.importorskip("llguidance", reason="grammars are the ggraph[grammar] extra")

RUN = ["run", "default", "-c", "256", "--seed", "5"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1}},
          "required": ["city", "rank"], "additionalProperties": False}


def generated(capsys, *argv: str) -> str:
    assert main([*RUN, *argv]) == 0
    out = capsys.readouterr().out
    return out


def test_grammar_and_file(capsys, tmp_path):
    g = 'root ::= (" " [A-Z] [a-z]+ ","){2} " done."\n'
    out = generated(capsys, "-p", "Name two cities:", "-n", "40", "--grammar", g)
    assert re.fullmatch(r"Name two cities:( [A-Z][a-z]+,){2} done\.\s*", out), out
    f = tmp_path / "g.gbnf"
    f.write_text(g)
    assert generated(capsys, "-p", "Name two cities:", "-n", "40", "--grammar-file",
                     str(f)) == out


def test_json_schema_and_file(capsys, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    prompt = "A city as JSON:"
    out = generated(capsys, "-p", prompt, "-n", "60", "-j", json.dumps(SCHEMA))
    jsonschema.validate(json.loads(out[len(prompt):]), SCHEMA)
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    assert generated(capsys, "-p", prompt, "-n", "60", "-jf", str(f)) == out


@pytest.mark.parametrize("argv, says", [
    (["--grammar", 'root ::= "a', "-j", "{}"], "give one of --grammar"),
    (["--grammar", 'root ::= "a'], "grammar line 1 col 10: unterminated string"),
    (["--grammar", 'root ::= x'], "undefined rule 'x'"),
    (["--grammar", "  "], "the grammar is empty"),
    (["--grammar-file", "/nonexistent.gbnf"], "--grammar-file /nonexistent.gbnf:"),
    (["-j", "{not json"], "--json-schema:"),
    (["-j", '{"$ref": "#/definitions/nope"}'], "--json-schema:"),
])
def test_bad_grammar_flags(capsys, argv, says):
    line = fails(capsys, *RUN, "-n", "2", *argv)
    assert says in line, line


def test_grammar_with_a_draft_model_and_with_parallel_sequences(capsys):
    """-md: the target's sampler (with the grammar) checks every drafted token, so the text is
    the one without a draft; -np: every sequence follows the grammar."""
    g = 'root ::= " " [0-9]+ (", " [0-9]+){3} "."\n'
    args = ("-p", "Four prime numbers:", "-n", "40", "--temp", "0", "--grammar", g)
    plain = generated(capsys, *args)
    assert re.fullmatch(r"Four prime numbers: [0-9]+(, [0-9]+){3}\.\s*", plain), plain
    assert generated(capsys, *args, "-md", "default", "--spec-draft-n-max", "4") == plain
    out = generated(capsys, "-np", "3", "-p", "Four numbers:", "-n", "40", "--grammar", g)
    texts = [t.split("\n", 1)[1].strip() for t in out.split("Sequence ")[1:]]
    assert len(texts) == 3
    for t in texts:
        assert re.fullmatch(r"Four numbers: [0-9]+(, [0-9]+){3}\.", t), t
