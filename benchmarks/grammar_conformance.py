"""Constrained output checked by llama.cpp's own grammar (the issue's must-shows): sampled
generation under each of llama.cpp's grammar files and under JSON schemas, every output
checked by the reference.

Grammar files: per model (-m, default SmolLM2 135M and Qwen2.5-Coder 0.5B) and each of
llama.cpp's 8 grammar files (arithmetic, c, chess, english, japanese, json, json_arr, list),
--seeds (20) sampled generations with llama.cpp's default chain (temp 0.8, top-k 40, top-p
0.95, min-p 0.05; seeds 1..N) of up to -n (96) tokens after a short prompt that fits the
grammar, the seeds generated together (graphs/runtime/parallel.py, waves of --np). Each
output goes through llama.cpp's grammar sampler (llama-cpp-python, tests/llama_grammar_ref.py):
one that ended with an end-of-generation token must be accepted whole (every token allowed
when it came, the end allowed where it came); one cut by the length limit must have had every
token allowed. Per row: accepted/N, how many ended by the grammar (eog) or by length, mean
tokens, full masks per token (the sampler's rejection scheme: a draw the grammar refuses
costs one mask over the whole vocabulary) and the seconds.

JSON schemas: 6 schemas (required and optional fields, enums, arrays with min/maxItems,
nested objects, string patterns, integer bounds) converted by graphs/grammar/json_schema.py,
--schema-runs (50) generations each on the first model after a chat prompt asking for that
JSON, up to --schema-n (160) tokens. Every output that ended by end-of-generation must parse
and pass jsonschema.validate (and llama.cpp's grammar); an output cut by the length limit is
reported in its own column, not counted invalid.

    python benchmarks/grammar_conformance.py [-m default,qwen2.5-coder-0.5b] [--seeds 20]
        [-n 96] [--schema-runs 50] [--schema-n 160] [--np 10] [-t 2] [--skip-files]
        [--skip-schemas] [-o benchmarks/results/grammar_conformance.json]

Needs llguidance (ggraph[grammar]), llama-cpp-python (the reference), jsonschema and
llama.cpp's grammar files (tests/graphs/grammar/grammar_files.py finds them). Tables on stdout;
the JSON holds every output's text, token ids (a line of text) and verdict with the run
record; a markdown copy goes to grammar_conformance_{intel,amd}.md beside it. Exit status 1
when llama.cpp refuses an output or an output fails its schema.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, cpu_vendor, import_llama_cpp, model_arg,  # noqa: E402
                      out_option, print_table, results_path, run_record, table_lines,
                      threads_option, write_results)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/llama_grammar_ref.py and tests/graphs/grammar/grammar_files.py: the llama.cpp reference
sys.path[:0] = [os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "tests", "graphs", "grammar")]

# per grammar file: (chat?, prompt) -- a short text the grammar's output can follow
PROMPTS: dict[str, tuple[bool, str]] = {
    "arithmetic": (False, "Compute:\n"),
    "c": (False, "A C program:\n"),
    "chess": (False, "The moves of a famous chess game:\n"),
    "english": (False, "A short sentence about the sea:\n"),
    "japanese": (False, "日本語の短い文:\n"),
    "json": (True, "Give a JSON object describing a book, with its title, author and year."),
    "json_arr": (True, "Give a JSON array of three fruits, each an object with a name and a "
                       "color."),
    "list": (False, "A shopping list:\n"),
}

# name -> (schema, the chat request for it)
SCHEMAS: dict[str, tuple[dict, str]] = {
    "person": ({
        "type": "object",
        "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "maxLength": 40}},
        "required": ["name", "age"]},
        "Describe a person as a JSON object with a first name (name), an age and, "
        "optionally, an email."),
    "product_enum": ({
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "in_stock": {"type": "boolean"},
                       "note": {"type": "string", "maxLength": 30}},
        "required": ["color", "size", "in_stock"]},
        "Describe a T-shirt as a JSON object with its color, size and whether it is in "
        "stock (in_stock)."),
    "tags_arrays": ({
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "minItems": 1, "maxItems": 3},
                       "scores": {"type": "array",
                                  "items": {"type": "integer", "minimum": 1, "maximum": 10},
                                  "minItems": 2, "maxItems": 4}},
        "required": ["tags", "scores"]},
        "Give a JSON object for a movie review: a list of 1 to 3 short tags and a list of 2 "
        "to 4 scores from 1 to 10."),
    "order_nested": ({
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {"type": "object",
                         "properties": {
                             "name": {"type": "string", "maxLength": 20},
                             "address": {"type": "object",
                                         "properties": {
                                             "city": {"type": "string", "maxLength": 20},
                                             "zip": {"type": "string",
                                                     "pattern": "^[0-9]{5}$"}},
                                         "required": ["city", "zip"]}},
                         "required": ["name", "address"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": {"type": "string", "maxLength": 10},
                                               "qty": {"type": "integer", "minimum": 1,
                                                       "maximum": 99}},
                                "required": ["sku", "qty"]}}},
        "required": ["order_id", "customer", "items"]},
        "Give a shop order as a JSON object: order_id, the customer (name and address with "
        "city and zip) and 1 to 3 items (sku and qty)."),
    "event_date": ({
        "type": "object",
        "properties": {"event": {"type": "string", "maxLength": 40},
                       "date": {"type": "string", "pattern": "^[0-9]{4}-[0-1][0-9]-[0-3][0-9]$"},
                       "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                       "attendees": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["event", "date"]},
        "Give a calendar event as a JSON object: its name (event), the date as YYYY-MM-DD, "
        "optionally the time as HH:MM and the number of attendees."),
    "weather_bounds": ({
        "type": "object",
        "properties": {"temperature": {"type": "integer", "minimum": -40, "maximum": 50},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "wind": {"type": "object",
                                "properties": {"speed": {"type": "number"},
                                               "direction": {"enum": ["N", "E", "S", "W"]}},
                                "required": ["speed"]}},
        "required": ["temperature", "condition"], "additionalProperties": False},
        "Give today's weather as a JSON object: temperature in Celsius, humidity in percent, "
        "the condition and the wind."),
}


def ref_prefix_ok(ref: Any, text: str, tokens: list[int]) -> tuple[bool, str]:
    """llama.cpp's grammar allowed every token when it came (an output cut by length)."""
    s = ref.sampler(text)
    try:
        for i, t in enumerate(tokens):
            if not ref._apply(s, np.array([t]))[0]:
                return False, f"token {i} ({t}) is not allowed there"
            ref.lc.llama_sampler_accept(s, int(t))
        return True, ""
    finally:
        ref.lc.llama_sampler_free(s)


