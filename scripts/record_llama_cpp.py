#!/usr/bin/env python
"""Record llama.cpp's answers for the tests that compare ggraph with it, so that they run where
llama-cpp-python is not installed (CI's clean clone): JSON files under tests/data/llama_cpp/
(and the end-of-generation sets under tests/data/eog/), each with the command that wrote it,
llama-cpp-python's version, the date and the model file it ran (name, size, sha256).

    python scripts/record_llama_cpp.py            # every part
    python scripts/record_llama_cpp.py tokenizer sampling

Parts: tokenizer (the corpus' ids for SmolLM2 and Gemma 3), eog, sampling (each step and the
seeded chains on the tests' fixed logits), qwen_tiny, gemma3_tiny, synthetic_tiny,
deepseek2_tiny (logits of the tiny files the tests write, recorded with their sha256),
greedy_smollm2 (SmolLM2's greedy tokens for test_llama's prompt, with the margin between the
two best logits at each step: the tests compare up to the first small one), grammar_greedy
(the same under each of test_greedy's grammars, with the grammar's sha256), imatrix_smollm2
(llama-imatrix's sums on SmolLM2, by digest: this part runs llama.cpp's program). The
inputs are the tests' own (their constants and seeded generators, imported from tests/), so a
recording matches what the test computes. Needs llama-cpp-python and the cached models."""
from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# tests/ (its helpers) and the test folders whose modules hold the inputs recorded here
sys.path[:0] = [str(ROOT / "tests"), *(str(ROOT / "tests" / d) for d in (
    "graphs/tokenizers", "graphs/runtime", "graphs/models", "graphs/testing",
    "graphs/grammar", "graphs/quantize")), str(ROOT)]

import llama_cpp  # noqa: E402

from llama_cpp_ref import DATA, encode_array, model_info, sha256_text  # noqa: E402

SAMPLING_CAP = 64  # kept sets larger than this are recorded by digest


