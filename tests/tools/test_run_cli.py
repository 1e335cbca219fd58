"""`ggraph run` as a llama-cli user types it: llama.cpp's flag spellings, sampling with a seed,
`--temp 0` as greedy, the interactive chat keeping its KV cache, and llama.cpp's message order
(memory at load on stderr, the text on stdout, llama_perf's lines last)."""
from __future__ import annotations

import io
import re

import pytest

from ggraph.cli import main

PROMPT = "The capital of France is"


def run(capsys, *argv: str) -> tuple[str, str]:
    assert main(["run", *argv]) == 0
    cap = capsys.readouterr()
    return cap.out, cap.err


def test_same_seed_same_text_other_seed_other_text(capsys):
    args = ("-m", "default", "-p", PROMPT, "-n", "24", "-c", "256", "--temp", "1.5",
            "--top-k", "0", "--top-p", "1.0", "--min-p", "0")
    a, _ = run(capsys, *args, "--seed", "7")
    b, _ = run(capsys, *args, "--seed", "7")
    c, _ = run(capsys, *args, "--seed", "8")
    assert a == b and a.startswith(PROMPT)
    assert a != c


def test_temp_0_is_greedy(capsys):
    from ggraph.graphs.runtime.engine import Engine, EngineConfig
    from ggraph.graphs.gguf.fetch import resolve_model

    out, err = run(capsys, "default", "-p", PROMPT, "-n", "8", "-c", "256", "--temp", "0",
                   "-fa", "off")
    eng = Engine(resolve_model("default"), EngineConfig(n_ctx=256))
    ids = list(eng.generate(eng.tokenizer.encode(PROMPT), 8))
    ends = eng.tokenizer.eog_ids
    kept = ids[:next((i for i, t in enumerate(ids) if t in ends), len(ids))]
    assert out.strip() == (PROMPT + eng.tokenizer.decode(kept)).strip()


