"""What a grammar costs per generated token, beside the decode step it rides on (the issue:
"computing the mask must not dominate a token"), and llama.cpp's full mask on the same steps.

Per model (-m, default SmolLM2 135M, Qwen2.5-Coder 0.5B and Gemma 3 270M: 49k, 152k and 262k
tokens) and grammar (llama.cpp's json.gbnf, the GBNF of a JSON schema -- a person with a nested
address and an array of objects --, c.gbnf and list.gbnf), one real generation of up to -n (64)
tokens with ggraph's Engine and Sampler (seed 1, llama.cpp's default chain, temp 0.8) under
the grammar, run twice (the first warms; the second is measured). Per token it times:

- the decode step (Engine.eval of the token: the model's forward and the logits);
- the sampler with the grammar (llama.cpp's common_sampler_sample scheme: the chain draws,
  one single-token check; a refused draw costs a full mask and a second draw) and the same
  chain without a grammar on the same logits: their difference is the grammar's effective
  overhead per token; `masks/tok` is how many full masks the scheme needed per token;
- then, along the same tokens with a fresh grammar state, the full mask
  (GrammarState.mask(), a bool per vocabulary token, p50/p90/max over the steps) and the
  single-token check (GrammarState.allows, median);
- the same full mask through llama.cpp's grammar sampler (llama-cpp-python: llama_sampler_apply
  of llama_sampler_init_grammar over all the vocabulary's tokens, only the C call timed, the
  token array rebuilt untimed before it) on the same steps, when llama-cpp-python is there;
  the allowed sets are compared too (tokens where they differ: see docs/grammar.md).

Under the table: whether the effective overhead stays under 10% of the decode step.

    python benchmarks/grammar_mask.py [-m default,qwen2.5-coder-0.5b,gemma3] [-n 64] [-t 2]
        [--grammars json,schema,c,list] [--no-llama] [-o benchmarks/results/grammar_mask.json]

Needs llguidance (ggraph[grammar]) and llama.cpp's grammar files (tests/graphs/grammar/
grammar_files.py). A table on stdout; the JSON holds every step's times with the run record
(CPU); a markdown copy goes to grammar_mask_{intel,amd}.md beside it.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchlib.py: run or loaded by path
from benchlib import (Column, cpu_vendor, import_llama_cpp, model_arg,  # noqa: E402
                      out_option, percentile, print_table, results_path, run_record,
                      table_lines, threads_option, write_results)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tests/llama_grammar_ref.py and tests/graphs/grammar/grammar_files.py: the llama.cpp peer
sys.path[:0] = [os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "tests", "graphs", "grammar")]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "country": {"type": "string"}},
                    "required": ["city", "country"]},
        "children": {"type": "array", "maxItems": 4,
                     "items": {"type": "object",
                               "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer", "minimum": 0}},
                               "required": ["name", "age"]}},
        "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "address", "children"]}

# grammar -> (chat?, prompt)
PROMPTS = {
    "json": (True, "Give a JSON object describing a book: title, author, year, genres and a "
                   "short summary."),
    "schema": (True, "Describe a person as JSON: name, age, address (street, city, country), "
                     "children (name and age each) and hobbies."),
    "c": (False, "A C program:\n"),
    "list": (False, "A shopping list:\n"),
}


def grammar_texts(names: list[str]) -> dict[str, str]:
    from grammar_files import grammar_files

    from ggraph.graphs.grammar.json_schema import schema_to_gbnf

    files = grammar_files()
    out = {}
    for name in names:
        if name == "schema":
            out[name] = schema_to_gbnf(PERSON)
        elif name in files:
            out[name] = files[name]
        else:
            print(f"note: llama.cpp's {name}.gbnf was not found (GGRAPH_LLAMACPP_SRC); skipped")
    return out


def generation(eng: Any, prompt: list[int], grammar: str, n: int) -> dict:
    """One generation under `grammar`, timing per token the sampler with and without the
    grammar on the same logits and the decode step."""
    from ggraph.graphs.runtime.sampling import Sampler, SamplerParams

    tok = eng.tokenizer
    sg = Sampler(SamplerParams(seed=1, grammar=grammar), tok)
    sp = Sampler(SamplerParams(seed=1), tok)
    eng.reset()
    logits = eng.eval(prompt, n_past=0)
    sg.accept_many(prompt)
    sp.accept_many(prompt)
    tokens, t_g, t_p, t_dec, resampled = [], [], [], [], []
    for i in range(n):
        before = sg.n_resampled
        # the two samplers take turns going first: the first reads logits the decode step just
        # wrote, the second finds them in the cache
        if i % 2:
            t0 = time.perf_counter()
            sp.sample(logits)
            t1 = time.perf_counter()
            t = sg.sample(logits)
            t2 = time.perf_counter()
            t_p.append(t1 - t0)
            t_g.append(t2 - t1)
        else:
            t0 = time.perf_counter()
            t = sg.sample(logits)
            t1 = time.perf_counter()
            sp.sample(logits)
            t2 = time.perf_counter()
            t_g.append(t1 - t0)
            t_p.append(t2 - t1)
        tokens.append(t)
        resampled.append(sg.n_resampled - before)
        if t in tok.eog_ids:
            break
        t3 = time.perf_counter()
        logits = eng.eval([t])
        t_dec.append(time.perf_counter() - t3)
    eng.reset()
    return dict(tokens=tokens, sampler_grammar_s=t_g, sampler_plain_s=t_p, decode_s=t_dec,
                resampled=resampled)


def ggraph_masks(tok: Any, grammar: str, tokens: list[int], reps: int = 5) -> dict:
    """Along `tokens`, each step's full mask (first call at the step) and single-token check
    (median of `reps`), and the masks themselves for the comparison."""
    from ggraph.graphs.grammar.constraint import compile_grammar

    cg = compile_grammar(grammar, tok)
    st = cg.start()
    t_mask, t_allows, masks = [], [], []
    for t in tokens:
        t0 = time.perf_counter()
        m = st.mask()
        t_mask.append(time.perf_counter() - t0)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ok = st.allows(t)
            times.append(time.perf_counter() - t0)
        t_allows.append(statistics.median(times))
        if not (ok and m[t]):
            raise AssertionError(f"the grammar refuses token {t} that its sampler drew")
        masks.append(m)
        if t in tok.eog_ids:
            break
        st.accept(t)
    # the differences from llama.cpp docs/grammar.md keeps (tests/graphs/grammar/
    # test_constraint.py leaves them out too): lone bytes F5..FF, which llama.cpp lets into a
    # [^...] class, and the tokens ggraph refuses for ending inside a character there
    lone = np.array([len(p) == 1 and p[0] >= 0xF5 for p in cg.vocab.pieces])
    known = lone | (cg.refused & ~cg.vocab.never)
    return dict(mask_s=t_mask, allows_s=t_allows, masks=masks, known=known)


def llama_masks(ref: Any, grammar: str, tokens: list[int], eog: frozenset[int]) -> dict:
    """llama.cpp's grammar sampler over the whole vocabulary at each step: only
    llama_sampler_apply is timed."""
    lc, n = ref.lc, ref.n_vocab
    dt = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    assert dt.itemsize == ctypes.sizeof(lc.llama_token_data)
    data = np.zeros(n, dt)
    ids = np.arange(n, dtype=np.int32)
    s = ref.sampler(grammar)
    t_mask, masks = [], []
    try:
        for t in tokens:
            data["id"], data["logit"], data["p"] = ids, 0.0, 0.0
            arr = lc.llama_token_data_array(
                data=data.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=n,
                selected=-1, sorted=False)
            t0 = time.perf_counter()
            lc.llama_sampler_apply(s, ctypes.byref(arr))
            t_mask.append(time.perf_counter() - t0)
            # the sampler may reorder or shrink the array it was given: read it by id
            got = data[:arr.size]
            m = np.zeros(n, bool)
            m[got["id"][got["logit"] != -np.inf]] = True
            masks.append(m)
            if t in eog:
                break
            lc.llama_sampler_accept(s, int(t))
    finally:
        lc.llama_sampler_free(s)
    return dict(mask_s=t_mask, masks=masks)


def ms(v: list[float], q: float) -> float | None:
    p = percentile(v, q)
    return None if p is None else p * 1e3


def measure(eng: Any, spec: str, ref: Any, name: str, grammar: str, a: argparse.Namespace
            ) -> dict:
    tok = eng.tokenizer
    chat, text = PROMPTS[name]
    prompt = tok.encode(tok.chat(text) if chat else text)
    generation(eng, prompt, grammar, a.n)                 # untimed: warms the same path
    g = generation(eng, prompt, grammar, a.n)
    tokens = g["tokens"]
    ours = ggraph_masks(tok, grammar, tokens)
    row: dict[str, Any] = dict(model=spec, vocab=tok.n_vocab, grammar=name,
                               tokens=len(tokens), eog=bool(tokens and tokens[-1] in tok.eog_ids))
    n_tok = len(tokens)
    over = [x - y for x, y in zip(g["sampler_grammar_s"], g["sampler_plain_s"])]
    row.update(
        decode_ms=1e3 * statistics.mean(g["decode_s"]) if g["decode_s"] else None,
        decode_p50_ms=ms(g["decode_s"], .5),
        sampler_plain_ms=1e3 * sum(g["sampler_plain_s"]) / n_tok,
        sampler_grammar_ms=1e3 * sum(g["sampler_grammar_s"]) / n_tok,
        overhead_ms=1e3 * sum(over) / n_tok,
        # the grammar's cost on a step whose draw it allowed (one check, the accept), and on
        # one whose draw it refused (a full mask, the chain and a draw again)
        overhead_kept_ms=ms([o for o, r in zip(over, g["resampled"]) if not r], .5),
        overhead_refused_ms=ms([o for o, r in zip(over, g["resampled"]) if r], .5),
        masks_per_token=sum(g["resampled"]) / n_tok,
        mask_p50_ms=ms(ours["mask_s"], .5), mask_p90_ms=ms(ours["mask_s"], .9),
        mask_max_ms=1e3 * max(ours["mask_s"]),
        allows_us=1e6 * statistics.median(ours["allows_s"]),
        allowed_mean=statistics.mean(int(m.sum()) for m in ours["masks"]))
    row["overhead_pct"] = 100 * row["overhead_ms"] / row["decode_ms"] if row["decode_ms"] \
        else None
    row["mask_pct"] = 100 * row["mask_p50_ms"] / row["decode_ms"] if row["decode_ms"] else None
    if ref is not None:
        theirs = llama_masks(ref, grammar, tokens, tok.eog_ids)
        n = min(ours["masks"][0].size, theirs["masks"][0].size)
        diff = [x[:n] != y[:n] for x, y in zip(ours["masks"], theirs["masks"])]
        other = [int((d & ~ours["known"][:n]).sum()) for d in diff]
        row.update(llama_p50_ms=ms(theirs["mask_s"], .5), llama_p90_ms=ms(theirs["mask_s"], .9),
                   llama_max_ms=1e3 * max(theirs["mask_s"]),
                   mask_diff_steps=sum(bool(d.any()) for d in diff),
                   mask_diff_tokens_max=max(int(d.sum()) for d in diff),
                   mask_diff_other=sum(other), llama_mask_s=theirs["mask_s"])
    row.update(text=tok.decode([t for t in tokens if t not in tok.eog_ids]),
               token_ids=tokens, **{k: g[k] for k in ("sampler_grammar_s", "sampler_plain_s",
                                                      "decode_s", "resampled")},
               mask_s=ours["mask_s"], allows_s=ours["allows_s"])
    return row


F2, F3 = "{:.2f}", "{:.3f}"
COLS = [Column("model", align="<"), Column("vocab"), Column("grammar", align="<"),
        Column("tokens", "tok"), Column("decode_ms", "decode ms", F2),
        Column("sampler_plain_ms", "sampler ms", F3),
        Column("overhead_ms", "grammar +ms", F3), Column("overhead_pct", "% decode", "{:.1f}"),
        Column("masks_per_token", "masks/tok", F3),
        Column("overhead_kept_ms", "kept +ms", F3),
        Column("overhead_refused_ms", "refused +ms", F2),
        Column(lambda r: f"{r['mask_p50_ms']:.2f}/{r['mask_p90_ms']:.2f}/{r['mask_max_ms']:.2f}",
               "mask ms p50/p90/max"),
        Column(lambda r: None if r.get("llama_p50_ms") is None else
               f"{r['llama_p50_ms']:.2f}/{r['llama_p90_ms']:.2f}/{r['llama_max_ms']:.2f}",
               "llama.cpp mask ms p50/p90/max"),
        Column("allows_us", "allows us", "{:.1f}")]


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r.get("overhead_pct") is None:
            out.append(f"{r['model']} {r['grammar']}: no decode step measured")
            continue
        ok = r["overhead_pct"] < 10
        out.append(f"{r['model']} {r['grammar']}: grammar overhead {r['overhead_ms']:.3f} ms = "
                   f"{r['overhead_pct']:.1f}% of the {r['decode_ms']:.1f} ms decode step: "
                   f"{'< 10%, does not dominate' if ok else 'NOT under 10%'}; a full mask "
                   f"(p50) is {r['mask_pct']:.1f}% of it"
                   + (f"; masks differ from llama.cpp's at {r['mask_diff_steps']} of "
                      f"{r['tokens']} steps (at most {r['mask_diff_tokens_max']} tokens; "
                      f"{r['mask_diff_other']} outside the known, kept differences)"
                      if "mask_diff_steps" in r else ""))
    return out


HEAD = ("decode ms: the decode step per token (Engine.eval); sampler ms: the chain without a "
        "grammar; grammar +ms: what the grammar adds to the sampler per token (its "
        "single-token check, and a full mask and second draw where the draw was refused); "
        "masks/tok: full masks that needed per token; kept/refused +ms: the grammar's cost "
        "(median) on a step whose first draw it allowed / refused; mask ms: one full mask "
        "(GrammarState.mask) per step; llama.cpp mask ms: llama_sampler_apply of its grammar "
        "over the whole vocabulary on the same steps; allows us: the single-token check")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 parents=[threads_option(2),
                                          out_option(results_path("grammar_mask.json"))])
    ap.add_argument("-m", "--model", default="default,qwen2.5-coder-0.5b,gemma3",
                    metavar="NAMES", help="models, a comma list (default "
                                          "default,qwen2.5-coder-0.5b,gemma3)")
    ap.add_argument("-n", type=int, default=64, help="tokens per generation (default 64)")
    ap.add_argument("--grammars", default="json,schema,c,list",
                    help=f"grammars, a comma list of {','.join(PROMPTS)} (default all)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's masks")
    a = ap.parse_args(argv)
    if a.n < 1 or a.threads < 1:
        ap.error("-n and -t must be >= 1")
    names = [g.strip() for g in a.grammars.split(",") if g.strip()]
    if not names or any(g not in PROMPTS for g in names):
        ap.error(f"--grammars: a comma list of {','.join(PROMPTS)}")
    try:
        models = [model_arg(s.strip()) for s in a.model.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))

    llama_cpp = None
    if not a.no_llama:
        try:
            llama_cpp = import_llama_cpp()     # before the engine: OpenMP's settings first
        except SystemExit as e:
            print(f"note: {e}; llama.cpp's masks are left out")
    from ggraph.graphs.grammar.constraint import engine_missing
    from ggraph.graphs.runtime.engine import Engine, EngineConfig

    if engine_missing():
        raise SystemExit(f"grammar_mask: {engine_missing()}")
    grammars = grammar_texts(names)
    t_start = time.perf_counter()
    rows = []
    for path in models:
        eng = Engine(str(path), EngineConfig(n_ctx=1024, n_threads=a.threads,
                                             adaptive_threads=False, warmup=True))
        ref = None
        if llama_cpp is not None:
            from llama_grammar_ref import LlamaGrammarRef
            ref = LlamaGrammarRef(llama_cpp, str(path))
        try:
            for name, text in grammars.items():
                t0 = time.perf_counter()
                rows.append(measure(eng, path.spec, ref, name, text, a))
                r = rows[-1]
                print(f"  {path.spec} {name}: {r['tokens']} tokens, decode {r['decode_ms']:.2f}"
                      f" ms, grammar +{r['overhead_ms']:.3f} ms/token, mask p50 "
                      f"{r['mask_p50_ms']:.2f} ms, llama.cpp p50 "
                      f"{r.get('llama_p50_ms') or float('nan'):.2f} ms "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        finally:
            if ref is not None:
                ref.close()
        del eng
    total_s = time.perf_counter() - t_start
    print(f"\n{HEAD}; -t {a.threads}, seed 1, temp 0.8, up to {a.n} tokens\n")
    print_table(rows, COLS, sep="  ")
    lines = verdicts(rows)
    print("\n" + "\n".join(lines) + f"\n\ntotal {total_s:.0f} s")
    short = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]
    write_results(a.out, rows, args=a, argv=argv, extra=dict(
        total_s=total_s, under_10_pct=all((r.get("overhead_pct") or 0) < 10 for r in rows),
        person_schema=PERSON, prompts=PROMPTS, summary=short))
    vendor = cpu_vendor()
    if vendor and a.out:
        rec = run_record(a)
        md = [f"# Grammar cost per token beside the decode step: {rec['command']}", "",
              f"{rec['cpu']}, {a.threads} threads; ggraph {rec['commit']}"
              f"{' (uncommitted changes)' if rec['uncommitted'] else ''}, {rec['date']}; "
              f"llama-cpp-python {rec['llama_cpp_python']} (llama.cpp's masks, same run).", "",
              HEAD + f"; seed 1, temp 0.8, up to {a.n} tokens.", "",
              *table_lines(rows, COLS, markdown=True), "", *(f"- {ln}" for ln in lines), "",
              f"Total {total_s:.0f} s."]
        md_path = f"{os.path.splitext(a.out)[0]}_{vendor}.md"
        with open(md_path, "w", encoding="utf-8") as f:
            f.write("\n".join(md) + "\n")
        print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