def provenance() -> dict:
    return {"command": " ".join(["python", "scripts/record_llama_cpp.py", *sys.argv[1:]]),
            "llama_cpp_python": llama_cpp.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write(path: Path, rec: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"  {path.relative_to(ROOT)}: {path.stat().st_size / 1024:.1f} KiB", flush=True)


def f32(a) -> dict:
    return encode_array(np.asarray(a, np.float32))


def tokenizer() -> None:
    import test_tokenizer as T
    from ggraph.graphs.gguf.fetch import resolve_model

    for name in ("smollm2", "gemma3"):
        path = resolve_model(name)
        ref = llama_cpp.Llama(path, vocab_only=True, verbose=False)
        corpus = {}
        for f in T.CORPUS:
            text = f.read_text(encoding="utf-8")
            entry = {"sha256": sha256_text(text)}
            for special in (False, True):
                for add_bos in (False, True):
                    entry[T.corpus_key(special, add_bos)] = ref.tokenize(
                        text.encode("utf-8"), add_bos=add_bos, special=special)
            corpus[f.name] = entry
        ref.close()
        write(DATA / f"tokenizer_{name}.json",
              {"recorded": provenance(), "model": model_info(path), "corpus": corpus})


def eog() -> None:
    import test_eog as E
    from ggraph.graphs.gguf.fetch import resolve_model

    for m in E.MODELS:
        path = resolve_model(m)
        write(E.DATA / f"{m}.json", {"model": m, "llama_cpp_python": llama_cpp.__version__,
                                     **E.llama_cpp_special(path), "recorded": provenance(),
                                     "file": model_info(path)})


def sampling() -> None:
    import test_sampling as S
    from ggraph.graphs.runtime.sampling import SamplerParams

    steps = {}
    for kw in S.STEP_CASES:
        for n in S.STEP_SIZES:
            p = SamplerParams(**{**S.OFF, "seed": 11, **kw})
            hist, trials = S.step_inputs(n)
            out = []
            for lg in trials:
                ids, logits, probs = S.lcpp_step(llama_cpp, p, n, hist, lg)
                if ids.size <= SAMPLING_CAP:
                    out.append({"ids": encode_array(ids.astype(np.int32)), "logits": f32(logits),
                                "probs": f32(probs)})
                else:
                    out.append({"digest": S.kept_digest(ids, logits)})
            steps[f"{S.case_id(kw)}|n={n}"] = out
    chains = {S.case_id(kw): S.lcpp_draws(llama_cpp, SamplerParams(**{"seed": 2024, **kw}),
                                          S.chain_inputs()) for kw in S.CHAIN_CASES}
    write(DATA / "sampling.json", {"recorded": provenance(), "steps": steps, "chains": chains})


def qwen_tiny(d: Path) -> None:
    import test_qwen as Q

    cases = {}
    for name, cfg in Q.CASES.items():
        path = Q.write_tiny(d / f"{name}.gguf", cfg)
        cases[name] = {"model": model_info(path), "tokens": Q.TOKENS,
                       "logits": f32(Q.llama_cpp_logits(llama_cpp, path))}
    write(DATA / "qwen_tiny.json", {"recorded": provenance(), "cases": cases})


def gemma3_tiny(d: Path) -> None:
    import test_gemma3 as G

    path = G.write_tiny_gguf(d / "tiny.gguf", n_swa=G.N_SWA)
    toks = G.prompt(**G.LLAMA_CPP_PROMPT)
    logits = G.llama_cpp_logits(llama_cpp, path, toks)[G.RECORDED_ROWS]
    write(DATA / "gemma3_tiny.json", {"recorded": provenance(), "model": model_info(path),
                                      "tokens": toks, "rows": "every fifth position",
                                      "logits": f32(logits)})


def synthetic_tiny(d: Path) -> None:
    import test_synthetic as Sy
    from ggraph.graphs.testing.synthetic import write_synthetic

    path = str(write_synthetic("tiny", d / "tiny.gguf", progress=False))
    toks, logits = Sy.llama_cpp_tokens_and_logits(llama_cpp, path)
    write(DATA / "synthetic_tiny.json", {"recorded": provenance(), "model": model_info(path),
                                         "text": Sy.SYNTHETIC_TEXT, "tokens": toks,
                                         "logits": f32(logits)})


def deepseek2_tiny(d: Path) -> None:
    import test_deepseek2 as D

    cmp = D.compare_module()
    cases = {}
    for i, variant in enumerate(D.LLAMA_CPP_VARIANTS):
        (d / str(i)).mkdir()
        toks, path = D.llama_cpp_case(cmp, d / str(i), variant)
        logits, _ = cmp.llama_cpp_logits(path, toks, n_gen=0)
        cases[str(variant)] = {"model": model_info(path), "tokens": toks, "logits": f32(logits)}
    write(DATA / "deepseek2_tiny.json", {"recorded": provenance(), "cases": cases})


def greedy_smollm2() -> None:
    import test_llama as La
    from ggraph.graphs.gguf.fetch import default_model

    path = str(default_model())
    write(DATA / "greedy_smollm2.json", {
        "recorded": provenance(), "model": model_info(path), "text": La.GREEDY_PROMPT,
        **La.llama_cpp_greedy(llama_cpp, path, La.GREEDY_PROMPT, La.N_GREEDY)})


def grammar_greedy() -> None:
    import test_greedy as Gr
    from grammar_files import grammar_files
    from llama_grammar_ref import llama_cpp_grammar_greedy
    from ggraph.graphs.gguf.fetch import default_model

    path = str(default_model())
    files = grammar_files()
    cases = {name: {"model": model_info(path), "grammar_sha256": sha256_text(files[name]),
                    **llama_cpp_grammar_greedy(llama_cpp, path, text, files[name],
                                               Gr.N_GREEDY)}
             for name, text in Gr.CASES.items() if name in files}
    write(DATA / "grammar_greedy.json", {"recorded": provenance(), "cases": cases})


def seq_ops(d: Path) -> None:
    """test_sequences' scripts of batches and sequence operations, through llama.cpp's
    low-level API; the tiny Gemma 3 is made under the test's own arguments."""
    import test_sequences as S
    from llama_cpp_ref import llama_cpp_script

    class Made:   # tests/conftest.py's tiny_models, writing into d
        def made(self, writer, *args, **kw):
            return writer(d / f"{writer.__module__}.gguf", *args, **kw)

    for name in S.SCRIPTS:
        path, script = S.script_for(name, Made())
        logits = llama_cpp_script(llama_cpp, path, script, S.N_CTX_SCRIPT, 3,
                                  unified=not name.endswith("_streams"))
        stride = max(1, logits[0].size // 4096)   # every stride-th logit: small files
        write(DATA / f"seq_ops_{name}.json", {
            "recorded": provenance(), "model": model_info(path), "script": S.plain(script),
            "stride": stride, "logits": [f32(x[::stride]) for x in logits]})


def imatrix_smollm2() -> None:
    """llama.cpp's llama-imatrix (the program: ../shared/tools/llamacpp-tools.sh builds it)
    on SmolLM2, as test_imatrix runs ggraph's."""
    import test_imatrix as Im

    write(DATA / "imatrix_smollm2.json", Im.record_imatrix_smollm2(provenance()))


PARTS = {"tokenizer": tokenizer, "eog": eog, "sampling": sampling, "qwen_tiny": qwen_tiny,
         "gemma3_tiny": gemma3_tiny, "synthetic_tiny": synthetic_tiny,
         "deepseek2_tiny": deepseek2_tiny, "greedy_smollm2": greedy_smollm2,
         "grammar_greedy": grammar_greedy, "seq_ops": seq_ops, "imatrix_smollm2": imatrix_smollm2}


def main(argv: list[str]) -> int:
    unknown = [a for a in argv if a not in PARTS]
    if unknown:
        print(f"unknown part(s) {unknown}; parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    for name in argv or list(PARTS):
        print(name, flush=True)
        fn = PARTS[name]
        if fn.__code__.co_argcount:
            with tempfile.TemporaryDirectory() as d:
                fn(Path(d))
        else:
            fn()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