def check(ref: Any, grammar: str, tokens: list[int], eog: frozenset[int]) -> tuple[bool, str]:
    if tokens and tokens[-1] in eog:
        return ref.accepts(grammar, tokens)
    return ref_prefix_ok(ref, grammar, tokens)


def generate(eng: Any, prompt: list[int], grammar: str, seeds: list[int], n: int,
             np_: int) -> list[dict]:
    """Each seed's output under `grammar`: tokens, stop reason, full masks; waves of np_."""
    from ggraph.graphs.runtime.parallel import generate_parallel
    from ggraph.graphs.runtime.sampling import Sampler, SamplerParams

    out = []
    for w in range(0, len(seeds), np_):
        wave = seeds[w:w + np_]
        samplers = [Sampler(SamplerParams(seed=s, grammar=grammar), eng.tokenizer) for s in wave]
        try:
            res = generate_parallel(eng, [prompt] * len(wave), n, samplers)
        except Exception as e:   # noqa: BLE001 -- a crash is a result, reported per seed
            eng.reset()
            out += [{"seed": s, "tokens": [], "stop": "error", "n_resampled": 0,
                     "error": f"{type(e).__name__}: {e}"} for s in wave]
            continue
        out += [{"seed": s, "tokens": r.tokens, "stop": r.stop,
                 "n_resampled": smp.n_resampled} for s, r, smp in zip(wave, res, samplers)]
    return out