def test_llama_cpp_spellings_and_message_order(capsys, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Once upon a time")
    out, err = run(capsys, "-m", "default", "-f", str(f), "-n", "4", "-c", "256", "-b", "64",
                   "-ub", "512", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-amb", "256",
                   "-t", "1", "--repeat-penalty", "1.1", "--seed", "1")
    assert out.startswith("Once upon a time")
    lines = err.splitlines()
    kv = next(i for i, x in enumerate(lines) if x.startswith("llama_kv_cache: size"))
    assert "K (q8_0)" in lines[kv] and "V (q8_0)" in lines[kv]
    perf = [i for i, x in enumerate(lines) if x.startswith("llama_perf_context_print:")]
    assert len(perf) == 4 and kv < perf[0]
    assert re.search(r"eval time = .* /\s+\d+ runs", lines[perf[2]])
    # -b caps the ubatch as in llama.cpp: 64 tokens per ubatch, so the worst case is 64 wide
    assert "CPU compute buffer size" in err


def test_cnv_is_not_c_nv_and_keeps_the_cache(capsys, monkeypatch):
    from ggraph.graphs.runtime.engine import Engine

    seen = []
    real = Engine.eval

    def spy(self, tokens, *a, **kw):
        seen.append((self.cache.n_used, len(tokens)))
        return real(self, tokens, *a, **kw)

    monkeypatch.setattr(Engine, "eval", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi!\nAnd a second turn.\n/exit\n"))
    out, err = run(capsys, "default", "-cnv", "-n", "4", "-c", "512", "--temp", "0",
                   "--no-warmup")
    # two turns: the second starts where the first ended (the cache is kept), and its
    # prompt holds only the new turn, not the whole conversation again
    starts = [(n_used, n) for n_used, n in seen if n > 1]
    assert len(starts) == 2 and starts[0][0] == 0 and starts[1][0] > starts[0][1]
    assert starts[1][1] < starts[1][0]


def test_version_and_devices(capsys):
    out, _ = run(capsys, "--version")
    assert re.match(r"ggraph \d+\.\d+", out)
    out, _ = run(capsys, "--list-devices")
    assert out.startswith("Available devices:") and "CPU" in out


@pytest.mark.parametrize("argv,msg", [
    (["-p", "x", "-f", "y"], "not both"),
    (["default", "-m", "gemma3"], "two models"),
    (["--top-p", "1.5"], "top_p (--top-p)"),
    (["--sampler-seq", "q"], "--sampler-seq"),
    (["-md", "default", "--draft-max", "4"], "--draft-max was removed (as in llama.cpp); use "
                                             "--spec-draft-n-max"),
    (["-md", "default", "-cnv"], "the interactive chat does not speculate yet"),
    (["-md", "default", "--draft-p-min", "2"], "--draft-p-min must be in [0, 1]"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, msg):
    assert main(["run", *argv, "-n", "1", "-c", "64"]) == 1
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_warmup_is_load_time_not_prompt_time(capsys):
    """The warmup (where a first run compiles) is counted in load time, and the cache it used
    is emptied: the text equals a run without warmup."""
    a, err = run(capsys, "default", "-p", PROMPT, "-n", "6", "-c", "256", "--temp", "0")
    b, _ = run(capsys, "default", "-p", PROMPT, "-n", "6", "-c", "256", "--temp", "0",
               "--no-warmup")
    assert a == b


def test_profile_table(capsys):
    """--profile prints ggml-perf-style tables: per op kind and per node name."""
    _, err = run(capsys, "default", "-p", PROMPT, "-n", "3", "-c", "256", "--temp", "0",
                 "--profile", "--no-warmup")
    head = [x for x in err.splitlines() if x.startswith(("op ", "node "))]
    assert [x.split()[0] for x in head] == ["op", "node"]
    assert re.search(r"^mul_mat\s+\d+\s+[\d.]+", err, re.M)
    # the FFN's gate and up run as one call (backends/cpu/fusion.py): one row for the pair
    assert re.search(r"^ffn_gate\+ffn_up\s+\d+", err, re.M)


def test_ngl_without_devices_warns_as_llama_cpp(capsys):
    """llama-cli built without a GPU backend ignores -ngl with a warning; so does ggraph."""
    out, err = run(capsys, "default", "-p", PROMPT, "-n", "2", "-c", "256", "-ngl", "99",
                   "--temp", "0", "--no-warmup")
    assert out.startswith(PROMPT) and "-ngl/--tensor-split are ignored" in err


def test_escapes_reverse_prompt_and_single_turn(capsys, monkeypatch):
    """-p processes escapes as llama-cli does (--no-escape keeps them); -r stops at a text;
    -cnv -st answers one turn and exits without reading more input."""
    a, _ = run(capsys, "default", "-p", "A\\nB", "-n", "1", "-c", "256", "--temp", "0",
               "--no-warmup")
    b, _ = run(capsys, "default", "-p", "A\\nB", "-n", "1", "-c", "256", "--temp", "0",
               "--no-escape", "--no-warmup")
    assert a.startswith("A\nB") and b.startswith("A\\nB")
    full, _ = run(capsys, "default", "-p", PROMPT, "-n", "24", "-c", "256", "--temp", "0",
                  "--no-warmup")
    stop = full[len(PROMPT):].strip().split()[0]          # the first generated word
    cut, _ = run(capsys, "default", "-p", PROMPT, "-n", "24", "-c", "256", "--temp", "0",
                 "-r", stop, "--no-warmup")
    assert cut.rstrip().endswith(stop) and len(cut) < len(full)
    monkeypatch.setattr("sys.stdin", io.StringIO("never read\n"))
    out, _ = run(capsys, "default", "-cnv", "-st", "-p", "Hi!", "-n", "3", "-c", "256",
                 "--temp", "0", "--no-warmup")
    assert out.startswith("> Hi!") and "never read" not in out


def test_model_draft_gives_the_same_text_and_llama_cpps_figures(capsys):
    args = ("default", "-p", "def quicksort(arr):", "-n", "24", "-c", "256", "--temp", "0")
    plain, _ = run(capsys, *args)
    spec, err = run(capsys, *args, "-md", "default", "--spec-draft-n-max", "4")
    assert spec == plain
    assert "n_draft   = 4" in err and "n_predict = 24" in err
    assert re.search(r"accept    = \d+\.\d{3}%", err)


def test_parallel_sequences_give_each_prompts_own_text(capsys, tmp_path):
    """-np 2 over three prompt lines (two waves): greedy, each text is the one `run -p` gives
    alone (flash attention off: its sums do not depend on the other sequence's cells; short
    prompts stay on the mat-vec path)."""
    prompts = ["The capital of France is", "def add(a, b):", "Roses are red,"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n\n")
    common = ("-n", "10", "-c", "256", "--temp", "0", "-fa", "off")
    out, err = run(capsys, "default", "-np", "2", "-f", str(f), *common)
    assert "parallel: 3 sequences, 2 at a time" in err
    for i, p in enumerate(prompts):
        alone, _ = run(capsys, "default", "-p", p, *common)
        assert f"Sequence {i} (prompt" in out
        assert alone.strip() in out, p
    seeds, _ = run(capsys, "default", "-np", "3", "-p", "Once upon a time", "-n", "12", "-c",
                   "256", "--seed", "5")
    texts = seeds.split("Sequence ")[1:]
    assert len(texts) == 3 and len(set(t.split("\n", 1)[1] for t in texts)) > 1
    assert main(["run", "-np", "0", "-n", "1"]) == 1
    assert "-np/--parallel must be >= 1" in capsys.readouterr().err
