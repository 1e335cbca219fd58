"""Constrained output: llama.cpp's GBNF grammars and JSON schemas as a token mask per step.

Rooms: `gbnf` (the grammar language, parsed as llama.cpp parses it), `json_schema` (a JSON
Schema written as the GBNF llama.cpp's json_schema_to_grammar writes), `lark` (a parsed
grammar written for the llguidance engine so that it accepts exactly the same texts), and
`constraint` (the engine per sequence: a mask over the vocabulary, accept, rollback). The engine
is the optional `ggraph[grammar]` extra; nothing here imports it until a grammar is used.
"""