def text_of(tok: Any, tokens: list[int]) -> str:
    body = tokens[:-1] if tokens and tokens[-1] in tok.eog_ids else tokens
    return tok.decode(body)


def prompt_ids(tok: Any, chat: bool, text: str) -> list[int]:
    return tok.encode(tok.chat(text) if chat else text)


def run_files(eng: Any, spec: str, ref: Any, files: dict[str, str], a: argparse.Namespace
              ) -> list[dict]:
    tok, rows = eng.tokenizer, []
    seeds = list(range(1, a.seeds + 1))
    for name in (g for g in PROMPTS if g in files):
        t0 = time.perf_counter()
        chat, ptext = PROMPTS[name]
        gens = generate(eng, prompt_ids(tok, chat, ptext), files[name], seeds, a.n, a.np)
        t_gen = time.perf_counter() - t0
        for g in gens:
            if g["stop"] == "error":
                g["ok"], g["why"] = False, g["error"]
            else:
                g["ok"], g["why"] = check(ref, files[name], g["tokens"], tok.eog_ids)
            g["text"] = text_of(tok, g["tokens"])
        n_tok = sum(len(g["tokens"]) for g in gens)
        rows.append(dict(
            model=spec, grammar=name, n=len(gens), accepted=sum(g["ok"] for g in gens),
            eog=sum(g["stop"] == "eog" for g in gens),
            length=sum(g["stop"] in ("n_predict", "context full") for g in gens),
            errors=sum(g["stop"] == "error" for g in gens),
            mean_tokens=n_tok / max(1, len(gens)),
            masks_per_token=sum(g["n_resampled"] for g in gens) / max(1, n_tok),
            gen_s=t_gen, s=time.perf_counter() - t0, prompt=ptext, chat=chat, outputs=gens))
        r = rows[-1]
        print(f"  {spec} {name}: {r['accepted']}/{r['n']} accepted, eog {r['eog']}, length "
              f"{r['length']}, {r['mean_tokens']:.1f} tokens, {r['masks_per_token']:.3f} "
              f"masks/token, {r['s']:.1f} s", flush=True)
        for g in gens:
            if not g["ok"]:
                print(f"    REFUSED seed {g['seed']}: {g['why']}: {g['text'][:160]!r}",
                      flush=True)
    return rows


def compact(rows: list[dict]) -> list[dict]:
    """The rows as written: each output's token ids as one line of text (the JSON stays
    small), the rest as measured."""
    return [{**r, "outputs": [{**g, "tokens": " ".join(map(str, g["tokens"]))}
                              for g in r["outputs"]]} for r in rows]


def run_schemas(eng: Any, spec: str, ref: Any, a: argparse.Namespace) -> list[dict]:
    import jsonschema

    from ggraph.graphs.grammar.json_schema import schema_to_gbnf

    tok, rows = eng.tokenizer, []
    seeds = list(range(1, a.schema_runs + 1))
    for name, (schema, ask) in SCHEMAS.items():
        t0 = time.perf_counter()
        gbnf = schema_to_gbnf(schema)
        request = ask + " Reply with the JSON only."
        gens = generate(eng, prompt_ids(tok, True, request), gbnf, seeds, a.schema_n, a.np)
        for g in gens:
            g["text"] = text_of(tok, g["tokens"])
            g["ref_ok"], g["ref_why"] = (False, g["error"]) if g["stop"] == "error" else \
                check(ref, gbnf, g["tokens"], tok.eog_ids)
            g["valid"], g["why"] = None, ""
            if g["stop"] != "eog":
                continue
            try:
                jsonschema.validate(json.loads(g["text"]), schema)
                g["valid"] = True
            except (ValueError, jsonschema.ValidationError) as e:
                g["valid"], g["why"] = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
        ended = [g for g in gens if g["stop"] == "eog"]
        n_tok = sum(len(g["tokens"]) for g in gens)
        rows.append(dict(
            model=spec, schema=name, n=len(gens), ended=len(ended),
            valid=sum(bool(g["valid"]) for g in ended),
            invalid=sum(g["valid"] is False for g in ended),
            length=sum(g["stop"] in ("n_predict", "context full") for g in gens),
            errors=sum(g["stop"] == "error" for g in gens),
            ref_refused=sum(not g["ref_ok"] for g in gens),
            mean_tokens=n_tok / max(1, len(gens)),
            masks_per_token=sum(g["n_resampled"] for g in gens) / max(1, n_tok),
            s=time.perf_counter() - t0, schema_json=schema, request=request, gbnf=gbnf,
            outputs=gens))
        r = rows[-1]
        print(f"  {spec} {name}: valid {r['valid']}/{r['ended']} ended, length-cut "
              f"{r['length']}, llama.cpp refused {r['ref_refused']}, {r['s']:.1f} s",
              flush=True)
        for g in gens:
            if g["valid"] is False or not g["ref_ok"]:
                print(f"    FAILED seed {g['seed']}: {g['why'] or g['ref_why']}: "
                      f"{g['text'][:200]!r}", flush=True)
    return rows


FILE_COLS = [Column("model", align="<"), Column("grammar", align="<"),
             Column(lambda r: f"{r['accepted']}/{r['n']}", "accepted"),
             Column("eog", "eog"), Column("length", "length"),
             Column("mean_tokens", "mean tok", "{:.1f}"),
             Column("masks_per_token", "masks/tok", "{:.3f}"), Column("s", "s", "{:.1f}")]
SCHEMA_COLS = [Column("model", align="<"), Column("schema", align="<"),
               Column(lambda r: f"{r['valid']}/{r['ended']}", "valid/ended"),
               Column("length", "length-cut"), Column("ref_refused", "llama.cpp refused"),
               Column("mean_tokens", "mean tok", "{:.1f}"),
               Column("masks_per_token", "masks/tok", "{:.3f}"), Column("s", "s", "{:.1f}")]


def write_markdown(path: str, file_rows: list[dict], schema_rows: list[dict],
                   notes: list[str], a: argparse.Namespace) -> None:
    rec = run_record(a)
    lines = [f"# Constrained output checked by llama.cpp's grammar: {rec['command']}", "",
             f"{rec['cpu']}, {a.threads} threads; ggraph {rec['commit']}"
             f"{' (uncommitted changes)' if rec['uncommitted'] else ''}, {rec['date']}; "
             f"llama-cpp-python {rec['llama_cpp_python']} (the reference grammar).", ""]
    if file_rows:
        lines += [f"llama.cpp's grammar files, {a.seeds} seeds each, llama.cpp's default chain "
                  f"(temp 0.8), up to {a.n} tokens; accepted: by llama.cpp's grammar sampler "
                  f"(whole output with its end, or every token of a length-cut one); masks/tok: "
                  f"full-vocabulary masks the rejection scheme needed per token.", "",
                  *table_lines(file_rows, FILE_COLS, markdown=True), ""]
    if schema_rows:
        lines += [f"JSON schemas, {a.schema_runs} generations each on {schema_rows[0]['model']}, "
                  f"up to {a.schema_n} tokens; valid/ended: outputs that ended by "
                  f"end-of-generation and pass jsonschema.validate; length-cut outputs are not "
                  f"checked against the schema (llama.cpp's grammar checks their tokens).", "",
                  *table_lines(schema_rows, SCHEMA_COLS, markdown=True), ""]
    lines += notes
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[threads_option(2),
                                          out_option(results_path("grammar_conformance.json"))])
    ap.add_argument("-m", "--model", default="default,qwen2.5-coder-0.5b", metavar="NAMES",
                    help="models, a comma list (default default,qwen2.5-coder-0.5b); the "
                         "schemas run on the first")
    ap.add_argument("--seeds", type=int, default=20, help="seeds per grammar file (default 20)")
    ap.add_argument("-n", type=int, default=96, help="tokens per output (default 96)")
    ap.add_argument("--schema-runs", type=int, default=50,
                    help="generations per JSON schema (default 50)")
    ap.add_argument("--schema-n", type=int, default=160,
                    help="tokens per schema output (default 160)")
    ap.add_argument("--np", type=int, default=10, help="sequences per batch (default 10)")
    ap.add_argument("--skip-files", action="store_true", help="only the JSON schemas")
    ap.add_argument("--skip-schemas", action="store_true", help="only the grammar files")
    a = ap.parse_args(argv)
    for flag, v in (("--seeds", a.seeds), ("-n", a.n), ("--schema-runs", a.schema_runs),
                    ("--schema-n", a.schema_n), ("--np", a.np), ("-t", a.threads)):
        if v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    try:
        models = [model_arg(s.strip()) for s in a.model.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if not models:
        ap.error("-m: no model")

    llama_cpp = import_llama_cpp()          # before the engine: OpenMP's settings first
    from grammar_files import grammar_files
    from llama_grammar_ref import LlamaGrammarRef

    from ggraph.graphs.grammar.constraint import engine_missing
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    if engine_missing():
        raise SystemExit(f"grammar_conformance: {engine_missing()}")
    files = grammar_files()
    if not a.skip_files and len(files) < len(PROMPTS):
        print(f"note: only {sorted(files)} of llama.cpp's grammar files were found "
              f"(GGRAPH_LLAMACPP_SRC)")

    t_start = time.perf_counter()
    file_rows: list[dict] = []
    schema_rows: list[dict] = []
    for i, path in enumerate(models):
        do_schemas = i == 0 and not a.skip_schemas
        if a.skip_files and not do_schemas:
            continue
        n_max = max(a.n, a.schema_n if do_schemas else 0)
        # a unified cache of n_ctx cells for all --np sequences: prompts (< 192 tokens) and
        # outputs of every sequence of a wave
        n_ctx = -(-a.np * (192 + n_max) // 256) * 256
        eng = Engine(str(path), EngineConfig(n_ctx=n_ctx, n_seq_max=a.np, kv_unified=True,
                                             n_threads=a.threads, adaptive_threads=False,
                                             warmup=True))
        ref = LlamaGrammarRef(llama_cpp, str(path))
        try:
            print(f"{path.spec}: {eng.tokenizer.n_vocab} tokens, n_ctx {n_ctx} for {a.np} "
                  f"sequences", flush=True)
            if not a.skip_files:
                file_rows += run_files(eng, path.spec, ref, files, a)
            if do_schemas:
                schema_rows += run_schemas(eng, path.spec, ref, a)
        finally:
            ref.close()
        del eng

    refused = sum(r["n"] - r["accepted"] for r in file_rows)
    bad_schema = sum(r["invalid"] + r["ref_refused"] for r in schema_rows)  # crashes too
    print()
    if file_rows:
        print(f"llama.cpp's grammar files: {a.seeds} seeds, default chain (temp 0.8), up to "
              f"{a.n} tokens; accepted by llama.cpp's grammar (eog: ended by the grammar, "
              f"length: cut at -n, its tokens checked); masks/tok: full masks per token\n")
        print_table(file_rows, FILE_COLS, sep="  ")
        print()
    if schema_rows:
        print(f"JSON schemas: {a.schema_runs} generations each, up to {a.schema_n} tokens; "
              f"valid/ended: ended by end-of-generation and jsonschema.validate passes; "
              f"length-cut outputs are not schema-checked (not counted invalid)\n")
        print_table(schema_rows, SCHEMA_COLS, sep="  ")
        print()
    total_s = time.perf_counter() - t_start
    notes = [f"Total {total_s:.0f} s. llama.cpp refused {refused} grammar-file output(s); "
             f"{bad_schema} schema output(s) failed (invalid, refused by llama.cpp or a crash)."]
    print(notes[0])
    write_results(a.out, args=a, argv=argv, extra=dict(
        total_s=total_s, refused=refused, schema_failures=bad_schema,
        grammar_files=compact(file_rows), schemas=compact(schema_rows)))
    vendor = cpu_vendor()
    if vendor and a.out:
        base = os.path.splitext(a.out)[0]
        write_markdown(f"{base}_{vendor}.md", file_rows, schema_rows, notes, a)
    return 1 if refused or bad_schema else 0


if __name__ == "__main__":
    sys.exit(main())
